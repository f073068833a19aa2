"""One rank of a training job: ``python -m bnsgcn.launch.rank <training flags>``.

The local supervisor (:mod:`bnsgcn.launch.supervisor`) starts one of these per local rank with
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set;
:func:`bnsgcn.train.run` reads them. :func:`report_errors` is the error handling shared
by every rank, here and in ``bnsgcn-train`` under torchrun/SLURM:

* :class:`~bnsgcn.errors.UserError` -> ``error: [rank R] <message>`` on stderr, exit 2
  (the traceback too with ``--debug``);
* a collective that failed because another rank died, failed or hung past ``--timeout``
  -> one line ``error: [rank R] communication with the other ranks failed: ...``, exit 4
  (:data:`LOST_PEERS_STATUS`; the traceback too with ``--debug``): this rank is a victim,
  the cause is in another rank's report;
* any other exception -> its traceback, every line prefixed ``[rank R]``, exit 1.

Either way the last stderr line names the problem, which is what the supervisor quotes.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import signal
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

from bnsgcn.config import TrainConfig, add_arguments, from_args
from bnsgcn.errors import UserError

# Exit status of a rank whose collective failed because of another rank (see lost_peers).
LOST_PEERS_STATUS = 4
# Set by the local supervisor (bnsgcn.launch.cli): the pid of the launcher that started this rank.
LAUNCHER_PID_VARIABLE = "BNSGCN_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def training_parser(prog: str, description: str | None = None) -> argparse.ArgumentParser:
    """A parser with every training flag. Abbreviated flags are refused: the launcher
    removes its own flags from the command line by exact name before passing it on."""
    parser = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False)
    add_arguments(parser)
    return parser


def report_errors(work: Callable[[], int], *, rank: int | None, debug: bool) -> int:
    """Run ``work`` and return its exit status; turn exceptions into the rank's report.

    ``rank`` None means the launcher itself (no ``[rank R]`` prefix).
    """
    prefix = "" if rank is None else f"[rank {rank}] "
    try:
        return work()
    except UserError as exc:
        if debug:
            _print_prefixed(traceback.format_exc(), prefix)
        print(f"error: {prefix}{exc}", file=sys.stderr, flush=True)
        return 2
    except Exception as exc:
        if not lost_peers(exc):
            _print_prefixed(traceback.format_exc(), prefix)
            return 1
        if debug:
            _print_prefixed(traceback.format_exc(), prefix)
        print(
            f"error: {prefix}communication with the other ranks failed: {_first_sentence(exc)}; "
            "another rank died or failed (see its error) or a collective took longer than --timeout",
            file=sys.stderr, flush=True,
        )
        return LOST_PEERS_STATUS


def lost_peers(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that failed because of another rank (it died,
    failed, or hung past the timeout): torch.distributed's own errors (store, rendezvous,
    NCCL), or gloo transport errors, which reach Python as plain ``RuntimeError``."""
    dist = sys.modules.get("torch.distributed")  # loaded by now if it raised
    if dist is not None and isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and "gloo/transport/" in str(exc)


def _first_sentence(exc: BaseException) -> str:
    """The gist of a communication error: its first sentence, without gloo's source location."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return re.sub(r"^\[[^\]]*\]\s*", "", lines[0]).split(". ")[0].rstrip(".")


def _print_prefixed(text: str, prefix: str) -> None:
    sys.stderr.write("".join(prefix + line + "\n" for line in text.rstrip("\n").split("\n")))
    sys.stderr.flush()


def train(config: TrainConfig) -> int:
    """Train this rank; exit status 0 on success."""
    # Imported here: torch and the engine load only in processes that train.
    from bnsgcn.train import run

    run(config)
    return 0


def rank_from_environment() -> int | None:
    """This process's rank for messages, from ``RANK`` (None when absent or malformed)."""
    value = os.environ.get("RANK", "")
    return int(value) if value.isdigit() else None


def die_with_launcher() -> None:
    """On Linux, have the kernel SIGKILL this rank as soon as the launcher that started it
    dies, even by SIGKILL (which leaves it no chance to stop its ranks): a rank must not
    go on training, and writing the run directory, for a job that is gone."""
    launcher = os.environ.get(LAUNCHER_PID_VARIABLE)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(launcher):  # it died before the request above
        os.kill(os.getpid(), signal.SIGKILL)


def exit_rank(status: int) -> NoReturn:
    """End a rank process with ``status`` now, skipping the interpreter's teardown.

    Everything a rank writes is complete by now (metrics closed, checkpoints renamed into
    place); what teardown would add is destroying c10d's and gloo's background threads
    in arbitrary order, which can abort the process ("terminate called without an active
    exception", SIGABRT) and turn a finished or cleanly failed rank into a crash.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main(argv: list[str] | None = None) -> NoReturn:
    die_with_launcher()
    args = training_parser("python -m bnsgcn.launch.rank", "One rank of a bnsgcn training job (started by bnsgcn-train).").parse_args(argv)
    exit_rank(report_errors(lambda: train(from_args(args)), rank=rank_from_environment(), debug=args.debug))


if __name__ == "__main__":
    main()
