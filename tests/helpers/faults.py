"""Training jobs started as processes through the real CLI (``bnsgcn-train``), as a user or a
batch system starts them: waiting for their epochs, finding a rank's process, killing or
stopping it, and checking that the job ends naming it and leaves no process behind.

Runs are tiny (2 ranks, 12 epochs of a small model); waits are generous so that a loaded
machine does not fail them, and every one is bounded so that a hang fails the test.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import psutil

from . import kernels
from .cli import RANK_VARIABLES, TRAIN

EPOCHS = 12
CHECKPOINT_EVERY = 2
TIMEOUT_S = 30  # --timeout of the jobs here
# p < 1 and dropout > 0: a resumed run must reproduce boundary sampling and dropout.
FLAGS = [
    "--epochs",
    str(EPOCHS),
    "--p",
    "0.5",
    "--dropout",
    "0.3",
    "--layers",
    "2",
    "--hidden",
    "16",
    "--lr",
    "0.02",
    "--seed",
    "3",
    "--eval-every",
    "2",
    "--checkpoint-every",
    str(CHECKPOINT_EVERY),
    "--threads",
    "1",
    "--timeout",
    str(TIMEOUT_S),
]
T = TypeVar("T")

START_S = 240  # for a job to start and write its first epochs, on a loaded machine
FINISH_S = 300  # for a short job to run to its end


def job_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    return env


def start(command: list[str], cwd: Path, name: str) -> subprocess.Popen:
    """Start ``command`` in its own process group; its output goes to ``cwd/name.out|err``."""
    kernels.compiled()
    with open(cwd / f"{name}.out", "w") as stdout, open(cwd / f"{name}.err", "w") as stderr:
        job = subprocess.Popen(
            command,
            cwd=cwd,
            env=job_env(),
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
        )
    job.stderr_path = cwd / f"{name}.err"  # for failure messages: why a job ended early
    return job


def stderr_of(cwd: Path, name: str) -> str:
    return (cwd / f"{name}.err").read_text()


def records(run_dir: Path) -> list[dict]:
    """The complete lines of ``metrics.jsonl`` (a line being written is left out)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]


def epoch_records(run_dir: Path) -> list[dict]:
    return [r for r in records(run_dir) if "epoch" in r and not r.get("summary")]


def last_epoch(run_dir: Path) -> int:
    epochs = epoch_records(run_dir)
    return epochs[-1]["epoch"] if epochs else 0


def wait_for(condition: Callable[[], bool], job: subprocess.Popen, timeout_s: float, what: str) -> None:
    """Poll ``condition`` until it holds; fail if ``job`` ends first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if job.poll() is not None:
            tail = "\n".join(job.stderr_path.read_text().splitlines()[-15:])
            raise AssertionError(f"the job ended (status {job.returncode}) before {what}; its stderr ends:\n{tail}")
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s"
        time.sleep(0.02)


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def rank_process(processes: list[psutil.Process], rank: int) -> psutil.Process:
    """The process of ``rank`` among ``processes`` (by the RANK its launcher exported)."""
    found = [p for p in processes if "python" in p.name().lower() and p.environ().get("RANK") == str(rank)]
    assert len(found) == 1, [(p.pid, p.cmdline()) for p in processes]
    return found[0]


def alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_all_gone(processes: list[psutil.Process], run_dir: Path, within_s: float = 30) -> None:
    """Every process of the job has ended, and no process at all still names its run dir."""
    deadline = time.monotonic() + within_s
    while any(alive(p) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p.pid for p in processes if alive(p)], "processes of the job are left behind"
    leftover = []
    for process in psutil.process_iter(["cmdline"]):
        if str(run_dir) in " ".join(process.info["cmdline"] or []) and alive(process):
            leftover.append(process.pid)
    assert not leftover, f"processes still working on {run_dir}: {leftover}"


def kill_job(job: subprocess.Popen) -> None:
    """Last resort of a failed test: leave nothing running."""
    if job.poll() is None:
        for process in descendants(job.pid):
            process.kill()
        job.kill()
        job.wait(10)


def train_args(parts: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["--procs", "2", "--parts-dir", str(parts), "--out", str(run_dir), *FLAGS, *extra]


def assert_killed_rank_is_named(tmp_path: Path, args: list[str], started=None) -> None:
    """Start the job, SIGKILL rank 1 once ``started()`` holds (default: the first epoch is in
    metrics.jsonl), and check the job ends with status 128 + SIGKILL naming rank 1, leaving
    no process behind."""
    run_dir = Path(args[args.index("--out") + 1])
    job = start([*TRAIN, *args], tmp_path, "job")
    try:
        wait_for(started or (lambda: last_epoch(run_dir) >= 1), job, START_S, "training under way")
        processes = descendants(job.pid)
        rank_process(processes, 1).kill()
        job.wait(TIMEOUT_S + 30)
    finally:
        kill_job(job)
    assert job.returncode == 128 + signal.SIGKILL
    last_line = stderr_of(tmp_path, "job").strip().splitlines()[-1]
    assert last_line.startswith("error: rank 1 failed (killed by SIGKILL)"), last_line
    assert_all_gone(processes, run_dir)


def run_with_rank_hung(
    tmp_path: Path, args: list[str], timeout_s: float, rank: int = 1
) -> tuple[subprocess.Popen, list[psutil.Process], float]:
    """Start the job, suspend ``rank`` (SIGSTOP: alive but silent, as a hung rank) after the
    first epoch; return the ended job, its processes and seconds from the suspension to its end."""
    run_dir = Path(args[args.index("--out") + 1])
    job = start([*TRAIN, *args], tmp_path, "job")
    try:
        wait_for(lambda: last_epoch(run_dir) >= 1, job, START_S, "first epoch in metrics.jsonl")
        processes = descendants(job.pid)
        rank_process(processes, rank).suspend()
        stopped_at = time.monotonic()
        job.wait(timeout_s + 60)
        elapsed = time.monotonic() - stopped_at
    finally:
        kill_job(job)
    return job, processes, elapsed


def check_hung_rank_named(
    cwd: Path,
    run_dir: Path,
    hung: tuple[subprocess.Popen, list[psutil.Process], float],
    timeout_s: float,
    last_line_pattern: str,
) -> None:
    """What :func:`run_with_rank_hung` returned (the job started in ``cwd``): the job ended
    after ``--timeout`` (plus the grace periods) with status 4, its last line matching
    ``last_line_pattern``, no traceback and no process left."""
    job, processes, elapsed = hung
    # Rank 0 gives up after --timeout; then the settle and SIGTERM grace periods (2 + 5 s).
    assert timeout_s <= elapsed < timeout_s + 25, elapsed
    assert job.returncode == 4  # rank 0 lost its peer
    last_line = stderr_of(cwd, "job").strip().splitlines()[-1]
    assert re.search(last_line_pattern, last_line), last_line
    assert "Traceback" not in stderr_of(cwd, "job")
    assert_all_gone(processes, run_dir)


def assert_hung_rank_named(tmp_path: Path, args: list[str], timeout_s: float, last_line_pattern: str) -> None:
    """Start the job, suspend rank 1 after the first epoch (:func:`run_with_rank_hung`) and
    check the job ends after ``--timeout`` with the rank named (:func:`check_hung_rank_named`)."""
    run_dir = Path(args[args.index("--out") + 1])
    hung = run_with_rank_hung(tmp_path, args, timeout_s)
    check_hung_rank_named(tmp_path, run_dir, hung, timeout_s, last_line_pattern)


@contextmanager
def in_background_if_selected(request, test_name: str, job: Callable[[], T]) -> Iterator[Future[T] | None]:
    """Run ``job`` in a thread from now on, while the module's other tests run, if the test
    ``test_name`` of the requesting module is selected: yield its future (None if the test is
    not selected), waited for on leaving. For a job that mostly waits, such as one with a
    hung rank (--timeout, then the launcher's grace periods), its test comes last in its module."""
    if not any(item.module is request.module and item.originalname == test_name for item in request.session.items):
        yield None
        return
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(job)
