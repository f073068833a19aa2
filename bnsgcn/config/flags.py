"""The training flags: the parser built from the settings' sections, and back.

Each section of :class:`~bnsgcn.config.sections.TrainConfig` is one group of ``--help``.
"""

from __future__ import annotations

import argparse
import dataclasses

from bnsgcn.config.checks import validate
from bnsgcn.config.sections import SETTINGS, TrainConfig, flag_name
from bnsgcn.errors import UserError

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


class _Joined(argparse.Action):
    """A flag that may be repeated: its values joined by commas (``--logger tensorboard --logger csv`` is
    ``--logger tensorboard,csv``), where a plain flag would keep the last alone."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        earlier = getattr(namespace, self.dest)
        setattr(namespace, self.dest, values if earlier is None else f"{earlier},{values}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every training flag, as the sections define it, to ``parser`` (one group each)."""
    groups = {section: parser.add_argument_group(title) for section, title in GROUPS.items()}
    for name, (section, f) in SETTINGS.items():
        group = groups[section]
        options = {k: v for k, v in f.metadata.items() if k not in ("help", "shown", "flag", "joined")}
        if f.metadata.get("joined"):
            options["action"] = _Joined
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


def to_argv(config: TrainConfig) -> list[str]:
    """The training flags that give ``config``: one per setting that differs from its default,
    as ``--flag=value`` (a value may start with a dash; a list as its items joined by commas), an on/off
    setting as its bare flag.
    Parsing them back (:func:`add_arguments`, :func:`from_args`) gives ``config`` again, with
    the command line's own checks: the Python API (``bnsgcn.train``) passes its settings to the
    ranks this way. An on/off setting given anything but True or False raises :class:`UserError`."""
    argv = []
    for name, (section, f) in SETTINGS.items():
        value = getattr(getattr(config, section), f.name)
        if value is None and f.default is None:
            continue
        if name == "precompute" or isinstance(f.default, bool):
            if not isinstance(value, bool):
                raise UserError(f"{flag_name(f)} is on or off; pass {name}=True or {name}=False, not {value!r}")
            if value != f.default:
                argv.append(flag_name(f) if value else "--no-precompute")
            continue
        if value == f.default and type(value) is type(f.default):
            continue
        if isinstance(value, (list, tuple)):  # a repeatable flag's values from Python (logger=["csv", "wandb"])
            value = ",".join(map(str, value))
        # repr: the shortest text that parses back to the same float (numpy floats print their type)
        argv.append(f"{flag_name(f)}={float(value)!r}" if isinstance(value, float) else f"{flag_name(f)}={value}")
    return argv
