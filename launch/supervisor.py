"""Run the local ranks of a job as child processes and make them live and die together.

Each child runs in its own session (process group), so stopping it also stops whatever
it started. Its stdout/stderr are forwarded line by line to ours; the last stderr lines
are kept for the failure report. As soon as one child exits non-zero or is killed by a
signal, every other child gets SIGTERM, then SIGKILL after ``grace_s`` seconds, and one
line ``error: rank R failed (...): <its last error line>`` is printed. SIGINT/SIGTERM to
this process stop all children the same way. SIGUSR1 (a batch system's warning ahead of
a time limit, e.g. ``sbatch --signal=USR1@120``) is passed on to every child, which with
checkpoints on saves one and exits (:mod:`bnsgcn.run.stopping`); supervision goes on. No child
outlives :func:`supervise`.

The rank named is the cause, not a victim: a rank whose collective failed because of
another rank exits with :data:`~bnsgcn.launch.rank.LOST_PEERS_STATUS`; when such a rank exits
first, the others get ``settle_s`` seconds to exit on their own, and a rank that failed
for another reason in that time is named instead.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, TextIO

from .rank import LOST_PEERS_STATUS

TAIL_LINES = 20
STOP_WAIT_S = 10.0  # after SIGKILL: how long to wait for the kernel to reap
READER_JOIN_S = 2.0
SETTLE_S = 2.0  # how long a victim's exit waits for the cause's (see module docstring)


@dataclass(frozen=True)
class Child:
    """One rank to start: its number (for reports), command line and full environment."""

    rank: int
    argv: Sequence[str]
    env: Mapping[str, str] | None = None


class _Interrupted(BaseException):
    """Raised in the main thread by the SIGINT/SIGTERM handler of :class:`_StopSignals`."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _StopSignals:
    """While entered, the first SIGINT/SIGTERM raises :class:`_Interrupted` in the main
    thread; later ones, and all after :meth:`disarm`, are ignored so that cleanup runs
    to the end. Only the main thread may install handlers; elsewhere this does nothing.
    Inside :meth:`deferred` the signal is held and raised at its end instead.
    """

    def __init__(self) -> None:
        self._armed = True
        self._deferring = False
        self._pending: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, _frame) -> None:
        if not self._armed:
            return
        if self._deferring:
            self._pending = self._pending or signum
            return
        self._armed = False
        raise _Interrupted(signum)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """Hold a stop signal until the block is done: a child being started when it came
        is then on the list of children to stop, not left running outside it."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        if self._pending is not None and self._armed:
            self._armed = False
            raise _Interrupted(self._pending)

    def disarm(self) -> None:
        self._armed = False

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {signum: signal.signal(signum, self._handle) for signum in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *_exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


class _ForwardSignals:
    """While entered, SIGUSR1 to this process is sent on to every started child (only the
    main thread may install handlers; elsewhere this does nothing)."""

    SIGNALS = (signal.SIGUSR1,)

    def __init__(self, running: Sequence[_Running]) -> None:
        self._running = running
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, _frame) -> None:
        for r in list(self._running):
            if r.process.poll() is None:
                r.process.send_signal(signum)

    def __enter__(self) -> _ForwardSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}
        return self

    def __exit__(self, *_exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


class _Running:
    """A started child: its process, output forwarders and the tail of its stderr."""

    def __init__(self, child: Child, exits: queue.Queue, lock: threading.Lock, stdout: TextIO, stderr: TextIO) -> None:
        self.rank = child.rank
        self.stderr_tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.exited = threading.Event()
        self.process = subprocess.Popen(
            list(child.argv),
            env=None if child.env is None else dict(child.env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            encoding="utf-8",
            errors="replace",
            start_new_session=True,
        )
        self.readers = [
            threading.Thread(target=self._forward, args=(self.process.stdout, stdout, lock, None), daemon=True),
            threading.Thread(
                target=self._forward, args=(self.process.stderr, stderr, lock, self.stderr_tail), daemon=True
            ),
        ]
        # One waiter per child reports exits in the order they happen, so the first
        # failure (the cause) is told apart from the ranks that failed because of it.
        waiter = threading.Thread(target=self._wait, args=(exits,), daemon=True)
        for thread in (*self.readers, waiter):
            thread.start()

    def _wait(self, exits: queue.Queue) -> None:
        self.process.wait()
        self.exited.set()
        exits.put(self)

    @staticmethod
    def _forward(source: IO[str], target: TextIO, lock: threading.Lock, tail: deque[str] | None) -> None:
        for line in source:
            if not line.endswith("\n"):
                line += "\n"
            if tail is not None and line.strip():
                tail.append(line.rstrip("\n"))
            with lock:
                target.write(line)
                target.flush()
        source.close()

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the child's whole process group (the child may be gone)."""
        try:
            os.killpg(self.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def join_readers(self) -> None:
        for reader in self.readers:
            reader.join(READER_JOIN_S)

    def last_error_line(self) -> str:
        return self.stderr_tail[-1] if self.stderr_tail else "(nothing on stderr)"

    def describe_exit(self) -> str:
        code = self.process.returncode
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:  # a signal without a name, e.g. a real-time one
                return f"killed by signal {-code}"
        return f"exit code {code}"


def _exit_status(returncode: int) -> int:
    """Our exit status for a failed child: its own code, or 128 + signal like a shell."""
    return returncode if returncode > 0 else 128 - returncode


@dataclass(frozen=True)
class Outcome:
    """How supervision ended: ``status`` 0 when every child exited 0, else the failure's
    status (its exit code, or 128 + signal number) or 128 + the signal that interrupted
    us; ``message`` the one line reported (without ``error: ``), None on success;
    ``signum`` the signal (SIGINT, SIGTERM) that interrupted supervision, else None."""

    status: int
    message: str | None = None
    signum: int | None = None


def supervise(
    children: Sequence[Child],
    *,
    grace_s: float = 5.0,
    settle_s: float = SETTLE_S,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Run ``children`` to completion; 0 when all exit 0, else the failure's status
    (its exit code, or 128 + signal number; 128 + our signal when interrupted).

    ``stdout``/``stderr`` default to this process's streams at call time.
    """
    return supervise_outcome(children, grace_s=grace_s, settle_s=settle_s, stdout=stdout, stderr=stderr).status


def supervise_outcome(
    children: Sequence[Child],
    *,
    grace_s: float = 5.0,
    settle_s: float = SETTLE_S,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> Outcome:
    """:func:`supervise`, returning the :class:`Outcome` (the Python API raises from it)."""
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    lock = threading.Lock()
    exits: queue.Queue[_Running] = queue.Queue()
    running: list[_Running] = []
    with _StopSignals() as stop_signals, _ForwardSignals(running):
        try:
            with stop_signals.deferred():
                for child in children:
                    running.append(_Running(child, exits, lock, stdout, stderr))
            failed = _first_failure(exits, len(running), settle_s)
            if failed is None:
                return Outcome(0)
            _stop(running, grace_s)
            line = f"rank {failed.rank} failed ({failed.describe_exit()}): {failed.last_error_line()}"
            _report(stderr, lock, f"error: {line}", running)
            return Outcome(_exit_status(failed.process.returncode), line)
        except _Interrupted as interrupt:
            _stop(running, grace_s)
            name = signal.Signals(interrupt.signum).name
            line = f"interrupted by {name}; stopped all {len(running)} local ranks"
            _report(stderr, lock, f"error: {line}", running)
            return Outcome(128 + interrupt.signum, line, interrupt.signum)
        finally:
            # Whatever happened (also an exception while starting), leave nothing behind:
            # this also reaches grandchildren of children that exited on their own.
            stop_signals.disarm()
            for r in running:
                r.signal_group(signal.SIGKILL)
            for r in running:
                r.exited.wait(STOP_WAIT_S)
                r.join_readers()


def _first_failure(exits: queue.Queue, count: int, settle_s: float) -> _Running | None:
    """Take exits in order; the failure to report, or None if all exit 0.

    That is the first child to exit non-zero for a reason of its own; a child that lost
    its peers (exit status ``LOST_PEERS_STATUS``) only when no such cause exits within
    ``settle_s`` seconds of it.
    """
    victims: list[_Running] = []
    deadline = None
    for _ in range(count):
        try:
            running = exits.get(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        code = running.process.returncode
        if code == LOST_PEERS_STATUS:
            victims.append(running)
            deadline = deadline or time.monotonic() + settle_s
        elif code != 0:
            return running
    return victims[0] if victims else None


def _stop(running: Sequence[_Running], grace_s: float) -> None:
    """SIGTERM every process group, SIGKILL what is left after ``grace_s``, then reap."""
    for r in running:
        r.signal_group(signal.SIGTERM)
        r.signal_group(signal.SIGCONT)  # a stopped rank (SIGSTOP, a debugger) acts on SIGTERM only once continued
    deadline = time.monotonic() + grace_s
    for r in running:
        r.exited.wait(max(0.0, deadline - time.monotonic()))
    for r in running:
        r.signal_group(signal.SIGKILL)
    for r in running:
        r.exited.wait(STOP_WAIT_S)


def _report(stderr: TextIO, lock: threading.Lock, line: str, running: Sequence[_Running]) -> None:
    # Drain the children's output first so that the report is the last line printed.
    for r in running:
        r.join_readers()
    with lock:
        stderr.write(line + "\n")
        stderr.flush()
