"""Every training flag is defined once (bnsgcn/config/sections.py): the parser is built from the
sections' dataclasses, and docs/cli.md's table of training flags must agree with both."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from bnsgcn.config import SETTINGS, TrainConfig, add_arguments, flag_name, from_args, shown_default

CLI_DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def _documented_flags() -> dict[str, str]:
    """flag -> its default cell, from the table under "### Training flags"."""
    text = CLI_DOC.read_text().split("### Training flags", 1)[1].split("\n### ", 1)[0]
    flags = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`--"):
            for flag in re.findall(r"`(--[a-z-]+)", cells[0]):
                flags[flag] = cells[1]
    return flags


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


def test_docs_table_lists_exactly_the_parser_flags_with_their_defaults():
    parser_flags = {s for a in _parser()._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
    documented = _documented_flags()
    assert set(documented) == parser_flags, (
        f"only in docs: {set(documented) - parser_flags}; only in the parser: {parser_flags - set(documented)}"
    )
    for _, f in SETTINGS.values():
        if f.default is not None and not isinstance(f.default, bool) and "shown" not in f.metadata:
            cell = documented[flag_name(f)]
            assert cell.startswith(f"`{shown_default(f)}`"), (f.name, cell, shown_default(f))


def test_parser_defaults_are_the_dataclass_defaults():
    parsed = from_args(_parser().parse_args([]))
    assert parsed == TrainConfig()
    flipped = from_args(
        _parser().parse_args(
            ["--no-precompute", "--resume", "--out", "x", "--staleness", "1", "--stale-smoothing", "0.5"]
        )
    )
    assert (
        flipped.model.precompute,
        flipped.checkpoint.resume,
        flipped.exchange.staleness,
        flipped.exchange.stale_smoothing,
    ) == (False, True, 1, 0.5)
