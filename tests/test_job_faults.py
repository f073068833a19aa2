"""Faults of a running job: a stopped rank (the store's included), a run gone non-finite, a
stranger on the job's store, and end-of-run work that outlasts --timeout."""

from __future__ import annotations

import re
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest

from bnsgcn.config import TrainConfig

from .helpers.cli import TRAIN
from .helpers.faults import (
    START_S,
    assert_all_gone,
    descendants,
    kill_job,
    last_epoch,
    rank_process,
    start,
    stderr_of,
    train_args,
    wait_for,
)
from .helpers.graphs import partition, random_graph
from .helpers.ranks import run_ranks

WORLD = 2


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> Path:
    return partition(random_graph(num_nodes=120, avg_degree=5, seed=8), WORLD, tmp_path_factory.mktemp("job") / "parts")


@pytest.mark.parametrize("stopped", [0, 1])
def test_a_stopped_rank_ends_the_job_within_twice_the_timeout_naming_it(tmp_path, parts, stopped):
    """SIGSTOP one rank after the first epoch: alive, silent, and, for rank 0, holding the
    job's store. The other rank's collective times out, it asks the store who stopped (a
    store that does not answer is the stopped rank 0's) and the job ends naming the rank."""
    timeout_s = 8
    run_dir = tmp_path / "run"
    args = train_args(parts, run_dir, "--epochs", "100000", "--checkpoint-every", "0", "--timeout", str(timeout_s))
    job = start([*TRAIN, *args], tmp_path, "job")
    try:
        wait_for(lambda: last_epoch(run_dir) >= 1, job, START_S, "first epoch in metrics.jsonl")
        processes = descendants(job.pid)
        rank_process(processes, stopped).suspend()
        stopped_at = time.monotonic()
        job.wait(2 * timeout_s + 60)
        elapsed = time.monotonic() - stopped_at
    finally:
        kill_job(job)
    assert elapsed < 2 * timeout_s, f"the job took {elapsed:.1f} s to end after rank {stopped} stopped"
    assert job.returncode == 4
    last_line = stderr_of(tmp_path, "job").strip().splitlines()[-1]
    other = 1 - stopped
    named = "rank 0 stopped (it holds the job's store, which does not answer)" if stopped == 0 else "rank 1 stopped at"
    assert re.match(rf"^error: rank {other} failed \(exit code 4\): .*{re.escape(named)}", last_line), last_line
    assert "Traceback" not in stderr_of(tmp_path, "job")
    assert_all_gone(processes, run_dir)


def test_the_store_listens_on_loopback_and_a_stranger_cannot_plant_the_jobs_error(tmp_path, parts):
    """A job on one machine: every socket its ranks listen on is on the loopback interface,
    and its keys are under a secret: a value a stranger writes where the job's first failure
    would be, without the secret, is never shown as the job's error."""
    import torch.distributed as dist

    run_dir = tmp_path / "run"
    args = train_args(parts, run_dir, "--epochs", "100000", "--checkpoint-every", "0", "--timeout", "20")
    job = start([*TRAIN, *args], tmp_path, "job")
    try:
        wait_for(lambda: last_epoch(run_dir) >= 1, job, START_S, "first epoch in metrics.jsonl")
        processes = descendants(job.pid)
        ranks = [p for p in processes if "bnsgcn.launch.rank" in " ".join(p.cmdline())]
        listening = [
            (c.laddr.ip, c.laddr.port)
            for p in ranks
            for c in p.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        ]
        assert listening and all(ip in ("127.0.0.1", "::1") for ip, _ in listening), listening
        port = int(rank_process(processes, 0).environ()["MASTER_PORT"])
        stranger = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=10))
        for key in ("bnsgcn/attempt-0/first-failure", "first-failure"):
            stranger.set(key, "rank 7 failed first: planted by a stranger")
        assert not stranger.check(["bnsgcn/attempt-0/progress/0"])  # the job's keys are not where a guess looks
        rank_process(processes, 1).kill()
        job.wait(60)
    finally:
        kill_job(job)
    job_stderr = stderr_of(tmp_path, "job")
    assert "planted" not in job_stderr
    assert job_stderr.strip().splitlines()[-1].startswith("error: rank 1 failed (killed by SIGKILL)")


def _config(parts: Path, out: Path, **settings) -> TrainConfig:
    base = dict(parts_dir=parts, model="graphsage", layers=2, hidden=8, epochs=4, eval_every=1, seed=1, device="cpu")
    return TrainConfig.from_settings(**(base | settings), out=out)


def poison_rank_one_loss_at_epoch_two():
    """In a rank: rank 1's loss of its second epoch is NaN."""
    import os

    import bnsgcn.run.train as train

    real, calls = train._loss_sum, []

    def loss_sum(*args):
        calls.append(None)
        value = real(*args)
        return value * float("nan") if os.environ["RANK"] == "1" and len(calls) == 2 else value

    train._loss_sum = loss_sum
    return lambda: None


def poison_rank_one_gradient_at_epoch_two():
    """In a rank: one entry of rank 1's gradients of its second epoch is infinite, its loss
    finite."""
    import os

    import bnsgcn.run.train as train

    real, calls = train._grad_norm, []

    def grad_norm(model):
        calls.append(None)
        if os.environ["RANK"] == "1" and len(calls) == 2:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        return real(model)

    train._grad_norm = grad_norm
    return lambda: None


@pytest.mark.parametrize(
    ("poison", "what"),
    [(poison_rank_one_loss_at_epoch_two, "loss sum nan"), (poison_rank_one_gradient_at_epoch_two, "gradient norm inf")],
)
def test_a_run_gone_non_finite_stops_naming_the_epoch_and_rank_and_keeps_earlier_checkpoints(
    tmp_path, parts, poison, what
):
    config = _config(parts, tmp_path / "run", checkpoint_every=1)
    with pytest.raises(AssertionError) as failed:
        run_ranks(WORLD, [config], instrument=poison)
    assert re.search(rf"UserError: epoch 2: training went non-finite on rank 1 \({what}", str(failed.value))
    checkpoints = sorted(p.name for p in (config.run.out / "checkpoints").iterdir())
    assert checkpoints == ["checkpoint-000001.pt"]  # the last good epoch's; nothing of epoch 2
    assert not (config.run.out / "best_model.pt").exists()
    epochs = [line for line in (config.run.out / "metrics.jsonl").read_text().splitlines() if '"epoch"' in line]
    assert len(epochs) == 1


def slow_figures():
    """In a rank: drawing the report's figures takes longer than the job's --timeout."""
    import bnsgcn.metrics.report as report

    real = report.write_figures

    def write_figures(*args, **kwargs):
        time.sleep(SLOW_FIGURES_S)
        return real(*args, **kwargs)

    report.write_figures = write_figures
    return lambda: None


SLOW_FIGURES_S = 6


def test_end_of_run_work_longer_than_the_timeout_does_not_fail_a_finished_run(tmp_path, parts):
    """Rank 0 draws the report's figures after the ranks have parted: the others do not wait
    for it in a barrier bounded by --timeout."""
    config = _config(parts, tmp_path / "run", epochs=2, timeout=SLOW_FIGURES_S / 2)
    results = run_ranks(WORLD, [config], instrument=slow_figures)
    assert [rank[0]["epochs"] for rank in results] == [2, 2]
    assert (config.run.out / "report.json").exists() and (config.run.out / "best_model.pt").exists()
