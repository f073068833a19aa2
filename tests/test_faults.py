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
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from bnsgcn.errors import UserError
from bnsgcn.metrics.log import MetricsWriter

from .helpers.cli import TRAIN, assert_kept, run_cli, snapshot
from .helpers.faults import (
    CHECKPOINT_EVERY,
    EPOCHS,
    FINISH_S,
    FLAGS,
    START_S,
    TIMEOUT_S,
    assert_all_gone,
    check_hung_rank_named,
    descendants,
    epoch_records,
    in_background_if_selected,
    kill_job,
    last_epoch,
    rank_process,
    records,
    run_with_rank_hung,
    start,
    stderr_of,
    train_args,
    wait_for,
)
from .helpers.graphs import partition, random_graph
from .helpers.ranks import free_port

# --- helpers -----------------------------------------------------------------------------


def running_after_checkpoint(run_dir: Path) -> Callable[[], bool]:
    """A checkpoint exists and the epoch after it has been logged: a kill now loses work."""
    return lambda: last_epoch(run_dir) > CHECKPOINT_EVERY and any((run_dir / "checkpoints").glob("checkpoint-*.pt"))


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


# --- a hung rank: its job runs in the background from the module's start (it mostly waits) ----

HANG_TIMEOUT_S = 5


@pytest.fixture(scope="module", autouse=True)
def hung_job(request, work: Path, parts: Path):
    """The job of test_hung_rank_ends_the_job_after_the_timeout, started with the module's
    first test: rank 1 suspended after the first epoch (helpers.faults.run_with_rank_hung)."""
    cwd = work / "hung"
    cwd.mkdir()
    args = train_args(
        parts, cwd / "run", "--epochs", "100000", "--checkpoint-every", "0", "--timeout", str(HANG_TIMEOUT_S)
    )
    name = "test_hung_rank_ends_the_job_after_the_timeout"
    with in_background_if_selected(request, name, lambda: run_with_rank_hung(cwd, args, HANG_TIMEOUT_S)) as job:
        yield cwd, job


def test_hung_rank_ends_the_job_after_the_timeout(hung_job):
    cwd, job = hung_job
    # rank 0 names the timeout, and the hung rank from the progress every rank reports through the store
    pattern = (
        r"^error: rank 0 failed \(exit code 4\): error: \[rank 0\] communication with the other ranks failed: "
        r"Timed out.*; rank 1 stopped at epoch \d+ while the others waited$"
    )
    check_hung_rank_named(cwd, cwd / "run", job.result(), HANG_TIMEOUT_S, pattern)
