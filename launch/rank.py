"""One rank of a training job: ``python -m bnsgcn.launch.rank <training flags>``.

The local supervisor (:mod:`bnsgcn.launch.supervisor`) starts one of these per local rank with
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set;
:func:`bnsgcn.run.train.run` reads them. :func:`report_errors` is the error handling shared
by every rank, here and in ``bnsgcn-train`` under torchrun/SLURM:

* :class:`~bnsgcn.errors.UserError` -> ``error: [rank R] <message>`` on stderr, exit 2
  (the traceback too with ``--debug``);
* a collective that failed because another rank died, failed or hung past ``--timeout``
  -> one line ``error: [rank R] communication with the other ranks failed: ...``, exit 4
  (:data:`LOST_PEERS_STATUS`; the traceback too with ``--debug``): this rank is a victim,
  the cause is in another rank's report, or named in this line (``rank 3 stopped at
  epoch 7``) when the engine could tell which rank stopped advancing;
* a stop asked for by SIGTERM/SIGUSR1 (:class:`~bnsgcn.errors.JobStopped`, checkpoint
  written) -> one line, exit 128 + the signal's number;
* any other exception -> its traceback, every line prefixed ``[rank R]``, exit 1.

Either way the last stderr line names the problem, which is what the supervisor quotes.
Under torchrun (``TORCHELASTIC_ERROR_FILE`` set) the exception is also written to
torchrun's error file, so that torchrun's summary shows this rank's cause.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

from bnsgcn.cli import Parser
from bnsgcn.config import TrainConfig, add_arguments, from_args
from bnsgcn.config.original import LAUNCH, TRAIN, add_original_flags, aliases_epilog, elsewhere
from bnsgcn.errors import JobStopped, UserError, is_peer_failure, peer_lost_message

# Exit status of a rank whose collective failed because of another rank (bnsgcn.errors.PeerLost).
LOST_PEERS_STATUS = 4
# Set by the local supervisor (bnsgcn.launch.cli): the pid of the launcher that started this rank.
LAUNCHER_PID_VARIABLE = "BNSGCN_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def training_parser(prog: str, description: str | None = None) -> argparse.ArgumentParser:
    """A parser with every training flag and the original BNS-GCN's names of them
    (:mod:`bnsgcn.config.original`). Abbreviated flags are refused (:mod:`bnsgcn.cli`): the
    launcher removes its own flags from the command line by exact name before passing it on."""
    parser = Parser(
        prog=prog,
        description=description,
        epilog=aliases_epilog(TRAIN, LAUNCH),
        elsewhere=elsewhere("bnsgcn-train"),
    )
    add_arguments(parser)
    add_original_flags(parser, TRAIN)
    return parser


def report_errors(work: Callable[[], int], *, rank: int | None, debug: bool) -> int:
    """Run ``work`` and return its exit status; turn exceptions into the rank's report.

    ``rank`` None means the launcher itself (no ``[rank R]`` prefix).
    """
    prefix = "" if rank is None else f"[rank {rank}] "
    try:
        return work()
    except Exception as exc:
        record_for_torchrun(exc)
        if isinstance(exc, UserError):
            message, status = str(exc), 2
        elif isinstance(exc, JobStopped):
            message, status = str(exc), 128 + exc.signum
        elif is_peer_failure(exc):
            message, status = peer_lost_message(exc), LOST_PEERS_STATUS
        else:  # a bug or a resource problem: the traceback is the report
            _print_prefixed(traceback.format_exc(), prefix)
            return 1
        if debug:
            _print_prefixed(traceback.format_exc(), prefix)
        print(f"error: {prefix}{message}", file=sys.stderr, flush=True)
        return status


def record_for_torchrun(exc: BaseException) -> None:
    """Under torchrun, write ``exc`` to the error file its agent reads
    (``TORCHELASTIC_ERROR_FILE``), as ``torch.distributed.elastic``'s ``@record`` would:
    torchrun's failure summary then quotes this rank's error instead of only its exit code."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    ErrorHandler().record_exception(exc)


def _print_prefixed(text: str, prefix: str) -> None:
    sys.stderr.write("".join(prefix + line + "\n" for line in text.rstrip("\n").split("\n")))
    sys.stderr.flush()


def train(config: TrainConfig) -> int:
    """Train this rank; exit status 0 on success."""
    # Imported here: torch and the engine load only in processes that train.
    from bnsgcn.run.train import run

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
    args = training_parser(
        "python -m bnsgcn.launch.rank", "One rank of a bnsgcn training job (started by bnsgcn-train)."
    ).parse_args(argv)
    exit_rank(report_errors(lambda: train(from_args(args)), rank=rank_from_environment(), debug=args.debug))


if __name__ == "__main__":
    main()
