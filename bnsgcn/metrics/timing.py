"""One clock for the phases of an epoch and the waits of collectives, on CPU and CUDA alike.

On the CPU an interval is host wall-clock time (``time.perf_counter``). On CUDA the host
only enqueues work, so host time would measure how long enqueueing took; there each
interval is a pair of CUDA events recorded on the current stream, and its length is the
device time between them: a phase's kernels, or, around the wait for a collective, the time
the compute stream stood still until the collective finished. Events are resolved in
:meth:`DeviceClock.resolve`, once, at the end of an epoch (one synchronisation with the
device, on the last event), never one per interval.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


class DeviceClock:
    """Seconds per name, summed over intervals, on the device's own clock.

    ``event``: the event type used on CUDA (``torch.cuda.Event``; a test may pass a stand-in
    to check how events are used without a GPU). ``None`` on any other device: host time.
    """

    def __init__(self, device: torch.device, event: Callable[..., object] | None = None) -> None:
        if event is None and device.type == "cuda":
            event = torch.cuda.Event
        self._event = event
        self._pending: list[tuple[str, object, object]] = []  # (name, start event, end event)
        self._seconds: dict[str, float] = defaultdict(float)

    @property
    def on_device(self) -> bool:
        """True when intervals are device (CUDA event) time."""
        return self._event is not None

    def start(self) -> object:
        """Mark the start of an interval: a recorded event on CUDA, a host time otherwise."""
        if self._event is None:
            return time.perf_counter()
        event = self._event(enable_timing=True)
        event.record()
        return event

    def stop(self, name: str, start: object) -> None:
        """End the interval begun at ``start`` (from :meth:`start`) and add it to ``name``."""
        if self._event is None:
            self._seconds[name] += time.perf_counter() - start
            return
        end = self._event(enable_timing=True)
        end.record()
        self._pending.append((name, start, end))

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Time the block as ``name``."""
        start = self.start()
        try:
            yield
        finally:
            self.stop(name, start)

    def add(self, name: str, seconds: float) -> None:
        """Add a length measured elsewhere (e.g. a host wait after the device was drained)."""
        self._seconds[name] += seconds

    def resolve(self) -> dict[str, float]:
        """Seconds per name so far: waits once for the last recorded event (CUDA), then reads
        every pending pair. The returned dict is live; :meth:`reset` clears it."""
        if self._pending:
            self._pending[-1][2].synchronize()  # events complete in order on one stream
            for name, start, end in self._pending:
                self._seconds[name] += start.elapsed_time(end) / 1000.0  # milliseconds
            self._pending.clear()
        return self._seconds

    def reset(self) -> None:
        """Forget every interval (resolved or not)."""
        self._pending.clear()
        self._seconds.clear()
