"""The stragglers benchmark (benchmarks/stragglers.py): its arithmetic on hand-made records,
its quick preset run for real on loopback (4 ranks, about a minute here), whose record must
be complete and consistent, and the quick baseline with --relative-delays (calibrated, then
scaled)."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import date

import pytest

from benchmarks import stragglers as st

from ..helpers import REPO, kernels

# ---------------------------------------------------------------------------- arithmetic


def epoch(n: int, elapsed: float, evaluation: float = 0.0, val: float | None = None) -> dict:
    record = {
        "epoch": n,
        "time": {"epoch": 99.0, "elapsed": elapsed, "evaluation": evaluation},
    }  # time.epoch is never read
    return record if val is None else record | {"val_score": val, "test_score": val - 0.01}


def test_training_seconds_are_elapsed_minus_every_evaluation_so_far():
    curve = st.training_curve([epoch(1, 1.0, 0.2, val=0.5), epoch(2, 1.5), epoch(3, 3.0, 0.3, val=0.8)])
    assert [c[0] for c in curve] == [1, 3]
    assert [x for c in curve for x in c[1:]] == pytest.approx([0.8, 0.5, 0.49, 2.5, 0.8, 0.79])


def record(label: str, sync: str, curve: list[tuple[int, float, float]], seed: int = 0, pool: bool = False) -> dict:
    return {
        "label": label,
        "sync": sync,
        "pool": pool,
        "seed": seed,
        "val_curve": [list(c) for c in curve],
        "best_val_score": max(v for _, _, v in curve),
    }


def test_target_is_the_baselines_best_minus_one_point_and_allreduce_is_no_candidate():
    document = {
        "runs": [
            record(
                "allreduce", "allreduce", [(5, 10.0, 0.5), (10, 20.0, 0.90), (15, 30.0, 0.95)]
            ),  # target 0.94, reached at 30 s
            record("pool-allreduce", "allreduce", [(5, 5.0, 0.94)], pool=True),  # faster, but not a mode of the target
            record("gossip1", "gossip:1", [(5, 15.0, 0.93), (10, 25.0, 0.941)]),
            record("pool-partial4", "partial:4", [(5, 17.0, 0.945)], pool=True),
            record("partial4", "partial:4", [(5, 10.0, 0.90)]),
            {"label": "broken", "name": "broken-s0", "error": "node 1 failed"},
        ]
    }
    st.attach_targets(document)
    runs = {r["label"]: r for r in document["runs"]}
    assert runs["allreduce"]["time_to_accuracy"] == pytest.approx({"target": 0.94, "epoch": 15, "seconds": 30.0})
    assert runs["allreduce"]["time_ratio"] == 1.0
    assert runs["gossip1"]["time_ratio"] == pytest.approx(25 / 30)
    assert runs["partial4"]["time_to_accuracy"]["seconds"] is None and runs["partial4"]["time_ratio"] is None
    (seed,) = document["target"]["per_seed"]
    assert seed["best_mode"] == "pool-partial4" and seed["best_ratio"] == pytest.approx(17 / 30)
    assert seed["met"] and document["target"]["met"]  # 0.567 <= 0.6
    assert seed["not_reached"] == ["partial4"]
    runs["pool-partial4"]["val_curve"] = [[5, 19.0, 0.945]]  # 0.633: missed
    st.attach_targets(document)
    assert not document["target"]["met"]


def test_plan_scales_the_delay_per_partition_and_names_every_run():
    runs = st.plan(st.FULL, (0,))
    assert runs[0].label == st.BASELINE and runs[0].p == 0 and not runs[0].pool
    assert len({r.name for r in runs}) == len(runs)
    pool = [r for r in runs if r.pool]
    assert {r.sync for r in pool} >= {"allreduce", "grouped:5", "partial:4", "gossip:1"} and all(
        r.parts == 32 for r in pool
    )
    assert pool[0].delay_spec == "0:0.2,1:0.2,2:0.1,4:0.2,5:0.1"  # 0.8 s x 8 / 32 per partition
    assert runs[0].delay_spec == "0:0.8,1:0.8,2:0.4,4:0.8,5:0.4"
    assert all(r.p == 0 for r in runs if r.sync != "allreduce")


def test_relative_delays_scale_by_what_the_machine_adds_to_the_sleep():
    # epochs of 1.0, 0.9, 0.95, 0.95 (+0.5 evaluation), 1.0 s: past the first two, the median is 0.95
    ends = [1.0, 1.9, 2.85, 4.3, 5.3]
    epochs = [epoch(i + 1, end, evaluation=0.5 if i == 3 else 0.0) for i, end in enumerate(ends)]
    assert st.non_delay_seconds(epochs, {0: 0.8, 2: 0.4}) == pytest.approx(0.15)
    with pytest.raises(st.UserError, match="at least 3"):
        st.non_delay_seconds(epochs[:2], {0: 0.8})
    scaled = st.plan(st.FULL, (0,), 2.0)
    assert scaled[0].delay_spec == "0:1.6,1:1.6,2:0.8,4:1.6,5:0.8"
    assert (
        next(r for r in scaled if r.pool).delay_spec == "0:0.4,1:0.4,2:0.2,4:0.4,5:0.2"
    )  # per partition: x 8 / 32 too
    calibration = st.calibration_run(st.FULL)
    assert (calibration.sync, calibration.p, calibration.pool, calibration.delay_spec) == (
        "allreduce",
        0.0,
        False,
        st.delay_spec(st.FULL.delays),
    )


# ---------------------------------------------------------------------------- the quick preset, for real


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    kernels.compiled()
    work = tmp_path_factory.mktemp("stragglers")
    out = work / "quick.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.stragglers",
            "--quick",
            "--no-cluster",
            "--work",
            str(work),
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout, out


def test_quick_record_is_complete_and_consistent(quick):
    document, stdout, out = quick
    setting = st.QUICK
    assert not out.with_suffix(".json.tmp").exists()  # written by rename
    assert (
        document["date"] == date.today().isoformat() and document["machine"]["cores"] and document["preset"] == "quick"
    )
    planned = {r.name: r for r in st.plan(setting, (0,))}
    runs = {r["name"]: r for r in document["runs"]}
    assert set(runs) == set(planned)  # every planned run, nothing else
    assert not [r["error"] for r in runs.values() if "error" in r]
    per_step = {r: s * setting.ranks / setting.pool_parts for r, s in setting.delays.items()}
    for name, r in runs.items():
        plan = planned[name]
        assert r["epochs_run"] == plan.epochs == len(r["steps_per_epoch"])
        # the curve: every evaluation, in order, training seconds growing, within the run's time
        epochs = [e for e, _, _ in r["val_curve"]]
        assert epochs == list(range(setting.eval_every, plan.epochs + 1, setting.eval_every)), name
        seconds = [s for _, s, _ in r["val_curve"]]
        assert all(0 < a <= b for a, b in zip(seconds, seconds[1:])), (name, seconds)
        assert 0 < r["training_s"] <= r["elapsed_s"] <= r["wall_s"], name
        assert seconds[-1] == pytest.approx(r["training_s"])
        # best validation and the test score at its epoch, as the run's summary says
        assert r["best_val_score"] == max(v for _, _, v in r["val_curve"])
        assert r["test_score"] == dict(map(tuple, r["test_curve"]))[r["best_epoch"]]
        # time to accuracy: within the run, and reached where the curve says so
        reached = r["time_to_accuracy"]
        first = next(((e, s) for e, s, v in r["val_curve"] if v >= reached["target"]), (None, None))
        assert (reached["epoch"], reached["seconds"]) == first, name
        if reached["seconds"] is not None:
            assert reached["seconds"] <= r["training_s"] <= r["wall_s"]
        # steps: one per rank and epoch without the pool; every partition once per epoch with it
        assert r["steps_per_rank"] == r["steps_per_rank_report"], name
        if plan.pool:
            assert all(sum(steps) == setting.pool_parts for steps in r["steps_per_epoch"]), (name, r["steps_per_epoch"])
            delays = per_step
        else:
            assert all(steps == [1] * setting.ranks for steps in r["steps_per_epoch"]), name
            delays = setting.delays
        # the injected delay: per step taken (pool) or per epoch, on the delayed ranks only
        for rank, slept in enumerate(r["injected_delay_s_per_rank"]):
            wanted = delays.get(rank, 0.0) * r["steps_per_rank"][rank]
            assert wanted <= slept + 1e-6 and slept <= 1.5 * wanted + 0.05, (name, rank, slept, wanted)
    base = runs[f"{st.BASELINE}-s0"]
    assert base["time_ratio"] == 1.0 and base["time_to_accuracy"]["target"] == pytest.approx(
        base["best_val_score"] - 0.01
    )
    (verdict,) = document["target"]["per_seed"]
    assert verdict["baseline_seconds"] == base["time_to_accuracy"]["seconds"]
    assert verdict["met"] == (verdict["best_ratio"] is not None and verdict["best_ratio"] <= 0.6)
    assert "Target:" in stdout and "| pool-allreduce |" in stdout


def test_relative_delays_calibrate_then_scale_every_run(tmp_path):
    kernels.compiled()
    out = tmp_path / "relative.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.stragglers",
            "--quick",
            "--no-cluster",
            "--relative-delays",
            "--only",
            st.BASELINE,
            "--work",
            str(tmp_path / "work"),
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    document = json.loads(out.read_text())
    scaling = document["delay_scale"]
    calibration = st.read_records(tmp_path / "work" / "runs" / st.calibration_run(st.QUICK).name)[0]
    assert len(calibration) == st.CALIBRATION_EPOCHS
    assert scaling["measured_non_delay_s"] == pytest.approx(st.non_delay_seconds(calibration, st.QUICK.delays))
    assert scaling["scale"] == pytest.approx(scaling["measured_non_delay_s"] / st.QUICK.reference_non_delay_s)
    (run,) = document["runs"]
    assert run["delay_spec"] == st.delay_spec(st.QUICK.delays, scaling["scale"])
    for rank, slept in enumerate(run["injected_delay_s_per_rank"]):  # every epoch slept the scaled delay
        wanted = st.QUICK.delays.get(rank, 0.0) * scaling["scale"] * run["epochs_run"]
        assert wanted - 1e-3 <= slept <= 1.5 * wanted + 0.05, (rank, slept, wanted)
    assert "--relative-delays: this machine adds" in done.stdout  # the tables say the delays were scaled
