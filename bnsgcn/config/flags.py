"""The training flags: the parser built from the settings' sections, and back.

Each section of :class:`~bnsgcn.config.sections.TrainConfig` is one group of ``--help``.
"""

from __future__ import annotations

import argparse
import dataclasses

from bnsgcn.config.checks import validate
from bnsgcn.config.sections import SETTINGS, TrainConfig, flag_name

GROUPS = {
    "data": "training: the partition set",
    "model": "training: the model",
    "optim": "training: the optimizer",
    "exchange": "training: the boundary exchange",
    "sync": "training: parameter sync",
    "evaluation": "training: evaluation",
    "checkpoint": "training: checkpoints",
    "run": "training: the run",
}


def shown_default(f: dataclasses.Field) -> str:
    """A setting's default as ``--help`` and docs/cli.md show it."""
    if "shown" in f.metadata:
        return f.metadata["shown"]
    if isinstance(f.default, bool):
        return "on" if f.default else "off"
    return f"{f.default:g}" if isinstance(f.default, float) else str(f.default)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every training flag, as the sections define it, to ``parser`` (one group each)."""
    groups = {section: parser.add_argument_group(title) for section, title in GROUPS.items()}
    for name, (section, f) in SETTINGS.items():
        group = groups[section]
        options = {k: v for k, v in f.metadata.items() if k not in ("help", "shown", "flag")}
        help_text = f"{f.metadata['help']} (default {shown_default(f)})"
        if name == "precompute":  # a pair: --precompute / --no-precompute
            pair = group.add_mutually_exclusive_group()
            pair.add_argument("--precompute", dest=name, action="store_true", default=None, help=help_text)
            pair.add_argument("--no-precompute", dest=name, action="store_false", help=argparse.SUPPRESS)
        elif isinstance(f.default, bool):
            group.add_argument(flag_name(f), dest=name, action="store_true", help=f.metadata["help"])
        else:
            group.add_argument(
                flag_name(f), dest=name, default=f.default, **({"type": type(f.default)} | options), help=help_text
            )


def from_args(ns: argparse.Namespace) -> TrainConfig:
    """Build a validated :class:`TrainConfig` from parsed flags (extra attributes ignored)."""
    config = TrainConfig.from_settings(**{k: v for k, v in vars(ns).items() if k in SETTINGS})
    validate(config)
    return config
