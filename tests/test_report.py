"""The memory-balance report: numbers computable by hand, a real 2-rank run, the CLI."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest
import torch

from bnsgcn.config import TrainConfig
from bnsgcn.data.format import load_partition
from bnsgcn.metrics import report
from bnsgcn.metrics.accounting import COLUMNS
from bnsgcn.metrics.memory import HOLDERS

from .helpers.graphs import partition, random_graph
from .helpers.ranks import run_ranks

MiB = 2**20
FLOAT = 4  # bytes per float32 value

LAG_FIGURES = {"lag", "time_lag_wait"}  # in reports of --max-lag runs only


def _static(rank: int, inner: int, boundary: int, peak_mib: float, baseline_mib: float) -> dict:
    return {
        "rank": rank,
        "host": "h",
        "device": "cpu",
        "inner_nodes": inner,
        "boundary_nodes": boundary,
        "edges": 10 * inner,
        "peak_rss_bytes": int(peak_mib * MiB),
        "baseline_rss_bytes": int(baseline_mib * MiB),
    } | {key: inner * 1000 * (i + 1) for i, key in enumerate(HOLDERS)}


def _table(rows: list[dict]) -> torch.Tensor:
    """One epoch's table: float64 [ranks, len(COLUMNS)], the figures ``rows`` name, else 0."""
    table = torch.zeros(len(rows), len(COLUMNS), dtype=torch.float64)
    for r, values in enumerate(rows):
        for name, value in values.items():
            table[r, COLUMNS.index(name)] = value
    return table


def _per_epoch(rows: list[dict]) -> list[dict]:
    """Per-rank figures as a report of an older release holds them (no ``time_other``)."""
    return [dict.fromkeys(COLUMNS, 0.0) | values for values in rows]


def _hand_report(p: float = 1.0, scale: float = 1.0) -> dict:
    """Three ranks; rank 0 holds the most boundary nodes, memory and time."""
    static = [
        _static(0, 100, 150, 3 * scale, 0.5),
        _static(1, 200, 100, 1 * scale, 0.5),
        _static(2, 300, 30, 2 * scale, 0.5),
    ]
    rows = [
        {
            "sampled_boundary": 150 * p,
            "epoch_time": 2.0,
            "time_sampling": 0.1,
            "time_forward": 0.8,
            "time_exchange_forward": 0.3,
            "time_backward": 0.6,
            "time_exchange_backward": 0.2,
            "time_reduction": 0.1,
            "time_evaluation": 0.2,
            "time_idle": 0.05,
            "sent_features": 4000 * p,
            "sent_gradients": 2000 * p,
            "sent_reduction": 100,
            "received_features": 6000 * p,
            "saved_activation_bytes": 5 * MiB,
        },
        {
            "sampled_boundary": 100 * p,
            "epoch_time": 1.5,
            "time_sampling": 0.1,
            "time_exchange_selections": 0.2,
            "time_forward": 0.5,
            "time_backward": 0.5,
            "time_exchange_backward": 0.1,
            "time_idle": 0.5,
            "sent_features": 1000 * p,
            "received_features": 4000 * p,
            "saved_activation_bytes": 3 * MiB,
        },
        {
            "sampled_boundary": 30 * p,
            "epoch_time": 1.0,
            "time_forward": 0.4,
            "time_backward": 0.4,
            "time_idle": 1.0,
            "sent_selections": 30,
            "received_features": 1200 * p,
            "saved_activation_bytes": 1 * MiB,
        },
    ]
    info = {"config": {"model": "graphsage", "p": p}, "world_size": 3, "epochs": 4}
    return report.build(static, _per_epoch(rows), info)


def test_build_computes_spread_straggler_ratios_and_time_split():
    rep = _hand_report()
    ranks, summary = rep["ranks"], rep["summary"]
    assert [r["boundary_inner_ratio"] for r in ranks] == pytest.approx([1.5, 0.5, 0.1])
    ratio = summary["boundary_inner_ratio"]
    assert ratio["max"] == pytest.approx(1.5) and ratio["min"] == pytest.approx(0.1)
    assert ratio["mean"] == pytest.approx(0.7) and ratio["imbalance"] == pytest.approx(1.5 / 0.7)
    assert ratio["straggler"] == 0
    peak = summary["peak_memory_bytes"]
    assert (peak["max"], peak["mean"], peak["imbalance"], peak["straggler"]) == (3 * MiB, 2 * MiB, 1.5, 0)
    above = summary["memory_above_baseline_bytes"]
    assert (above["max"], above["min"], above["straggler"]) == (2.5 * MiB, 0.5 * MiB, 0)
    assert [r["bytes_sent"] for r in ranks] == [6100, 1000, 30]
    assert [r["bytes_received"] for r in ranks] == [6000, 4000, 1200]
    inner = summary["inner_nodes"]
    assert (inner["max"], inner["imbalance"], inner["straggler"]) == (300, 1.5, 2)
    # the slowest rank is the one that waits least
    assert summary["epoch_time"]["straggler"] == 0 and summary["time_idle"]["straggler"] == 2
    split = ranks[0]["time_split"]
    assert split["compute_forward"] == pytest.approx(0.5) and split["compute_backward"] == pytest.approx(0.4)
    assert split["other"] == pytest.approx(2.0 - (0.1 + 0.8 + 0.6 + 0.1 + 0.2))
    split = ranks[1]["time_split"]  # the selections' exchange is neither sampling nor compute
    assert (split["sampling"], split["exchange_selections"], split["compute_backward"]) == pytest.approx(
        (0.1, 0.2, 0.4)
    )
    assert split["other"] == pytest.approx(1.5 - (0.1 + 0.2 + 0.5 + 0.5))
    assert [r["time_exchange"] for r in ranks] == pytest.approx([0.5, 0.3, 0.0])
    for rank in ranks:  # the parts add up to the epoch plus the wait after it
        assert sum(rank["time_split"].values()) == pytest.approx(rank["epoch_time"] + rank["time_idle"])
    assert set(summary) == set(report.BALANCE) - LAG_FIGURES


def test_table_shows_every_rank_and_the_straggler():
    table = report.render_table(_hand_report())
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["figure", "rank", "0", "rank"]
    row = next(line for line in lines if line.startswith("boundary/inner"))
    assert row.split()[1:] == ["1.50", "0.50", "0.10", "1.50", "0.70", "0.10", "2.14", "rank", "0"]
    row = next(line for line in lines if line.startswith("peak memory (MiB)"))
    assert row.split()[3:6] == ["3.0", "1.0", "2.0"]
    # the holders of a rank's memory, each a row, in the order of bnsgcn.metrics.memory.HOLDERS
    holder_rows = [
        next(i for i, line in enumerate(lines) if line.startswith(f"{label} (MiB)")) for label in HOLDERS.values()
    ]
    assert holder_rows == sorted(holder_rows)


def test_compare_gives_changes_in_percent():
    text = report.compare([("full", _hand_report(1.0, scale=1.0)), ("sampled", _hand_report(0.1, scale=0.5))])
    rows = {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line.strip()) for line in text.splitlines()[2:])}
    assert rows["p"] == ["1.0", "0.1"]
    assert rows["peak memory (MiB)"] == ["3.0", "1.5 (-50%)"]
    assert rows["peak above process baseline (MiB)"] == ["2.5", "1.0 (-60%)"]
    assert rows["received/epoch (MiB)"][1].endswith("(-90%)")  # 6000 -> 600 bytes
    assert rows["boundary/inner"] == ["1.50", "1.50 (+0%)"]


def test_figures_are_pngs_or_a_hint(tmp_path, capsys):
    rep = _hand_report()
    if importlib.util.find_spec("matplotlib") is None:
        assert report.write_figures(rep, tmp_path) == []
        assert report.PLOTS_HINT in capsys.readouterr().err
        return
    paths = report.write_figures(rep, tmp_path)
    assert sorted(p.name for p in paths) == ["boundary.png", "memory.png", "time.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("*.tmp"))


def test_without_matplotlib_the_hint_comes_once(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    report._hint_plots.cache_clear()
    try:
        assert report.write_figures(_hand_report(), tmp_path) == []
        assert report.write_figures(_hand_report(), tmp_path) == []
        assert capsys.readouterr().err.count("pip install bnsgcn[plots]") == 1
        assert not list(tmp_path.iterdir())
    finally:
        report._hint_plots.cache_clear()


def test_the_cli_reads_runs_without_importing_torch(tmp_path):
    """``bnsgcn-report`` reads report.json: in a fresh interpreter, as the command starts,
    showing and comparing runs imports no torch (about 2 s)."""
    run = tmp_path / "run"
    run.mkdir()
    report.write(run, _hand_report(), figures=False)
    probe = (
        "import sys\n"
        "from bnsgcn.metrics import report\n"
        "assert report.main(sys.argv[1:2]) == 0 and report.main(sys.argv[1:3]) == 0\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(run), str(run)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "torch imported: False" and any(line.startswith("peak memory (MiB)") for line in lines), (
        done.stdout
    )


@pytest.mark.parametrize("content", [None, "{not json", '{"ranks": []}'])
def test_cli_bad_run_dir_is_one_line_exit_2(tmp_path, capsys, content):
    run = tmp_path / "run"
    run.mkdir()
    if content is not None:
        (run / report.REPORT_NAME).write_text(content)
    assert report.main([str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and str(run) in err


def test_two_rank_run_writes_a_complete_report_with_bytes_computable_by_hand(tmp_path, capsys):
    features, hidden, classes, epochs = 8, 16, 3, 2
    graph = random_graph(num_nodes=80, avg_degree=4, features=features, classes=classes, seed=5)
    parts = partition(graph, 2, tmp_path / "parts", method="random")

    def config(p: float) -> TrainConfig:
        return TrainConfig.from_settings(
            parts_dir=parts,
            p=p,
            model="graphsage",
            layers=2,
            hidden=hidden,
            dropout=0.0,
            epochs=epochs,
            eval_every=0,
            precompute=False,
            device="cpu",
            out=tmp_path / f"p{p}",
            seed=1,
        )

    run_ranks(2, [config(1.0), config(0.5)])
    # Layer 1 (F=8 -> H=16) aggregates first and sends F columns; layer 2 (H=16 -> C=3)
    # multiplies first and sends C columns. Only layer 2's rows need a gradient (the input
    # features do not), C columns back. Evaluation (last epoch only) moves all rows once.
    width_forward, width_backward = features + classes, classes
    arrays = [load_partition(parts, r) for r in range(2)]
    boundary = [len(a["boundary_nodes"]) for a in arrays]
    requested = [len(a["send_nodes"]) for a in arrays]  # rows other ranks may ask of me
    assert sum(boundary) == sum(requested) > 0

    full = report.load(tmp_path / "p1.0")
    assert set(full["summary"]) >= set(report.BALANCE) - {"memory_above_baseline_bytes"} - LAG_FIGURES
    assert not LAG_FIGURES & set(full["summary"])  # shown for --max-lag runs only (tests/test_lag.py)
    assert full["info"]["world_size"] == 2 and full["info"]["epochs"] == epochs
    assert full["info"]["steady_state"] == {"epochs_run": 2, "warmup_epochs_left_out": 1, "median_over_epochs": 1}
    assert all(
        rank["peak_cuda_allocated_bytes"] is None and rank["peak_rss_bytes"] > 0 for rank in full["ranks"]
    )  # CPU: not measured
    for r, rank in enumerate(full["ranks"]):
        e = rank["per_epoch"]
        assert (
            rank["rank"] == r
            and rank["inner_nodes"] == len(arrays[r]["inner_nodes"])
            and rank["boundary_nodes"] == boundary[r]
        )
        assert rank["boundary_inner_ratio"] == pytest.approx(boundary[r] / rank["inner_nodes"])
        assert e["sampled_boundary"] == boundary[r]
        assert e["received_features"] == boundary[r] * width_forward * FLOAT
        assert e["sent_features"] == requested[r] * width_forward * FLOAT
        assert e["sent_gradients"] == boundary[r] * width_backward * FLOAT
        assert e["received_gradients"] == requested[r] * width_backward * FLOAT
        assert e["sent_selections"] == 0  # at p = 1 everybody knows the plan
        # the median of the steady epochs: the first is left out as warm-up, the second evaluates
        assert e["sent_evaluation"] == requested[r] * width_forward * FLOAT
        assert rank["peak_memory_bytes"] > rank["partition_bytes"] > 0 and e["saved_activation_bytes"] > 0
        # the holders, by hand: GraphSAGE's inner and boundary adjacency hold per entry a
        # column id, a row id and an entry id (int32) and nothing else: the mean is one
        # float32 row scale 1/deg [n_inner], shared; int64 row pointers forward and
        # transposed (the boundary one also its entries per column)
        n, nb, nnz = rank["inner_nodes"], rank["boundary_nodes"], rank["edges"]
        assert rank["adjacency_bytes"] == 12 * nnz + 4 * n + 8 * (3 * (n + 1) + (nb + 1) + nb)
        params = [p.numel() for p in _sage_parameters(features, hidden, classes)]
        assert rank["parameter_bytes"] == 2 * FLOAT * sum(params)  # values and gradients
        assert rank["optimizer_state_bytes"] == 2 * FLOAT * sum(params) + FLOAT * len(
            params
        )  # Adam: two moments and a step each
        assert rank["precomputed_bytes"] == 0 and rank["exchange_buffer_bytes"] > 0
        assert sum(rank["time_split"].values()) == pytest.approx(rank["epoch_time"] + rank["time_idle"])
    total_features = sum(r["per_epoch"]["sent_features"] for r in full["ranks"])
    assert total_features == sum(boundary) * width_forward * FLOAT

    sampled = report.load(tmp_path / "p0.5")
    for r, rank in enumerate(sampled["ranks"]):
        e = rank["per_epoch"]
        assert 0 < e["sampled_boundary"] < boundary[r]
        assert e["received_features"] == pytest.approx(e["sampled_boundary"] * width_forward * FLOAT)
        assert e["sent_gradients"] == pytest.approx(e["sampled_boundary"] * width_backward * FLOAT)
        assert e["sent_selections"] == -(-boundary[r] // 8)  # one bit per boundary node to its owner
        assert e["received_selections"] == -(-requested[r] // 8)

    table = report.render_table(full)
    assert "rank 1" in table and "straggler" in table and f"{boundary[0]}" in table
    capsys.readouterr()
    assert report.main([str(tmp_path / "p1.0"), str(tmp_path / "p0.5"), "--figures"]) == 0
    out = capsys.readouterr().out
    received = next(line for line in out.splitlines() if line.startswith("received/epoch"))
    assert received.count("%") == 1 and "(-" in received
    assert str(tmp_path / "p0.5") in out.splitlines()[0]
    drawn = (tmp_path / "p0.5" / "time.png").is_file() and (tmp_path / "p1.0" / "memory.png").is_file()
    assert drawn == (importlib.util.find_spec("matplotlib") is not None)


def _sage_parameters(features: int, hidden: int, classes: int) -> list[torch.Tensor]:
    """The parameters of a 2-layer GraphSAGE with layer norm between the layers."""
    shapes = [
        (hidden, features),
        (hidden,),
        (hidden, features),
        (hidden,),
        (hidden,),
        (classes, hidden),
        (classes,),
        (classes, hidden),
    ]
    return [torch.empty(s) for s in shapes]


def _cuda_report() -> dict:
    """Two CUDA ranks: device peaks next to host resident sets."""
    static = [_static(0, 100, 50, 900, 400), _static(1, 100, 60, 800, 400)]
    for r, (allocated, reserved) in enumerate(((3 * MiB, 4 * MiB), (1 * MiB, 2 * MiB))):
        static[r] |= {
            "device": f"cuda:{r}",
            "peak_cuda_allocated_bytes": allocated,
            "peak_cuda_reserved_bytes": reserved,
        }
    rows = [{"epoch_time": 1.0, "time_forward": 0.5, "time_backward": 0.4}] * 2
    return report.build(static, _per_epoch(rows), {"config": {"model": "gat", "p": 1.0}, "world_size": 2})


def test_device_memory_next_to_host_memory_and_absent_on_cpu(tmp_path):
    cuda, cpu = _cuda_report(), _hand_report()
    assert [r["peak_memory_bytes"] for r in cuda["ranks"]] == [3 * MiB, 1 * MiB]  # the device's allocated peak
    assert (
        cuda["summary"]["peak_cuda_reserved_bytes"]["max"] == 4 * MiB
        and cuda["summary"]["peak_rss_bytes"]["max"] == 900 * MiB
    )
    rows = {line.split("  ")[0]: line.split()[-8:] for line in report.render_table(cuda).splitlines()}
    assert rows["peak device allocated (MiB)"][:2] == ["3.0", "1.0"] and rows["peak device reserved (MiB)"][:2] == [
        "4.0",
        "2.0",
    ]
    assert rows["peak host RSS (MiB)"][:2] == ["900.0", "800.0"]
    # CPU: measured on no rank, so null in the JSON and "-" in the table, not 0
    assert all(r["peak_cuda_allocated_bytes"] is None and r["peak_cuda_reserved_bytes"] is None for r in cpu["ranks"])
    assert cpu["summary"]["peak_cuda_allocated_bytes"] is None
    assert [r["peak_memory_bytes"] for r in cpu["ranks"]] == [3 * MiB, 1 * MiB, 2 * MiB]  # the resident set
    row = next(line for line in report.render_table(cpu).splitlines() if line.startswith("peak device reserved"))
    assert row.split()[4:] == ["-"] * 8
    assert "peak device" not in report.compare([("cpu", cpu), ("cuda", cuda)])  # nothing to compare against
    report.write(tmp_path, cuda, figures=False)
    assert report.load(tmp_path)["ranks"][0]["peak_cuda_reserved_bytes"] == 4 * MiB
    if importlib.util.find_spec("matplotlib") is not None:
        assert len(report.write_figures(cuda, tmp_path)) == 3 and len(report.write_figures(cpu, tmp_path)) == 3


def test_per_epoch_figures_are_steady_state_medians():
    """Warm-up epochs (kernel compilation) are left out; the median of the rest is reported."""

    def epochs(times: list[float]) -> list[torch.Tensor]:
        return [_table([{"epoch_time": t, "time_sampling": t / 10}, {"epoch_time": 2 * t}]) for t in times]

    medians, steady = report.steady_state(epochs([9.0, 5.0, 1.0, 3.0, 2.0, 100.0]), COLUMNS)
    assert steady == {"epochs_run": 6, "warmup_epochs_left_out": 2, "median_over_epochs": 4}
    assert [m["epoch_time"] for m in medians] == pytest.approx(
        [2.5, 5.0]
    )  # median of 1, 3, 2, 100 (not the mean, 20.4)
    assert medians[0]["time_sampling"] == pytest.approx(0.25)
    assert report.steady_state(epochs([9.0, 1.0]), COLUMNS)[1]["warmup_epochs_left_out"] == 1
    medians, steady = report.steady_state(epochs([9.0]), COLUMNS)
    assert steady["warmup_epochs_left_out"] == 0 and medians[0]["epoch_time"] == 9.0
    rep = report.build([_static(0, 1, 1, 1, 1), _static(1, 1, 1, 1, 1)], medians, {"steady_state": steady})
    assert (
        report.render_table(rep).splitlines()[-1]
        == "per-epoch figures: medians over 1 of 1 epochs run, the first 0 left out as warm-up (kernel compilation, "
        "allocator)"
    )
    rep["info"]["steady_state"] = report.steady_state(epochs([9.0, 5.0, 1.0]), COLUMNS)[1]
    assert "medians over 1 of 3 epochs run, the first 2 left out" in report.render_table(rep)


def test_other_time_is_each_epochs_remainder_then_its_median():
    """'other' is what each epoch holds beyond its measured parts, its median over the steady
    epochs: a last epoch that also evaluates, or slow epochs, move it no more than any other
    figure (the median epoch less the parts' medians would take 2.1 here)."""

    def epoch(forward: float, backward: float, evaluation: float = 0.0) -> torch.Tensor:
        row = {
            "time_forward": forward,
            "time_backward": backward,
            "time_evaluation": evaluation,
            "epoch_time": forward + backward + evaluation + 0.1,
        }  # 0.1 s beyond the parts: the optimizer step
        return _table([row])

    # warm-up, warm-up, then fast, slow, fast, slow, and a last epoch that evaluates
    tables = [epoch(5, 5), epoch(5, 5), epoch(1, 1), epoch(2, 2), epoch(1, 1), epoch(2, 2), epoch(1, 1, evaluation=3)]
    (medians,), _ = report.steady_state(tables, COLUMNS)
    expected = sorted(
        float(
            t[0, COLUMNS.index("epoch_time")]
            - sum(t[0, COLUMNS.index(c)] for c in ("time_forward", "time_backward", "time_evaluation"))
        )
        for t in tables[2:]
    )
    assert medians["time_other"] == pytest.approx(expected[len(expected) // 2]) == pytest.approx(0.1)
    split = report.build([_static(0, 1, 1, 1, 1)], [medians], {})["ranks"][0]["time_split"]
    assert split["other"] == pytest.approx(0.1)
    assert split["compute_forward"] + split["compute_backward"] + split["other"] == pytest.approx(1 + 1 + 0.1)
    # a report written before the per-epoch figure: the median epoch less the parts' medians
    older = dict(medians)
    del older["time_other"]
    assert report.time_split(older)["other"] == pytest.approx(medians["epoch_time"] - 1 - 1)


# --- comparisons: scores, wall time and time to a target, from metrics.jsonl ---------------------


def _epoch_line(epoch: int, elapsed: float | None, val: float | None = None, test: float | None = None) -> dict:
    """One epoch's record as metrics.jsonl holds it (the figures the report reads)."""
    time = {"epoch": 1.0} | ({} if elapsed is None else {"elapsed": elapsed})
    scores = {} if val is None else {"train_score": 1.0, "val_score": val, "test_score": test}
    return {"epoch": epoch, "loss": 1.0, "time": time} | scores


def _saved_run(directory, p: float, lines: list[dict] | None):
    """A run directory: report.json of :func:`_hand_report`, and metrics.jsonl of ``lines``."""
    directory.mkdir()
    report.write(directory, _hand_report(p), figures=False)
    if lines is not None:
        (directory / report.METRICS_NAME).write_text("".join(json.dumps(line) + "\n" for line in lines))
    return directory


def _rows(text: str) -> dict[str, list[str]]:
    return {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line.strip()) for line in text.splitlines()[2:])}


def _two_runs(tmp_path):
    slow = [_epoch_line(e, float(e), *({2: (0.5, 0.45), 4: (0.8, 0.75)}.get(e, (None, None)))) for e in range(1, 5)]
    slow.append({"summary": True, "best_val_score": 0.8, "best_epoch": 4, "test_score": 0.75})
    fast = [_epoch_line(e, e / 2, *({2: (0.85, 0.83), 4: (0.9, 0.88)}.get(e, (None, None)))) for e in range(1, 5)]
    fast.append({"summary": True, "best_val_score": 0.9, "best_epoch": 4, "test_score": 0.88})
    return _saved_run(tmp_path / "full", 1.0, slow), _saved_run(tmp_path / "sampled", 0.1, fast)


def test_compare_shows_scores_wall_time_and_time_to_a_target(tmp_path, capsys):
    full, sampled = _two_runs(tmp_path)
    capsys.readouterr()
    assert report.main([str(full), str(sampled), "--target-accuracy", "0.8"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows["best val score"] == ["0.8000 at epoch 4", "0.9000 at epoch 4"]
    assert rows["test score at best val"] == ["0.7500", "0.8800"]
    assert rows["time to val >= 0.8 (s)"] == ["4.000 at epoch 4", "1.000 at epoch 2 (-75%)"]
    assert rows["training wall time (s)"] == ["4.000", "2.000 (-50%)"]
    assert rows["peak memory (MiB)"] == ["3.0", "3.0 (+0%)"]  # the figures stay


def test_a_target_not_reached_says_so(tmp_path, capsys):
    full, sampled = _two_runs(tmp_path)
    capsys.readouterr()
    assert report.main([str(full), str(sampled), "--target-accuracy", "0.85"]) == 0
    out = capsys.readouterr().out
    assert _rows(out)["time to val >= 0.85 (s)"] == ["not reached", "1.000 at epoch 2"]
    assert "not reached: no evaluated epoch got there" in out
    assert report.main([str(sampled), "--target-accuracy", "0.95"]) == 0  # one run: the lines under its table
    out = capsys.readouterr().out
    assert "time to val >= 0.95: not reached" in out and "best val score 0.9000 at epoch 4, test 0.8800" in out


def test_compare_without_a_target_or_metrics_shows_what_is_known(tmp_path, capsys):
    full, _ = _two_runs(tmp_path)
    bare = _saved_run(tmp_path / "bare", 0.5, None)
    capsys.readouterr()
    assert report.main([str(full), str(bare)]) == 0
    rows = _rows(capsys.readouterr().out)
    assert not any(label.startswith("time to val") for label in rows)
    assert rows["best val score"] == ["0.8000 at epoch 4", "-"]
    assert rows["training wall time (s)"] == ["4.000", "-"]


def test_outcome_of_a_resumed_unfinished_run_adds_up_its_parts(tmp_path):
    # epochs 1-3, then a resumed process whose clock starts again at epoch 4; no summary line
    lines = [_epoch_line(1, 1.0), _epoch_line(2, 2.0, 0.6, 0.5), _epoch_line(3, 3.0)]
    lines += [_epoch_line(4, 1.5, 0.7, 0.65), _epoch_line(5, 2.5, 0.7, 0.6)]
    outcome = report.load_outcome(_saved_run(tmp_path / "resumed", 1.0, lines))
    assert outcome["wall_s"] == 5.5
    assert (outcome["best_val_score"], outcome["best_epoch"], outcome["test_score"]) == (0.7, 4, 0.65)
    assert report.time_to(outcome, 0.7) == (4, 4.5)
    assert report.time_to(outcome, 0.71) is None
    older = report.load_outcome(_saved_run(tmp_path / "older", 1.0, [_epoch_line(e, None) for e in (1, 2, 3)]))
    assert older["wall_s"] == 3.0 and older["best_val_score"] is None  # no elapsed: the epochs' times add up


def test_a_damaged_metrics_file_is_one_line(tmp_path, capsys):
    run = _saved_run(tmp_path / "run", 1.0, [_epoch_line(1, 1.0)])
    with (run / report.METRICS_NAME).open("a") as f:
        f.write("{not json\n")
    capsys.readouterr()
    assert report.main([str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{run / report.METRICS_NAME}:2 is not a bnsgcn metrics record" in err


def test_table_names_the_device_of_every_rank():
    """A row under the header: each rank's device, the same GPU for ranks that shared it."""
    assert report.render_table(_cuda_report()).splitlines()[2].split() == ["device", "cuda:0", "cuda:1"]
    shared = _cuda_report()
    for rank in shared["ranks"]:
        rank["device"] = "cuda:0"  # two ranks on one GPU (--ranks-per-gpu 2)
    assert report.render_table(shared).splitlines()[2].split() == ["device", "cuda:0", "cuda:0"]
    assert report.render_table(_hand_report()).splitlines()[2].split() == ["device", "cpu", "cpu", "cpu"]
