"""``--max-lag S`` (bnsgcn.exchange.bounded_lag): boundary rows and gradients point to point, up to S epochs old.

* S = 1 equals ``--staleness 1`` (same seed: the same losses and parameters, to float
  rounding), for GraphSAGE and GAT, with and without smoothing, with ``allreduce`` and with a
  decoupled ``--sync``, exact or with any compressed wire format (the same bytes sent); and
  repeats (to float32 rounding);
* checkpoints: with S = 1 a run resumed from a checkpoint equals the uninterrupted one (int8
  on the wire, smoothing, GAT); with S = 3, fast ranks that ran ahead use the previous
  epoch's versions right after a checkpoint, whose parts hold exactly what S = 1 needs (a
  run resumed from them with S = 1 and one with S = 3 agree on that epoch, and finish); a
  stop signal to one rank stops every rank at the next sync point with a checkpoint, which a
  requeued job resumes; a part written with or without --max-lag is refused by the other;
* S = 3 with one rank slowed by ``--inject-delay`` and a decoupled ``--sync`` at p = 0.5: the
  fast ranks run ahead (their recorded lag exceeds 1 at some epoch, never 3), they wait for
  the slow rank and it hardly waits for them, and the job ends with one model;
* without injected delay a fixed seed repeats what can be repeated: the versions used depend
  on timing, so two runs agree (to float32 rounding) up to the first epoch where either used an older
  version than the previous epoch's (per-rank lag above 1; see docs/training.md);
* a rank killed or hung ends the job with the rank named;
* bad flag combinations are one-line errors (parser, launcher); ``--exchange auto`` on a
  multi-node layout resolves to direct.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest

from bnsgcn.config import TrainConfig, validate
from bnsgcn.errors import UserError

from .helpers.cli import TRAIN, assert_user_error, clean_env, run_cli
from .helpers.faults import (
    FINISH_S,
    START_S,
    assert_killed_rank_is_named,
    check_hung_rank_named,
    descendants,
    in_background_if_selected,
    kill_job,
    last_epoch,
    rank_process,
    run_with_rank_hung,
    start,
    stderr_of,
    train_args,
    wait_for,
)
from .helpers.graphs import partition, random_graph
from .helpers.ranks import run_ranks

WORLD = 3


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    return partition(random_graph(90, avg_degree=4, seed=5), WORLD, tmp_path_factory.mktemp("lag") / "parts")


@pytest.fixture(scope="module")
def parts2(tmp_path_factory):
    return partition(random_graph(100, avg_degree=4, seed=9), 2, tmp_path_factory.mktemp("lag") / "parts2")


def config(parts, out, **kw) -> TrainConfig:
    base = dict(
        parts_dir=parts,
        p=0.5,
        model="graphsage",
        layers=3,
        hidden=8,
        heads=2,
        dropout=0.2,
        lr=0.01,
        epochs=8,
        eval_every=0,
        device="cpu",
        out=out,
        seed=3,
        staleness=1,
        timeout=60,
    )
    return TrainConfig.from_settings(**(base | kw))


def records(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def losses_of(run_dir: Path) -> list[float]:
    return [r["loss"] for r in records(run_dir)]


def assert_same_params(results, a: int, b: int, exact: bool = False) -> None:
    for rank in range(len(results)):
        for name, value in results[rank][a]["params"].items():
            if exact:
                assert np.array_equal(results[rank][b]["params"][name], value), (rank, name)
            else:
                np.testing.assert_allclose(
                    results[rank][b]["params"][name], value, rtol=1e-4, atol=1e-5, err_msg=f"rank {rank} {name}"
                )


# --- S = 1 is --staleness 1 -------------------------------------------------------------------

CASES = [
    dict(model="graphsage"),
    dict(model="graphsage", precompute=False, stale_smoothing=0.7),
    dict(model="gat", p=0.7, stale_smoothing=0.6),
    dict(model="gcn", sync="partial:3", norm="none"),
]


def test_max_lag_one_equals_staleness_one(parts, tmp_path):
    configs = []
    for i, case in enumerate(CASES):
        stale = config(parts, tmp_path / f"stale-{i}", **case)
        configs += [stale, stale.replace(max_lag=1, out=tmp_path / f"lag-{i}")]
    configs.append(configs[1].replace(out=tmp_path / "lag-again"))
    results = run_ranks(WORLD, configs)
    for i, case in enumerate(CASES):
        stale, lagged = configs[2 * i], configs[2 * i + 1]
        assert losses_of(lagged.run.out) == pytest.approx(losses_of(stale.run.out), rel=1e-6, abs=1e-7), case
        assert_same_params(results, 2 * i, 2 * i + 1)
        lines = records(lagged.run.out)
        assert [r["per_rank"]["lag"] for r in lines] == [[0] * WORLD] + [[1] * WORLD] * (stale.run.epochs - 1), case
        # no selections all-to-all: after the first epoch no byte of it
        assert all(r["bytes_sent_by_kind"]["selections"] == 0 for r in lines), case
    # S = 1 repeats, to float32 rounding (see test_a_seed_repeats_while_every_rank_used_the_previous_epochs_versions)
    np.testing.assert_allclose(losses_of(configs[-1].run.out), losses_of(configs[1].run.out), rtol=1e-6, atol=0)
    for rank in range(WORLD):
        for name, value in results[rank][1]["params"].items():
            np.testing.assert_allclose(results[rank][-1]["params"][name], value, rtol=1e-6, atol=1e-9, err_msg=name)


def bytes_sent(run_dir: Path, kind: str) -> int:
    return sum(r["bytes_sent_by_kind"][kind] for r in records(run_dir))


WIRE_CASES = [
    dict(compress="int8"),
    dict(compress="int4", compress_grad="int8", stale_smoothing=0.7),
    dict(model="gat", p=0.7, compress="fp16", compress_grad="bf16"),
]


def test_max_lag_one_with_a_compressed_wire_equals_staleness_one(parts, tmp_path):
    """Encoded in one pass per direction in the stale exchange's order, from the same
    generator state: the same codes, so the same losses and parameters, and the same bytes."""
    configs = []
    for i, case in enumerate(WIRE_CASES):
        stale = config(parts, tmp_path / f"stale-{i}", epochs=5, **case)
        configs += [stale, stale.replace(max_lag=1, out=tmp_path / f"lag-{i}")]
    results = run_ranks(WORLD, configs)
    for i, case in enumerate(WIRE_CASES):
        stale, lagged = configs[2 * i], configs[2 * i + 1]
        assert losses_of(lagged.run.out) == pytest.approx(losses_of(stale.run.out), rel=1e-6, abs=1e-7), case
        assert_same_params(results, 2 * i, 2 * i + 1)
        for kind in ("features", "gradients"):
            assert bytes_sent(lagged.run.out, kind) == bytes_sent(stale.run.out, kind) > 0, (case, kind)


# --- checkpoints ---------------------------------------------------------------------------------


def test_resume_with_max_lag_one_equals_the_uninterrupted_run(parts, tmp_path):
    # p < 1, dropout, int8 on the wire, smoothing: every piece of state a resume needs
    whole = config(
        parts,
        tmp_path / "whole",
        model="gat",
        p=0.5,
        dropout=0.3,
        compress="int8",
        stale_smoothing=0.8,
        epochs=7,
        max_lag=1,
    )
    first = whole.replace(out=tmp_path / "resumed", epochs=4, checkpoint_every=2)
    rest = first.replace(epochs=7, resume=True)  # from the checkpoint of the last epoch of `first`
    results = run_ranks(WORLD, [whole, first, rest])
    assert losses_of(rest.run.out) == losses_of(whole.run.out)
    assert_same_params(results, 0, 2, exact=True)
    expected = [f"checkpoint-{e:06d}{part}.pt" for e in (4, 6) for part in ["", *(f".rank-{r}" for r in range(WORLD))]]
    expected += [f"{name}.sha256" for name in expected]  # each file's checksum (bnsgcn.run.checkpoint)
    assert sorted(p.name for p in (first.run.out / "checkpoints").iterdir()) == sorted(expected)


def test_a_max_lag_checkpoint_holds_the_staleness_one_state(parts, tmp_path):
    """Rank 2 is slow, so the fast ranks run ahead; at a checkpoint (epochs 4 and 8) every
    rank waits until it holds its peers' rows and gradients of that epoch, so the epoch
    after it uses those (lag 1) on every rank. Resumed from the checkpoint after epoch 8
    with S = 1 (which accepts nothing else) and with S = 3, both compute the epoch 9 of the
    uninterrupted run and finish."""
    lagged = config(
        parts, tmp_path / "run", max_lag=3, sync="gossip:1", inject_delay="2:0.12", epochs=10, checkpoint_every=4
    )
    run_ranks(WORLD, [lagged])
    lines = records(lagged.run.out)
    lags = np.array([r["per_rank"]["lag"] for r in lines])  # [epoch, rank]
    assert lags.max() <= 3 and lags[:, :2].max() > 1, lags.tolist()  # the fast ranks ran ahead
    assert (lags[4] == 1).all() and (lags[8] == 1).all(), lags.tolist()  # but not past a checkpoint
    resumed = {
        s: lagged.replace(out=tmp_path / f"resumed-{s}", max_lag=s, inject_delay=None, epochs=11, resume=True)
        for s in (1, 3)
    }
    for job in resumed.values():
        shutil.copytree(lagged.run.out, job.run.out)
    run_ranks(WORLD, list(resumed.values()))
    first, third = records(resumed[1].run.out), records(resumed[3].run.out)
    assert [r["epoch"] for r in first] == [r["epoch"] for r in third] == list(range(1, 12))
    assert first[8]["loss"] == third[8]["loss"] == lines[8]["loss"]
    assert first[8]["per_rank"]["lag"] == third[8]["per_rank"]["lag"] == [1] * WORLD
    assert first[7]["loss"] == third[7]["loss"] == lines[7]["loss"]  # the records before it are kept
    # the two exchanges keep different state: a part of one is refused by the other
    with pytest.raises(
        AssertionError,
        match=r"UserError: rank \d: .*checkpoint-000008\.rank-\d\.pt was written by a run with --max-lag; add "
        r"--max-lag \(any S\) to resume it, or pass a new --out$",
    ):
        run_ranks(WORLD, [resumed[1].replace(max_lag=None, epochs=12)])


def test_stop_signal_checkpoints_at_the_next_sync_point_and_a_requeued_job_resumes(tmp_path, parts2):
    """SIGUSR1 to one rank of a --max-lag job with a decoupled --sync (sync points every 2
    epochs): every rank stops at a sync point, with that epoch's checkpoint; the same command
    run again as a requeued SLURM job continues from it."""
    run_dir = tmp_path / "run"
    argv = [*TRAIN, *train_args(parts2, run_dir, *LAG_FLAGS[2:], "--eval-every", "2", "--checkpoint-every", "100000")]
    job = start([*argv, "--epochs", "1000000"], tmp_path, "job")
    try:
        wait_for(lambda: last_epoch(run_dir) >= 3, job, START_S, "three epochs")
        rank_process(descendants(job.pid), 1).send_signal(signal.SIGUSR1)  # rank 0 learns it at the next sync point
        job.wait(FINISH_S)
    finally:
        kill_job(job)
    assert job.returncode == 128 + signal.SIGUSR1, stderr_of(tmp_path, "job")
    stopped = last_epoch(run_dir)
    assert stopped % 2 == 0  # a sync point
    assert (
        f"stopped by SIGUSR1 after epoch {stopped}, checkpoint written to {run_dir / 'checkpoints'}"
        in stderr_of(tmp_path, "job").strip().splitlines()[-1]
    )
    assert all(
        (run_dir / "checkpoints" / f"checkpoint-{stopped:06d}{part}.pt").is_file()
        for part in ("", ".rank-0", ".rank-1")
    )
    again = subprocess.run(
        [*argv, "--epochs", str(stopped + 2)],
        env=clean_env(SLURM_RESTART_COUNT="1"),
        capture_output=True,
        text=True,
        timeout=FINISH_S,
    )
    assert again.returncode == 0, again.stderr
    assert f"resumed from epoch {stopped}" in again.stdout + again.stderr
    assert [r["epoch"] for r in records(run_dir)] == list(range(1, stopped + 3))


# --- S = 3: fast ranks run ahead of a slow one --------------------------------------------------


@pytest.mark.parametrize("sync", ["partial:2", "gossip:1"])
def test_fast_ranks_run_ahead_of_a_slow_rank_within_the_bound(parts, tmp_path, sync):
    # rank 2 sleeps every epoch; one sync point in the middle (epoch 7) and one at the end
    lagged = config(parts, tmp_path / "lag", sync=sync, inject_delay="2:0.12", epochs=14, eval_every=7, max_lag=3)
    results = run_ranks(WORLD, [lagged])
    lines = records(lagged.run.out)
    lags = np.array([r["per_rank"]["lag"] for r in lines])  # [epoch, rank]
    waits = np.array([r["per_rank"]["lag_wait"] for r in lines])
    assert lags.max() <= 3, lags.tolist()
    assert lags[:, 0].max() > 1 and lags[:, 1].max() > 1, lags.tolist()  # the fast ranks ran ahead
    assert (lags[1:] >= 1).all() and (lags[0] == 0).all(), lags.tolist()  # the first epoch is exact
    # the fast ranks waited for the slow one (once 3 epochs ahead), the slow one hardly at all
    assert min(waits[:, 0].sum(), waits[:, 1].sum()) > 0.3 and waits[:, 2].sum() < 0.5 * min(
        waits[:, 0].sum(), waits[:, 1].sum()
    ), waits.tolist()
    assert all(r["per_rank"]["steps"] == [1] * WORLD for r in lines)
    for rank in (1, 2):  # one model at the end
        for name, value in results[0][0]["params"].items():
            assert np.array_equal(results[rank][0]["params"][name], value), (rank, name)
    report = json.loads((lagged.run.out / "report.json").read_text())
    assert all(r["lag"] >= 1 and r["time_lag_wait"] >= 0 for r in report["ranks"])
    assert report["summary"]["lag"]["max"] <= 3


# --- a seed without injected delay ------------------------------------------------------------


def test_a_seed_repeats_while_every_rank_used_the_previous_epochs_versions(parts, tmp_path):
    """Which version a rank uses depends on what has arrived: two runs with S = 3 agree
    (with S = 1 too) up to the first epoch where some rank used an older version than the
    previous epoch's; without delays that is rare, and the records say where. Agree to
    float32 rounding: rarely (from one run in 30 to one in several hundred here, with S = 1
    as well) some rank's loss sum differs in its last place at a few epochs with every lag at
    1 (the epochs between are equal), while an older version moved the loss by about 1e-2."""
    one = config(parts, tmp_path / "one", max_lag=1, epochs=10)
    first, second = one.replace(max_lag=3, out=tmp_path / "a"), one.replace(max_lag=3, out=tmp_path / "b")
    run_ranks(WORLD, [one, first, second])
    reference = losses_of(one.run.out)
    for job in (first, second):
        lines = records(job.run.out)
        lags = [max(r["per_rank"]["lag"]) for r in lines]
        assert max(lags) <= 3
        same = next((e for e, lag in enumerate(lags) if lag > 1), len(lags))  # epochs before the first older version
        print(
            f"{job.run.out.name}: lag per epoch {lags}; equal to S = 1 for {same} of {len(lags)} epochs"
        )  # pytest -rP
        np.testing.assert_allclose(losses_of(job.run.out)[:same], reference[:same], rtol=1e-6, atol=0)


# --- failures ------------------------------------------------------------------------------------

LAG_FLAGS = ["--checkpoint-every", "0", "--staleness", "1", "--max-lag", "2", "--sync", "gossip:1"]


def test_rank_killed_ends_the_job_naming_it(tmp_path, parts2):
    assert_killed_rank_is_named(tmp_path, train_args(parts2, tmp_path / "run", "--epochs", "100000", *LAG_FLAGS))


# --- flags -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, words",
    [
        (
            dict(max_lag=2),
            "--max-lag bounds how many epochs stale rows may be, but --staleness is 0; add --staleness 1 or drop "
            "--max-lag",
        ),
        (dict(max_lag=0, staleness=1), "--max-lag 0 must be a positive number of epochs"),
        (
            dict(max_lag=2, staleness=1, exchange="hierarchical"),
            "pass --exchange direct (or auto) instead of hierarchical, or drop --max-lag",
        ),
    ],
)
def test_bad_combinations_are_refused_in_one_line(kw, words):
    with pytest.raises(UserError) as info:
        validate(TrainConfig.from_settings(**kw))
    assert words in str(info.value) and "\n" not in str(info.value)


def test_launcher_refuses_before_any_rank_starts(tmp_path, parts2):
    outcome = run_cli(
        TRAIN, ["--procs", "2", "--parts-dir", str(parts2), "--max-lag", "3", "--out", str(tmp_path / "run")], tmp_path
    )
    assert_user_error(outcome, "--max-lag bounds how many epochs stale rows may be, but --staleness is 0")
    assert outcome.stderr.strip().count("\n") == 0, outcome.stderr
    assert not (tmp_path / "run").exists()


def test_auto_exchange_on_several_nodes_resolves_to_direct(parts, tmp_path):
    """Where auto alone would choose the node-aware exchange (two machines, one with two
    ranks), --max-lag makes it direct: the same run as --exchange direct."""
    lagged = config(parts, tmp_path / "auto", max_lag=1, epochs=3)
    direct = lagged.replace(exchange="direct", out=tmp_path / "direct")
    run_ranks(WORLD, [lagged, direct], nodes=[0, 0, 1])
    assert json.loads((lagged.run.out / "config.json").read_text())["exchange"] == "direct"
    assert losses_of(lagged.run.out) == losses_of(direct.run.out)


# --- a hung rank: its job runs in the background from the module's start (it mostly waits) ----

HANG_TIMEOUT_S = 5


@pytest.fixture(scope="module", autouse=True)
def hung_job(request, parts2, tmp_path_factory):
    """The job of test_hung_rank_is_named_after_the_timeout, started with the module's first
    test: rank 1 suspended after the first epoch (helpers.faults.run_with_rank_hung)."""
    cwd = tmp_path_factory.mktemp("hung")
    flags = [*LAG_FLAGS[:-1], "grouped:1000:2"]
    args = train_args(
        parts2, cwd / "run", "--epochs", "100000", *flags, "--timeout", str(HANG_TIMEOUT_S), "--eval-every", "50"
    )
    name = "test_hung_rank_is_named_after_the_timeout"
    with in_background_if_selected(request, name, lambda: run_with_rank_hung(cwd, args, HANG_TIMEOUT_S)) as job:
        yield cwd, job


def test_hung_rank_is_named_after_the_timeout(hung_job):
    """Between sync points (every 50 epochs) ranks meet only in the point-to-point transfers
    (grouped with two groups of one rank each: no collective per step after the first): a
    rank waiting there for a hung one ends after --timeout, naming it."""
    cwd, job = hung_job
    pattern = (
        r"rank 0: waiting for (rows|gradients) of epoch \d+ or later from ranks \[1\] took longer than "
        r"--timeout 5 s; rank 1 stopped at epoch \d+ while the others waited$"
    )
    check_hung_rank_named(cwd, cwd / "run", job.result(), HANG_TIMEOUT_S, pattern)
