"""The roofline benchmark (benchmarks/roofline.py): the floor's arithmetic, its quick run end to
end, and its answers to bad input. The measured table on the reference graph is in
docs/benchmarks.md ("Roofline: the epoch against the machine's floor")."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import roofline as rl

from ..helpers import REPO, kernels

GIGA = 1e9


def flat_roofline(widths: list[int]) -> dict:
    """Every GEMM at 1 GFLOP/s, every gather at 1 GB/s, copies at 2 GB/s: seconds = work / rate."""
    gemms = [
        {"kind": kind, "d_in": a, "d_out": b, "flop_per_s": GIGA}
        for a, b in zip(widths[:-1], widths[1:])
        for kind in rl.GEMM_KINDS
    ]
    gathers = [{"width": w, "bytes_per_s": GIGA} for w in set(widths[1:])]
    return {"gemm": gemms, "gather": gathers, "copy_bytes_per_s": 2 * GIGA}


def _epochs(run_dir: Path) -> list[dict]:
    """The per-epoch lines of a run's metrics.jsonl."""
    return [line for line in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "time" in line]


def test_floor_counts_the_model_work_by_the_documented_formulas():
    n, nb, ei, eb, t, feat, c = 1000, 400, 9000, 2000, 600, 64, 8
    graph = rl.RankGraph(
        rank=0, inner=n, boundary=nb, inner_entries=ei, boundary_entries=eb, train_nodes=t, features=feat, classes=c
    )
    b = 100  # a quarter of the boundary sampled: a quarter of its entries expected
    run = rl.RunFigures(
        measured_s={},
        sampled_boundary=b,
        sent_feature_bytes=5_000.0,
        received_gradient_bytes=7_000.0,
        moved_bytes=24_000.0,
    )
    h = rl.HIDDEN
    widths = [feat, h, h, c]
    result = rl.floor(graph, run, flat_roofline(widths))
    parts, f, e = result["parts"], 4, ei + eb * b / nb
    assert result["sampled_entries"] == pytest.approx(e)

    products = [feat * h, h * h, h * c]  # d_in * d_out of each layer
    assert parts["gemm_forward"]["flops"] == pytest.approx(sum(2 * 2 * n * p for p in products))
    # weight gradients everywhere, input gradients from layer 1 on
    assert parts["gemm_backward"]["flops"] == pytest.approx(
        2 * 2 * n * products[0] + sum(4 * 2 * n * p for p in products[1:])
    )
    aggregated = [h, c]  # layer 1 aggregates first (128 -> 128), layer 2 multiplies first (128 -> 16)
    assert parts["sparse_forward"]["bytes"] == pytest.approx(sum(f * (e * w + n * w) + 4 * e for w in aggregated))
    assert parts["sparse_backward"]["bytes"] == pytest.approx(
        sum(f * (e * w + (n + b) * w) + 4 * e for w in aggregated)
    )
    # a float read and written per element, one mask bit written (forward) or read (backward)
    assert parts["elementwise_forward"]["bytes"] == pytest.approx(
        2 * 8.125 * n * feat + 2 * 8.125 * n * h + 2 * 5_000 + f * t * c
    )
    assert parts["elementwise_backward"]["bytes"] == pytest.approx(2 * f * t * c + 2 * 12.125 * n * h + 3 * 7_000)
    params = 2 * feat * h + h + 2 * h * h + h + 2 * h * c + c + 2 * (2 * h)
    assert parts["optimizer"]["bytes"] == pytest.approx(8 * f * params)

    seconds = result["seconds"]
    assert set(seconds) == set(rl.PHASES)
    assert seconds["forward_compute"] == pytest.approx(
        parts["gemm_forward"]["flops"] / GIGA
        + parts["sparse_forward"]["bytes"] / GIGA
        + parts["elementwise_forward"]["bytes"] / (2 * GIGA)
    )
    assert seconds["other"] == pytest.approx(parts["optimizer"]["bytes"] / (2 * GIGA))
    assert seconds["sampling"] == seconds["exchange"] == seconds["reduction"] == 0.0


def test_verdict_is_each_p_s_median_ratio_over_its_rounds():
    # three rounds of p = 1 and 0.1, alternating as the benchmark runs them
    ratios = {1.0: [1.30, 1.10, 1.20], 0.1: [1.00, 1.40, 1.26]}
    strict = {1.0: [1.40, 1.20, 1.25], 0.1: [1.10, 1.50, 1.30]}  # against the faster measurement: for the record
    runs = [
        {"p": p, "job_epoch": {"ratio": ratios[p][k]}, "epoch_against_fastest": {"ratio": strict[p][k]}}
        for k in range(3)
        for p in (1.0, 0.1)
    ]
    result = rl.verdict(runs, [1.0, 0.1, 1.0])  # a p given twice is judged once
    assert [(v["p"], v["ratios"], v["median_ratio"], v["target_met"]) for v in result["by_p"]] == [
        (1.0, [1.30, 1.10, 1.20], 1.20, True),
        (0.1, [1.00, 1.40, 1.26], 1.26, False),
    ]
    assert [(v["ratios_against_fastest"], v["median_ratio_against_fastest"]) for v in result["by_p"]] == [
        ([1.40, 1.20, 1.25], 1.25),
        ([1.10, 1.50, 1.30], 1.30),
    ]
    assert result["target_met"] is False and result["target_ratio"] == 1.25
    assert rl.verdict(runs[:1], [1.0])["target_met"] is False  # one round: that run's ratio, 1.30


def test_quick_run_writes_a_complete_consistent_table(tmp_path):
    kernels.compiled()
    out = tmp_path / "roofline.json"
    work = tmp_path / "work"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "roofline.py"),
            "--quick",
            "--rounds",
            "2",
            "--out",
            str(out),
            "--work",
            str(work),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| epoch |" in done.stdout
    # an unmeasured epoch per p compiled the kernels first: no measured peak holds the compiler
    first_measurement = done.stderr.index("measuring the roofline")
    assert all(-1 < done.stderr.find(f"compiling the kernels at p = {p:g}") < first_measurement for p in (1, 0.1)), (
        done.stderr
    )
    document = json.loads(out.read_text())
    assert not list(tmp_path.glob("*.tmp"))  # written atomically, nothing left behind

    assert document["date"] and document["machine"]["cpu_model"]
    assert len(document["rooflines"]) == len(document["runs"]) + 1  # before the first run and after each
    roof = document["rooflines"][0]
    assert roof["threads"] == 1
    # every distinct product the model runs, once: 128 -> 128 (layers 0 and 1) and 128 -> 16, each kind
    assert sorted((g["kind"], g["d_in"], g["d_out"]) for g in roof["gemm"]) == sorted(
        (k, 128, d) for d in (128, 16) for k in rl.GEMM_KINDS
    )
    assert all(g["flop_per_s"] > 0 for g in roof["gemm"])
    assert sorted(g["width"] for g in roof["gather"]) == [16, 128] and all(g["bytes_per_s"] > 0 for g in roof["gather"])
    assert roof["copy_bytes_per_s"] > 0
    use = roof["machine_use"]
    assert (
        use["wall_s"] > 0
        and use["own_cpu_s"] > 0
        and use["other_processes_cpu_s"] >= 0
        and use["other_processes_core_share"] >= 0
    )

    # an all-to-all of 32 MiB each way between two processes, once, before the runs
    exchange = document["exchange_cost"]
    assert exchange["bytes"] == 2 * rl.EXCHANGE_PROBE_BYTES and exchange["cpu_s"] > 0
    assert exchange["cpu_s_per_byte"] == pytest.approx(exchange["cpu_s"] / exchange["bytes"])
    assert (
        first_measurement
        < done.stderr.index("measuring an all-to-all's CPU cost")
        < done.stderr.index("training at p = 1")
    )

    # two rounds, the ps alternating, each run in a directory of its own
    assert [(run["p"], run["round"], run["run"]) for run in document["runs"]] == [
        (1.0, 1, "run-p1"),
        (0.1, 1, "run-p0.1"),
        (1.0, 2, "run-p1-round2"),
        (0.1, 2, "run-p0.1-round2"),
    ]
    assert [r["busy_neighbours"] for r in document["rooflines_busy"]] == [1] * 5  # one per other rank
    for k, run in enumerate(document["runs"]):
        # the run's roofline: each time the mean of the measurements before and after it;
        # likewise the one measured with the other rank's core busy
        for measurements, key in (("rooflines", "roofline"), ("rooflines_busy", "roofline_busy")):
            before, after, used = document[measurements][k], document[measurements][k + 1], run[key]
            spreads = []
            for kind, rate in (("gemm", "flop_per_s"), ("gather", "bytes_per_s")):
                for a, b, m in zip(before[kind], after[kind], used[kind], strict=True):
                    assert m["seconds"] == pytest.approx((a["seconds"] + b["seconds"]) / 2)
                    assert m[rate] == pytest.approx(a[rate] * a["seconds"] / m["seconds"])
                    spreads.append(abs(a[rate] - b[rate]) / max(a[rate], b[rate]))
            copies = (before["copy_bytes_per_s"], after["copy_bytes_per_s"])
            assert used["copy_bytes_per_s"] == pytest.approx(2 / sum(1 / c for c in copies))
            spreads.append(abs(copies[0] - copies[1]) / max(copies))
            assert used["rate_spread"] == pytest.approx(max(spreads))
        # the target judges the job's epoch, metrics.jsonl's (the slowest rank's per epoch, the
        # median over the epochs after the first that do not evaluate), against the largest rank floor
        timed = [e["time"]["epoch"] for e in _epochs(work / run["run"])[1:] if e["time"]["evaluation"] == 0]
        job = run["job_epoch"]
        assert job["measured_s"] == pytest.approx(statistics.median(timed)) == pytest.approx(run["epoch_wall_s"])
        assert job["floor_s"] == pytest.approx(max(sum(r["floor_s"].values()) for r in run["ranks"]))
        assert job["ratio"] == pytest.approx(job["measured_s"] / job["floor_s"]) and run["target_met"] == (
            job["ratio"] <= rl.TARGET_RATIO
        )
        busy = run["epoch_with_ranks_busy"]  # the same epoch against the floor of the busy rates
        assert busy["measured_s"] == pytest.approx(job["measured_s"]) and busy["floor_s"] > 0
        assert busy["floor_s"] != pytest.approx(job["floor_s"], rel=1e-9)
        assert busy["ratio"] == pytest.approx(busy["measured_s"] / busy["floor_s"])
        # and against the faster of the two measurements around it, each measurement's own
        before, after = document["rooflines"][k], document["rooflines"][k + 1]
        faster = {"threads": 1, "copy_bytes_per_s": max(before["copy_bytes_per_s"], after["copy_bytes_per_s"])}
        for kind in ("gemm", "gather"):
            faster[kind] = [a if a["seconds"] <= b["seconds"] else b for a, b in zip(before[kind], after[kind])]
        graphs = [rl.RankGraph(**g) for g in document["graph"]]
        strict = run["epoch_against_fastest"]
        strict_floors = [
            sum(r["floor_s"].values()) for r in rl.compare(graphs, rl.read_run(work / run["run"]), faster)["ranks"]
        ]
        assert strict["floor_s"] == pytest.approx(max(strict_floors)) and strict["measured_s"] == pytest.approx(
            job["measured_s"]
        )
        assert strict["ratio"] == pytest.approx(strict["measured_s"] / strict["floor_s"]) and 0 < strict[
            "floor_s"
        ] <= job["floor_s"] * (1 + 1e-9)
        assert [r["phase"] for r in run["phases"]] == list(rl.PHASES)
        for r in run["phases"] + [run["epoch"]]:
            assert r["measured_s"] >= 0 and r["floor_s"] >= 0
            assert r["above_floor_s"] == pytest.approx(r["measured_s"] - r["floor_s"])
            if r["floor_s"] > 0:
                assert r["ratio"] == pytest.approx(r["measured_s"] / r["floor_s"])
            else:
                assert r["ratio"] is None
        epoch = run["epoch"]
        assert epoch["floor_s"] > 0 and epoch["measured_s"] > 0
        assert epoch["measured_s"] == pytest.approx(sum(r["measured_s"] for r in run["phases"]))
        assert epoch["floor_s"] == pytest.approx(sum(r["floor_s"] for r in run["phases"]))
        assert run["epoch_wall_s"] > 0
        assert len(run["peak_rss_mib"]) == 2 and all(
            m > 100 for m in run["peak_rss_mib"]
        )  # torch alone is over 100 MiB
        assert (
            run["peak_target_mib"] is None and run["peak_target_met"] is None
        )  # the targets are the reference graph's
        assert f"peak RSS per rank: {run['peak_rss_mib'][0]:,.0f} / " in done.stdout
        use = run["machine_use"]
        assert (
            use["wall_s"] > 0
            and use["own_cpu_s"] > 0
            and use["other_processes_cpu_s"] >= 0
            and use["other_processes_core_share"] >= 0
        )

        ranks = {r["rank"]: r for r in run["ranks"]}
        assert sorted(ranks) == [0, 1]
        slowest = ranks[run["slowest_rank"]]
        assert all(sum(slowest["measured_s"].values()) >= sum(r["measured_s"].values()) for r in ranks.values())
        parts = slowest["floor_parts"]
        for direction in ("forward", "backward"):
            table_floor = next(r["floor_s"] for r in run["phases"] if r["phase"] == f"{direction}_compute")
            assert table_floor == pytest.approx(
                sum(parts[f"{kind}_{direction}"]["seconds"] for kind in ("gemm", "sparse", "elementwise"))
            )
        assert 0 < slowest["sampled_boundary"] <= document["graph"][run["slowest_rank"]]["boundary"]
        # the exchange's CPU time: the slowest rank's rows and gradients, sent and received, at the measured cost
        per_epoch = next(
            r
            for r in json.loads((work / run["run"] / "report.json").read_text())["ranks"]
            if r["rank"] == run["slowest_rank"]
        )["per_epoch"]
        moved = sum(per_epoch[f"{way}_{what}"] for way in ("sent", "received") for what in ("features", "gradients"))
        assert run["exchange_cpu"]["moved_bytes"] == pytest.approx(moved) and moved > 0
        assert run["exchange_cpu"]["cpu_s"] == pytest.approx(moved * exchange["cpu_s_per_byte"])
        assert f"about {run['exchange_cpu']['cpu_s']:.3f} s per epoch on the ranks' cores" in done.stdout
    p1, p01 = document["runs"][:2]
    assert p01["ranks"][0]["sampled_boundary"] < p1["ranks"][0]["sampled_boundary"]  # p shrinks the sample
    assert p01["exchange_cpu"]["moved_bytes"] < p1["exchange_cpu"]["moved_bytes"]  # and the rows moved

    # the verdict per p: the median of its rounds' ratios, printed beside each round's
    result = document["verdict"]
    assert result["target_ratio"] == rl.TARGET_RATIO and [v["p"] for v in result["by_p"]] == [1.0, 0.1]
    for v in result["by_p"]:
        ratios = [run["job_epoch"]["ratio"] for run in document["runs"] if run["p"] == v["p"]]
        assert v["ratios"] == ratios and len(ratios) == 2
        assert v["median_ratio"] == pytest.approx(statistics.median(ratios))
        assert v["target_met"] == (v["median_ratio"] <= rl.TARGET_RATIO)
        assert f"| {v['p']:g} | {ratios[0]:.2f}, {ratios[1]:.2f} | {v['median_ratio']:.2f} |" in done.stdout
        strict = [run["epoch_against_fastest"]["ratio"] for run in document["runs"] if run["p"] == v["p"]]
        assert v["ratios_against_fastest"] == strict and v["median_ratio_against_fastest"] == pytest.approx(
            statistics.median(strict)
        )
    assert result["target_met"] == all(v["target_met"] for v in result["by_p"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--parts-dir", "/nonexistent/parts"], "is not a partition set"),
        (["--quick", "--p", "0"], "--p 0: pass probabilities in (0, 1]"),
        (["--quick", "--epochs", "3"], "--epochs 3: pass an odd number, 5 or more"),
        (["--quick", "--epochs", "6"], "--epochs 6: pass an odd number, 5 or more"),
        (["--quick", "--rounds", "0"], "--repeat, --rounds and --timeout must be >= 1"),
        ([], "pass either --parts-dir PARTS or --quick"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys, tmp_path):
    assert rl.main(argv + ["--out", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    assert not (tmp_path / "r.json").exists()
