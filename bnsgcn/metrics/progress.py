"""Progress display for long steps, shared by the partition step and training.

Two forms:

* :class:`Progress` counts units of work (partitions written, epochs run). On a terminal it
  keeps one line up to date (``\\r``) with count/total, percent, rate and ETA; when the
  stream is not a terminal (a log file, CI) it writes a plain line at most every
  ``interval`` seconds and one at the end, so logs stay short.
* :func:`step` times one long step without a count: ``desc ... done in X.Xs``, with a
  heartbeat of the elapsed time while it runs.

Both write to ``sys.stderr`` by default so that standard output stays for results, and
both can be switched off with ``enabled=False``.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO


def _duration(seconds: float) -> str:
    """``42.0s``, ``3m05s``, ``2h01m``: short enough for one status line."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _is_tty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class Progress:
    """Counts completed units of work and shows count, percent, rate and ETA.

    Args:
        total: number of units expected, or ``None`` when unknown (no percent or ETA then).
        desc: what is being done, e.g. ``"writing partitions"``.
        stream: where to write (default ``sys.stderr``).
        enabled: ``False`` writes nothing (the object still counts).
        interval: seconds between plain lines when ``stream`` is not a terminal.
        initial: units done before this display started (a resumed download): counted in
            the total, not in the rate.
        unit: formats a count and a rate (``format_bytes``: ``12 MiB/81 MiB ... 4 MiB/s``);
            default: plain numbers.

    Use as a context manager; leaving the block writes the final line.
    """

    def __init__(
        self,
        total: int | None,
        desc: str,
        stream: TextIO | None = None,
        *,
        enabled: bool = True,
        interval: float = 5.0,
        initial: int = 0,
        unit: Callable[[float], str] | None = None,
    ) -> None:
        self.total = total
        self.desc = desc
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self.interval = interval
        self.count = self._initial = initial
        self._unit = unit
        self._tty = _is_tty(self.stream)
        self._start = time.perf_counter()
        self._last_write = self._start
        self._written_count: int | None = None  # count shown by the last line written
        self._closed = False

    def __enter__(self) -> Progress:
        if self._tty:
            self._write(final=False)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        """Record ``n`` more completed units and refresh the display when due."""
        self.count += n
        now = time.perf_counter()
        if self._tty or now - self._last_write >= self.interval:
            self._last_write = now
            self._write(final=False)

    def close(self) -> None:
        """Write the final line (once; in a log, only if the last line is out of date)."""
        if not self._closed:
            self._closed = True
            if self._tty or self._written_count != self.count:
                self._write(final=True)

    def line(self) -> str:
        """The current status text: ``desc: 3/8 (37%) 1.2/s, ETA 4.1s``."""
        elapsed = time.perf_counter() - self._start
        rate = (self.count - self._initial) / elapsed if elapsed > 0 else 0.0
        count, speed = (self._unit(self.count), self._unit(rate)) if self._unit else (self.count, f"{rate:.3g}")
        if self.total is None:
            return f"{self.desc}: {count} ({speed}/s, {_duration(elapsed)})"
        percent = 100.0 * self.count / self.total if self.total else 100.0
        total = self._unit(self.total) if self._unit else self.total
        text = f"{self.desc}: {count}/{total} ({percent:.0f}%) {speed}/s"
        if self.count >= self.total:
            return f"{text}, done in {_duration(elapsed)}"
        eta = (self.total - self.count) / rate if rate > 0 else None
        return f"{text}, ETA {_duration(eta) if eta is not None else '?'}"

    def _write(self, final: bool) -> None:
        if not self.enabled:
            return
        self._written_count = self.count
        if self._tty:
            # \x1b[K clears what a longer previous line left behind.
            self.stream.write("\r" + self.line() + "\x1b[K" + ("\n" if final else ""))
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()


# Heartbeat periods of :func:`step`: a terminal line is cheap to redraw, a log line is not.
TERMINAL_HEARTBEAT_S = 1.0
LOG_HEARTBEAT_S = 30.0

_write_lock = threading.Lock()  # heartbeat threads and the main thread share the stream
_beating: list[_Heartbeat] = []  # heartbeats of the running steps, innermost last


class _Heartbeat:
    """Writes a step's opening line, then ``desc ... running for X`` every ``interval``
    seconds from a daemon thread, and the closing line when stopped.

    Only the innermost running step beats, so nested steps do not fight over a terminal
    line; opening and closing lines are written together with the change of innermost step.
    """

    def __init__(self, desc: str, stream: TextIO, tty: bool, start: float, interval: float, opening: str) -> None:
        self.desc, self.stream, self.tty, self.start, self.interval = desc, stream, tty, start, interval
        self._stopped = threading.Event()
        with _write_lock:
            _beating.append(self)
            self._write(opening)
        self._thread = threading.Thread(target=self._run, name=f"heartbeat of {desc}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            with _write_lock:
                if _beating[-1] is self:
                    text = f"{self.desc} ... running for {_duration(time.perf_counter() - self.start)}"
                    self._write("\r" + text + "\x1b[K" if self.tty else text + "\n")

    def stop(self, closing: str) -> None:
        """Stop the thread and write ``closing``; nothing is written after it."""
        self._stopped.set()
        self._thread.join()
        with _write_lock:
            _beating.remove(self)
            self._write(closing)

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()


@contextmanager
def step(
    desc: str, stream: TextIO | None = None, *, enabled: bool = True, interval: float | None = None
) -> Iterator[None]:
    """Time one long step: writes ``desc ...`` then ``desc ... done in X.Xs``.

    On a terminal both go on one line; otherwise the start gets its own line so a log
    shows what was running if the step never finishes. A step that raises is reported as
    ``desc ... failed after X.Xs`` and the exception propagates.

    While the step runs, a heartbeat shows ``desc ... running for X``: redrawn every
    ``interval`` seconds on a terminal (default :data:`TERMINAL_HEARTBEAT_S`), written as a
    line every ``interval`` seconds otherwise (default :data:`LOG_HEARTBEAT_S`). A step
    shorter than the interval shows none.
    """
    stream = sys.stderr if stream is None else stream
    tty = _is_tty(stream)
    start = time.perf_counter()
    heartbeat = None
    if enabled:
        period = interval if interval is not None else TERMINAL_HEARTBEAT_S if tty else LOG_HEARTBEAT_S
        # On a terminal, \r and \x1b[K replace the line of an enclosing step while this one runs.
        heartbeat = _Heartbeat(desc, stream, tty, start, period, f"\r{desc} ...\x1b[K" if tty else f"{desc} ...\n")
    outcome = "failed after"
    try:
        yield
        outcome = "done in"
    finally:
        if heartbeat is not None:
            text = f"{desc} ... {outcome} {time.perf_counter() - start:.1f}s"
            heartbeat.stop(f"\r{text}\x1b[K\n" if tty else f"{text}\n")
