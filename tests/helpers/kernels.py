"""The engine's CPU kernels compiled into numba's on-disk cache once per test run.

On a fresh checkout numba's cache holds no kernels: a job's first rank compiles them in a
process of its own (``python -m bnsgcn.kernels.warmup``, about 45 s of CPU on 2 cores) and
leaves a stamp, and every job that starts before the stamp exists compiles them as well: the
first job of each pytest-xdist worker, and each emulated node of a multi-node job. Here the
test processes share one lock beside the stamp: :func:`start_compiling` (at the start of the
session) compiles them in the background, the first process to take the lock doing the work,
and :func:`compiled` (before a test starts a training job) waits until the stamp exists.
Nothing changes what a job does: one that finds no stamp still compiles (test_warmup checks
it, in a cache of its own).
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
import threading

_done = threading.Event()
_started = threading.Lock()
_thread: threading.Thread | None = None


def _compile() -> None:
    try:
        from bnsgcn.kernels import warmup

        stamp = warmup.stamp_path()
        if stamp is None or stamp.exists():
            return
        stamp.parent.mkdir(parents=True, exist_ok=True)
        with open(stamp.parent / ".tests-compiling.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another test process may be compiling them now
            if not stamp.exists():
                command = [sys.executable, "-m", "bnsgcn.kernels.warmup"]
                subprocess.run(command, capture_output=True, timeout=1800, check=False)
    finally:
        _done.set()  # a failed compile is left to the jobs, which then compile and report it


def start_compiling() -> None:
    """Compile the kernels in the background unless the stamp says they are in the cache."""
    global _thread
    with _started:
        if _thread is None:
            _thread = threading.Thread(target=_compile, name="compile-kernels", daemon=True)
            _thread.start()


def compiled() -> None:
    """Return once the kernels are in numba's cache (or compiling them failed)."""
    start_compiling()
    _done.wait()
