"""Faults and restarts of real training jobs (CPU, gloo), through the real CLIs.

* a rank killed by SIGKILL: the launcher ends the job at once, names the rank, exits 137
  and leaves no process behind; a rank that hangs (SIGSTOP) ends the job after --timeout;
* a job killed hard (SIGKILL to the launcher; its ranks die with it) and resumed with
  ``--resume`` ends with the same parameters and per-epoch losses as a run that was never
  interrupted (p < 1 and dropout > 0: sampling and dropout are reproduced exactly);
* a checkpoint of another model configuration or partition set is refused on --resume;
* under ``torchrun --max-restarts 1`` a job that loses a rank restarts, resumes from its
  last checkpoint and finishes as if nothing had happened.

Runs are tiny (a 160-node graph, 2 ranks, 12 epochs); waits are generous so that a loaded
machine does not fail them, and every one is bounded so that a hang fails the test.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch

from bnsgcn.errors import UserError
from bnsgcn.metrics.log import MetricsWriter

from .distributed import free_port, partition, random_graph
from .test_errors import RANK_VARIABLES, TRAIN, assert_kept, run_cli, snapshot

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
START_S = 240  # for a job to start and write its first epochs, on a loaded machine
FINISH_S = 300  # for a short job to run to its end


# --- helpers -----------------------------------------------------------------------------


def job_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    return env


def start(command: list[str], cwd: Path, name: str) -> subprocess.Popen:
    """Start ``command`` in its own process group; its output goes to ``cwd/name.out|err``."""
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


def running_after_checkpoint(run_dir: Path) -> Callable[[], bool]:
    """A checkpoint exists and the epoch after it has been logged: a kill now loses work."""
    return lambda: last_epoch(run_dir) > CHECKPOINT_EVERY and any((run_dir / "checkpoints").glob("checkpoint-*.pt"))


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


def final_model(run_dir: Path) -> dict[str, torch.Tensor]:
    state = torch.load(run_dir / "checkpoints" / f"checkpoint-{EPOCHS:06d}.pt", map_location="cpu", weights_only=True)
    assert state["epoch"] == EPOCHS
    return state["model"]


def assert_same_state(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name


def assert_same_training(run_dir: Path, reference: Path) -> None:
    """Bit for bit: the same per-epoch losses, samples and scores, each epoch once, and
    the same final and best parameters (CPU, one thread: nothing is left to chance)."""
    got, want = epoch_records(run_dir), epoch_records(reference)
    assert [r["epoch"] for r in got] == list(range(1, EPOCHS + 1))
    for name in ("loss", "sampled_boundary", "train_score", "val_score", "test_score"):
        assert [r.get(name) for r in got] == [r.get(name) for r in want], name
    assert_same_state(final_model(run_dir), final_model(reference))
    assert_same_state(
        torch.load(run_dir / "best_model.pt", weights_only=True),
        torch.load(reference / "best_model.pt", weights_only=True),
    )
    assert sum(1 for r in records(run_dir) if r.get("summary")) == 1


# --- fixtures ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def parts(work: Path) -> Path:
    return partition(random_graph(num_nodes=160, avg_degree=5, seed=4), 2, work / "parts" / "graph-2")


@pytest.fixture(scope="module")
def reference_run(work: Path, parts: Path) -> Path:
    """The uninterrupted run every interrupted one must reproduce."""
    run_dir = work / "reference"
    outcome = run_cli(TRAIN, train_args(parts, run_dir), work)
    assert outcome.code == 0, outcome.stderr
    assert len(epoch_records(run_dir)) == EPOCHS
    return run_dir


# --- a rank dies or hangs ----------------------------------------------------------------


def test_rank_killed_by_sigkill_ends_the_job_naming_it(tmp_path, parts):
    run_dir = tmp_path / "run"
    job = start([*TRAIN, *train_args(parts, run_dir, "--epochs", "100000", "--checkpoint-every", "0")], tmp_path, "job")
    try:
        wait_for(lambda: last_epoch(run_dir) >= 1, job, START_S, "first epoch in metrics.jsonl")
        processes = descendants(job.pid)
        rank_process(processes, 1).kill()
        killed_at = time.monotonic()
        job.wait(TIMEOUT_S + 30)
        elapsed = time.monotonic() - killed_at
    finally:
        kill_job(job)
    assert elapsed < TIMEOUT_S, f"the launcher took {elapsed:.1f} s to end the job"
    assert job.returncode == 128 + signal.SIGKILL
    last_line = stderr_of(tmp_path, "job").strip().splitlines()[-1]
    assert last_line.startswith("error: rank 1 failed (killed by SIGKILL)"), last_line
    assert_all_gone(processes, run_dir)


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


def run_with_rank_one_hung(
    tmp_path: Path, args: list[str], timeout_s: float
) -> tuple[subprocess.Popen, list[psutil.Process], float]:
    """Start the job, suspend rank 1 (SIGSTOP: alive but silent, as a hung rank) after the
    first epoch; return the ended job, its processes and seconds from the suspension to its end."""
    run_dir = Path(args[args.index("--out") + 1])
    job = start([*TRAIN, *args], tmp_path, "job")
    try:
        wait_for(lambda: last_epoch(run_dir) >= 1, job, START_S, "first epoch in metrics.jsonl")
        processes = descendants(job.pid)
        rank_process(processes, 1).suspend()
        stopped_at = time.monotonic()
        job.wait(timeout_s + 60)
        elapsed = time.monotonic() - stopped_at
    finally:
        kill_job(job)
    return job, processes, elapsed


def assert_hung_rank_named(tmp_path: Path, args: list[str], timeout_s: float, last_line_pattern: str) -> None:
    """Start the job, suspend rank 1 after the first epoch (:func:`run_with_rank_one_hung`) and
    check the job ends after ``--timeout`` (plus the grace periods) with status 4, its last
    line matching ``last_line_pattern``, no traceback and no process left."""
    run_dir = Path(args[args.index("--out") + 1])
    job, processes, elapsed = run_with_rank_one_hung(tmp_path, args, timeout_s)
    # Rank 0 gives up after --timeout; then the settle and SIGTERM grace periods (2 + 5 s).
    assert timeout_s <= elapsed < timeout_s + 25, elapsed
    assert job.returncode == 4  # rank 0 lost its peer
    last_line = stderr_of(tmp_path, "job").strip().splitlines()[-1]
    assert re.search(last_line_pattern, last_line), last_line
    assert "Traceback" not in stderr_of(tmp_path, "job")
    assert_all_gone(processes, run_dir)


def test_hung_rank_ends_the_job_after_the_timeout(tmp_path, parts):
    timeout_s = 5
    args = train_args(
        parts, tmp_path / "run", "--epochs", "100000", "--checkpoint-every", "0", "--timeout", str(timeout_s)
    )
    # rank 0 names the timeout, and the hung rank from the progress every rank reports through the store
    pattern = r"^error: rank 0 failed \(exit code 4\): error: \[rank 0\] communication with the other ranks failed: Timed out.*; rank 1 stopped at epoch \d+ while the others waited$"
    assert_hung_rank_named(tmp_path, args, timeout_s, pattern)


def test_rank_killed_on_another_node_ends_both_nodes(tmp_path):
    # Two launchers with --nnodes 2 (as on two machines): rank 3, on the second, is killed.
    parts = partition(random_graph(num_nodes=160, avg_degree=5, seed=4), 4, tmp_path / "parts" / "graph-4")
    run_dir, port = tmp_path / "run", str(free_port())
    common = [
        "--procs",
        "2",
        "--nnodes",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
        "--parts-dir",
        str(parts),
        "--out",
        str(run_dir),
    ]
    flags = [*FLAGS, "--epochs", "100000", "--checkpoint-every", "0"]
    nodes = [start([*TRAIN, *common, "--node-rank", str(n), *flags], tmp_path, f"node{n}") for n in (0, 1)]
    try:
        wait_for(lambda: last_epoch(run_dir) >= 1, nodes[0], START_S, "first epoch in metrics.jsonl")
        processes = descendants(nodes[0].pid) + descendants(nodes[1].pid)
        rank_process(descendants(nodes[1].pid), 3).kill()
        killed_at = time.monotonic()
        for node in nodes:
            node.wait(TIMEOUT_S + 30)
        elapsed = time.monotonic() - killed_at
    finally:
        for node in nodes:
            kill_job(node)
    assert elapsed < TIMEOUT_S, f"the launchers took {elapsed:.1f} s to end the job"
    assert nodes[1].returncode == 128 + signal.SIGKILL
    assert stderr_of(tmp_path, "node1").strip().splitlines()[-1].startswith("error: rank 3 failed (killed by SIGKILL)")
    # The first node's ranks lost their peer: a non-zero exit that says so, no traceback.
    assert nodes[0].returncode == 4
    node0 = stderr_of(tmp_path, "node0")
    assert "communication with the other ranks failed" in node0.strip().splitlines()[-1], node0
    assert "Traceback" not in node0
    assert_all_gone(processes, run_dir)


# --- kill, resume, compare ---------------------------------------------------------------


def test_killed_run_resumes_to_the_same_result(tmp_path, parts, reference_run):
    run_dir = tmp_path / "run"
    job = start([*TRAIN, *train_args(parts, run_dir)], tmp_path, "killed")
    try:
        wait_for(running_after_checkpoint(run_dir), job, START_S, "checkpoint and the epoch after it")
        processes = descendants(job.pid)
        # The launcher's process group is the launcher alone (every rank has a session of
        # its own); SIGKILL gives it no chance to stop them: they must die with it.
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(30)
        assert_all_gone(processes, run_dir, within_s=10)
    finally:
        kill_job(job)
    killed_at = last_epoch(run_dir)
    assert killed_at < EPOCHS and not any(r.get("summary") for r in records(run_dir)), (
        "the run ended before it was killed"
    )

    resumed = run_cli(TRAIN, train_args(parts, run_dir, "--resume"), tmp_path)
    assert resumed.code == 0, resumed.stderr
    checkpoint_epoch = int(resumed.stderr.split("resumed from epoch ")[1].split()[0])
    assert 0 < checkpoint_epoch <= killed_at and checkpoint_epoch % CHECKPOINT_EVERY == 0
    assert_same_training(run_dir, reference_run)


@pytest.mark.parametrize("change", ["model", "partition set"])
def test_resume_refuses_a_checkpoint_of_another_run(parts, reference_run, tmp_path, change):
    if change == "model":
        args, differ = train_args(parts, reference_run, "--hidden", "32", "--resume"), "(hidden differ)"
    else:
        other = partition(random_graph(num_nodes=160, avg_degree=5, seed=4), 2, tmp_path / "other-2", seed=1)
        args, differ = train_args(other, reference_run, "--resume"), "(partition_set differ)"
    before = snapshot(reference_run)
    outcome = run_cli(TRAIN, args, tmp_path)
    assert outcome.code == 2, outcome.stderr
    assert outcome.last_line.startswith("error: rank "), outcome.stderr
    for keyword in (
        f"checkpoint-{EPOCHS:06d}.pt was written for a different run",
        differ,
        "resume with the same partition set and model flags, or pass a new --out",
    ):
        assert keyword in outcome.last_line
    assert "Traceback" not in outcome.stderr
    assert_kept(before, reference_run)


# --- torchrun elastic restart ------------------------------------------------------------


def test_torchrun_restart_resumes_from_the_last_checkpoint(tmp_path, parts, reference_run):
    run_dir = tmp_path / "run"
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.5",
    ]
    job = start([*torchrun, "-m", "bnsgcn.launch.cli", *train_args(parts, run_dir)], tmp_path, "elastic")
    try:
        wait_for(running_after_checkpoint(run_dir), job, START_S, "checkpoint and the epoch after it")
        workers = [p for p in descendants(job.pid) if "bnsgcn.launch.cli" in p.cmdline()]
        rank_process(workers, 1).kill()
        job.wait(FINISH_S)
    finally:
        kill_job(job)
    assert job.returncode == 0, stderr_of(tmp_path, "elastic")[-3000:]
    log = (run_dir / "log.txt").read_text()
    assert "resumed from epoch" in log, log
    assert_same_training(run_dir, reference_run)
    assert_all_gone(workers, run_dir)


# --- resume bookkeeping --------------------------------------------------------------------


def test_resumed_metrics_drop_a_torn_last_line_and_later_epochs(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"epoch": e, "loss": 1.0 / e}) for e in range(1, 5)]
    path.write_text("\n".join(lines) + "\n" + '{"epoch": 5, "lo')  # killed while writing epoch 5
    writer = MetricsWriter([path], keep_epochs=3)
    writer.write({"epoch": 4, "loss": 0.5})
    writer.close()
    assert [json.loads(line)["epoch"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]
    assert not list(tmp_path.glob("*.tmp"))


def test_resumed_metrics_refuse_a_corrupt_line_before_the_last(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"epoch": 1}\nnot json\n{"epoch": 2}\n')
    before = path.read_bytes()
    with pytest.raises(UserError, match="metrics.jsonl line 2 is not JSON; repair or remove the file"):
        MetricsWriter([path], keep_epochs=2)
    assert path.read_bytes() == before
