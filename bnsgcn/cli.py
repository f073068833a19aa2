"""The conventions every command line of bnsgcn follows (bnsgcn-partition, bnsgcn-train,
bnsgcn-report):

* a flag is written in full: no abbreviation is accepted (``--part`` is not ``--parts``);
* every flag may be written with underscores (``--master_addr``, ``--checkpoint_every``),
  as torchrun and the original BNS-GCN write theirs;
* bad input, an unknown flag included, is one line ``error: <problem>; <fix>`` on stderr and
  exit status 2; an unknown flag names the nearest known one ("did you mean --parts?").

Imports nothing of the engine: the commands answer a bad flag before loading anything.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import NoReturn

from bnsgcn.errors import UserError

USAGE_STATUS = 2


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help, wrapped only at spaces: a flag is never split at one of its dashes."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        text = self._whitespace_matcher.sub(" ", text).strip()
        return textwrap.fill(text, width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False)


class Parser(argparse.ArgumentParser):
    """An :class:`argparse.ArgumentParser` with the conventions of the module.

    ``elsewhere`` maps a flag this command does not take but another command does to the fix
    the error gives ("pass it to bnsgcn-partition (as --method)") instead of a near name.
    """

    def __init__(self, *args, elsewhere: Callable[[str], str | None] | None = None, **kwargs):
        kwargs["allow_abbrev"] = False  # a prefix of a flag is refused, never guessed
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.elsewhere = elsewhere
        self.raises = False

    def parse_known_args(self, args: Sequence[str] | None = None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(self.with_dashes(args), namespace)

    def parse_args(self, args: Sequence[str] | None = None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(self.unknown(extras))
        return parsed

    def with_dashes(self, args: list[str]) -> list[str]:
        """``args`` with every ``--flag_name[=value]`` this parser knows as ``--flag-name``."""
        out = []
        for i, arg in enumerate(args):
            if arg == "--":  # what follows is not flags
                return out + args[i:]
            name, eq, value = arg.partition("=")
            if name.startswith("--") and "_" in name:
                dashed = "--" + name[2:].replace("_", "-")
                if dashed in self._option_string_actions:
                    arg = dashed + eq + value
            out.append(arg)
        return out

    def known_flags(self) -> list[str]:
        return [s for s in self._option_string_actions if s.startswith("--")]

    def unknown(self, extras: list[str]) -> str:
        """The message for arguments nothing took: the first unknown flag, where it belongs
        or the nearest known flag; else the first stray value."""
        flags = [e for e in extras if e.startswith("-") and len(e) > 1 and not _is_number(e)]
        if not flags:
            return f"unexpected argument {extras[0]!r}; see {self.prog} --help"
        given = flags[0].partition("=")[0]
        dashed = "--" + given.lstrip("-").replace("_", "-")
        if self.elsewhere is not None and (where := self.elsewhere(dashed)):
            return f"unknown flag {given} for {self.prog}; {where}"
        near = difflib.get_close_matches(dashed, self.known_flags(), n=1, cutoff=0.6)
        if near:
            return f"unknown flag {given}; did you mean {near[0]}?"
        return f"unknown flag {given}; see {self.prog} --help for the flags"

    def error(self, message: str) -> NoReturn:
        """One line naming the problem and the fix, exit status 2 (argparse's own messages,
        such as an invalid number, get the pointer to ``--help`` as their fix); raised as a
        :class:`UserError` instead where ``raises`` is set (the Python API)."""
        line = message if ";" in message else f"{message}; see {self.prog} --help"
        if self.raises:
            raise UserError(line)
        print(f"error: {line}", file=sys.stderr, flush=True)
        sys.exit(USAGE_STATUS)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class Refused(argparse.Action):
    """A flag accepted by name only to be refused in one line naming bnsgcn's way (a flag of
    another program whose meaning bnsgcn does not have). ``allowed``: values that mean what
    bnsgcn does anyway and pass."""

    def __init__(self, option_strings, dest, *, why: str, allowed: Sequence[str] = (), **kwargs):
        self.why, self.allowed = why, tuple(allowed)
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if values is not None and not isinstance(values, list) and str(values) in self.allowed:
            return
        shown = option_string if values is None or isinstance(values, list) else f"{option_string} {values}"
        parser.error(f"{shown}: {self.why}")


class Ignored(argparse.Action):
    """A flag accepted and without effect: what it asks for is what bnsgcn always does."""

    def __call__(self, parser, namespace, values, option_string=None):
        pass
