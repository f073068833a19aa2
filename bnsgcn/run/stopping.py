"""Stopping cleanly on a batch system's signal: checkpoint, then exit.

SLURM sends SIGTERM when a job reaches its time limit or is preempted (and SIGKILL
``KillWait`` seconds later), and ``sbatch --signal=USR1@120`` sends SIGUSR1 ahead of the
limit. With checkpoints on (``--checkpoint-every``), :func:`stop_on_signals` turns either
signal into a request that the training loop honours at the end of an epoch: all ranks
agree on it with one small all-reduce (a rank that got the signal a moment later, or not
at all, stops after the same epoch), write a checkpoint of that epoch and end with
:class:`~bnsgcn.errors.JobStopped` (exit status 128 + signal). Without checkpoints the
signals keep their default action: there is nothing to save.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Which stop signal this rank has received (None: none yet)."""

    def __init__(self) -> None:
        self.received: int | None = None

    def _handle(self, signum: int, _frame) -> None:
        # Only a flag: the loop acts on it between epochs, where all ranks can agree.
        self.received = self.received or signum

    def agreed(self, comm) -> int | None:
        """All ranks together: the stop signal if any rank received one, else None.
        SIGTERM (the end is near) wins over SIGUSR1 (a warning) when ranks differ."""
        counts = torch.zeros(len(STOP_SIGNALS), dtype=torch.float64, device=comm.device)
        if self.received is not None:
            counts[STOP_SIGNALS.index(self.received)] = 1
        counts = comm.all_reduce(counts).cpu()
        for signum, count in zip(STOP_SIGNALS, counts.tolist()):
            if count > 0:
                return int(signum)
        return None


@contextmanager
def stop_on_signals(enabled: bool) -> Iterator[StopRequest | None]:
    """While inside, SIGTERM and SIGUSR1 set a :class:`StopRequest` instead of ending the
    process (only when ``enabled`` and in the main thread, the one place Python runs
    signal handlers); yields None otherwise. The previous handlers come back on exit."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield None
        return
    request = StopRequest()
    previous = {signum: signal.signal(signum, request._handle) for signum in STOP_SIGNALS}
    try:
        yield request
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
