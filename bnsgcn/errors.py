"""The exceptions that reach users as one line, and how a lost peer is recognised.

:class:`UserError` is for what the user can fix (input, flags, environment); a broken
internal invariant is any other exception, reported with its traceback.
"""

from __future__ import annotations

import re
import sys


class UserError(Exception):
    """Bad input or environment: the message names the problem and the fix.

    Command-line entry points print ``error: <message>`` and exit with status 2
    (a traceback only with ``--debug``).
    """


class UnknownSetting(UserError, TypeError):
    """A training setting named that does not exist (``TrainConfig.replace``, ``bnsgcn.train``):
    bad input, and also the TypeError an unexpected keyword argument is in Python."""


class PeerLost(Exception):
    """A collective failed because another rank died, failed or hung past ``--timeout``;
    the message says so, naming the rank that stopped advancing where that is known.
    Ranks exit with status 4 (``bnsgcn.launch.rank.LOST_PEERS_STATUS``)."""


class JobStopped(Exception):
    """The job was asked to stop by ``signum`` (SIGTERM or SIGUSR1: a batch system's time
    limit or preemption) and every rank stopped after the same epoch, a checkpoint
    written. Ranks exit with status 128 + ``signum``, as if killed by it."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that failed because of another rank (it died,
    failed, or hung past the timeout): torch.distributed's own errors (store, rendezvous,
    NCCL), or gloo transport errors, which reach Python as plain ``RuntimeError``."""
    if isinstance(exc, PeerLost):
        return True
    dist = sys.modules.get("torch.distributed")  # loaded by now if it raised
    if dist is not None and isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and "gloo/transport/" in str(exc)


def first_sentence(exc: BaseException) -> str:
    """The gist of a communication error: its first sentence, without gloo's source location."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return re.sub(r"^\[[^\]]*\]\s*", "", lines[0]).split(". ")[0].rstrip(".")


def failure_line(exc: BaseException) -> str:
    """What a rank that caused a failure tells the others: a UserError's one line, else the
    exception's type and first sentence."""
    if isinstance(exc, UserError):
        return str(exc).strip().splitlines()[0]
    return f"{type(exc).__name__}: {first_sentence(exc)}"


def peer_lost_message(exc: BaseException, cause: str | None = None) -> str:
    """The one line of a rank whose collective failed with ``exc``; ``cause`` names the
    rank that stopped, when known."""
    if isinstance(exc, PeerLost):
        return str(exc)
    because = cause or "another rank died or failed (see its error) or a collective took longer than --timeout"
    return f"communication with the other ranks failed: {first_sentence(exc)}; {because}"
