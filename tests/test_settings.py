"""Every training flag is defined once (bnsgcn/config/sections.py): the parser is built from the
sections' dataclasses, and docs/cli.md's table of training flags must agree with both."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from bnsgcn.config import SETTINGS, TrainConfig, add_arguments, flag_name, from_args, shown_default, to_argv
from bnsgcn.config.flags import GROUPS
from bnsgcn.errors import UserError

CLI_DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def _documented_flags() -> dict[str, tuple[str, str]]:
    """flag -> (its section, its default cell), from the tables under "### Training flags",
    one per "#### `section`" heading."""
    text = CLI_DOC.read_text().split("### Training flags", 1)[1].split("\n### ", 1)[0]
    flags, section = {}, None
    for line in text.splitlines():
        if heading := re.match(r"#### `(\w+)`", line):
            section = heading.group(1)
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`--"):
            for flag in re.findall(r"`(--[a-z-]+)", cells[0]):
                flags[flag] = (section, cells[1])
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
    for section, f in SETTINGS.values():
        assert documented[flag_name(f)][0] == section, (flag_name(f), "documented under another section")
        if f.default is not None and not isinstance(f.default, bool) and "shown" not in f.metadata:
            cell = documented[flag_name(f)][1]
            assert cell.startswith(f"`{shown_default(f)}`"), (f.name, cell, shown_default(f))


def test_help_groups_the_flags_by_section():
    groups = {g.title: {s for a in g._group_actions for s in a.option_strings} for g in _parser()._action_groups}
    for section, f in SETTINGS.values():
        assert flag_name(f) in groups[GROUPS[section]], (flag_name(f), section)


def test_flat_settings_address_the_sections():
    config = TrainConfig.from_settings(p=0.3, model="gat", eval_every=4, checkpoint_every=2, compress="fp16")
    assert (config.exchange.p, config.model.name, config.evaluation.every, config.checkpoint.every) == (
        0.3,
        "gat",
        4,
        2,
    )
    assert config.grad_wire_format == "fp16" and config.replace(compress_grad="int8").grad_wire_format == "int8"
    assert config.settings()["eval_every"] == 4 and TrainConfig().replace(**config.settings()) == config
    assert list(config.to_json()) == list(SETTINGS)  # config.json: every setting by its flag's name
    with pytest.raises(TypeError, match="unknown training setting 'modle'"):
        TrainConfig.from_settings(modle="gcn")
    with pytest.raises(UserError, match="unknown training setting 'modle'"):  # bad input, for the Python API
        TrainConfig().replace(modle="gcn")


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


def test_the_model_choices_are_the_built_in_layers():
    from bnsgcn.config.sections import MODELS
    from bnsgcn.nn.layers import LAYERS

    assert sorted(MODELS) == sorted(LAYERS)


def test_flags_from_a_configuration_parse_back_to_it():
    # bnsgcn.train hands its settings to the ranks as flags: every kind of value must survive
    config = TrainConfig.from_settings(
        parts_dir=Path("-parts/x y"),  # a leading dash and a space
        p=0.1 + 0.2,  # no short decimal form
        model="gcn",
        hidden=7,
        seed=-3,
        precompute=False,
        remat=True,
        compress_grad="int8",
        staleness=1,
        stale_smoothing=0.25,
        sync="grouped:4:2",
        inject_delay="0:0.5,1:0.1-0.2",
        out=Path("runs/a"),
        timeout=12.5,
    )
    argv = to_argv(config)
    assert from_args(_parser().parse_args(argv)) == config
    assert "--no-precompute" in argv and "--remat" in argv and "--seed=-3" in argv
    assert not any(arg.startswith(("--lr", "--epochs")) for arg in argv)  # defaults stay implicit
    assert to_argv(TrainConfig()) == []
    assert from_args(_parser().parse_args(to_argv(config.replace(precompute=True)))).model.precompute is True
    with pytest.raises(UserError, match="--remat is on or off; pass remat=True or remat=False"):
        to_argv(TrainConfig.from_settings(remat="yes"))
    # a value of the wrong type reaches the parser, which refuses it as on the command line
    with pytest.raises(SystemExit):
        _parser().parse_args(to_argv(TrainConfig.from_settings(hidden=16.0)))
