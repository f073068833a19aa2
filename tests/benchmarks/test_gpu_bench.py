"""benchmarks/gpu.py end to end on the CPU (``--device cpu --quick``): every step runs and
writes what a run on a GPU machine reads; no number here is a GPU measurement."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from ..helpers import REPO, kernels


def _bench(*args: str) -> subprocess.CompletedProcess:
    kernels.compiled()
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", *args], cwd=REPO, capture_output=True, text=True, timeout=240
    )


def test_quick_cpu_run_writes_every_measurement(tmp_path):
    """Every precision and rank count of GraphSAGE (two ranks at p = 0.5, one at p = 1 alone),
    its PyG paths, the products and a profile; GAT's profile in this process (a run of the
    engine per model and combination costs seconds each: tests/test_precision.py trains GAT
    at bf16)."""
    pyg = importlib.util.find_spec("torch_geometric") is not None
    done = _bench(
        "--device",
        "cpu",
        "--quick",
        "--threads",
        "1",
        "--work",
        str(tmp_path / "work"),
        "--results",
        str(tmp_path),
        "--models",
        "graphsage",
        "--ranks",
        "1,2",
        "--precision",
        "fp32,bf16",
        "--p",
        "0.5",
        *([] if pyg else ["--skip-pyg"]),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    document = json.loads((tmp_path / "gpu-quick.json").read_text())
    assert document["machine"]["device"] == "cpu" and document["machine"]["copy_bandwidth_gb_s"] > 0
    assert document["graphs"]["quick"]["error"] is None
    runs = {
        (r["model"], r["impl"], r.get("variant"), r["precision"], r["ranks"], r.get("p", 1.0)): r
        for r in document["runs"]
    }
    precisions = ("fp32", "bf16")
    expected = {("graphsage", "bnsgcn", None, p, n, rate) for p in precisions for n, rate in ((1, 1.0), (2, 0.5))}
    if pyg:
        expected |= {("graphsage", "pyg", v, p, 1, 1.0) for v in ("edge_index", "csr") for p in precisions}
    assert set(runs) == expected and len(document["runs"]) == len(expected)
    for key, run in runs.items():
        if run.get("unsupported_precision"):  # PyG's path has no kernel at this precision: said so
            assert key[1] == "pyg" and key[3] != "fp32" and run["error"], key
            continue
        assert "error" not in run, (key, run.get("error"))
        assert run["epoch_time_s"] > 0 and len(run["epoch_times_s"]) == 3, key
        assert run.get("peak_device_allocated_bytes") is None and run["peak_rss_bytes"] > 0, (
            key
        )  # CPU: no device figure
        if run["impl"] == "bnsgcn":  # each rank's peak, the largest the run's
            assert len(run["per_rank_peak_rss_bytes"]) == key[4], key
            assert run["peak_rss_bytes"] == max(run["per_rank_peak_rss_bytes"]), key
            assert f"--precision {key[3]}" in run["command"] and f"--procs {key[4]}" in run["command"], key
            assert f"--p {key[5]:g} " in run["command"], key
    products = {(r["product"], r["width"]) for r in document["spmm"]}
    assert products == {(p, w) for p in ("A X", "A^T Y") for w in (16, 128)}
    for row in document["spmm"]:
        assert row["seconds"] > 0 and row["bytes_compulsory"] < row["bytes_gathered"]
        assert row["fraction_of_copy_bandwidth"] == pytest.approx(
            row["bytes_compulsory"] / row["seconds"] / (document["machine"]["copy_bandwidth_gb_s"] * 1e9)
        )
    from benchmarks.gpu import profile_aggregation, whole_graph_adjacency

    profiles = {r["model"]: r for r in document["profiles"]}
    assert set(profiles) == {"graphsage"}
    cpu = torch.device("cpu")
    profiles["gat"] = profile_aggregation(whole_graph_adjacency(tmp_path / "work" / "parts-quick", cpu), cpu, "gat")
    for model, profile in profiles.items():
        assert profile["clock"] == "host" and profile["ms_per_call"] > 0 and profile["ops"], model
        assert sum(op["ms_per_call"] for op in profile["ops"]) <= profile["ms_per_call"] * (1 + 1e-9), model
    table = (tmp_path / "gpu-quick.md").read_text()
    assert "quick, graphsage: one layer's aggregation" in table
    assert "| quick | graphsage | bnsgcn | bf16 | 2 | 0.5 |" in table and "| quick | A X | 128 |" in table
    assert "Device: cpu" in table


def test_bad_ranks_precisions_and_rates_are_one_line(tmp_path, capsys):
    from benchmarks.gpu import main

    for flags, line in (
        (("--precision", "fp8"), "error: unknown --precision 'fp8'; choose from fp32, tf32, bf16, comma-separated"),
        (("--ranks", "0,2"), "error: --ranks 0,2 is not a list of positive rank counts; pass e.g. --ranks 1,2,4"),
        (("--p", "1,2"), "error: --p 1,2 is not a list of sampling rates in [0, 1]; pass e.g. --p 1,0.1"),
    ):
        assert main(["--device", "cpu", "--quick", "--results", str(tmp_path), *flags]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [line]
    assert not list(tmp_path.iterdir())  # refused before anything was written


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cuda_without_a_gpu_is_one_line():
    done = _bench("--device", "cuda")
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "error: no CUDA GPU visible; pass --device cpu --quick to check the script on the CPU"
    ]


def test_every_measurement_is_saved_and_later_calls_merge(tmp_path):
    """A call writes its results after each measurement; a later call replaces what it measured
    again, keeps the rest, and keeps the description of a partition set it reused."""
    from benchmarks.gpu import save

    machine = {"device": "cuda", "device_name": "GPU", "torch": "x", "copy_bandwidth_gb_s": 1000.0}

    def run(model: str, seconds: float) -> dict:
        return {"graph": "reference", "model": model, "impl": "bnsgcn", "epoch_time_s": seconds}

    first = {
        "machine": machine,
        "graphs": {"reference": {"source": "make_reference_graph.py", "error": None}},
        "runs": [run("graphsage", 1.0)],
        "spmm": [],
    }
    save(tmp_path, "gpu", first)
    assert [r["epoch_time_s"] for r in json.loads((tmp_path / "gpu.json").read_text())["runs"]] == [1.0]
    second = {
        "machine": machine,
        "graphs": {"reference": {"source": "reused", "error": None}},
        "runs": [run("gat", 3.0), run("graphsage", 2.0)],
        "spmm": [],
    }
    save(tmp_path, "gpu", second)
    document = json.loads((tmp_path / "gpu.json").read_text())
    assert document["graphs"]["reference"]["source"] == "make_reference_graph.py"
    assert sorted((r["model"], r["epoch_time_s"]) for r in document["runs"]) == [("gat", 3.0), ("graphsage", 2.0)]
    assert "| reference | gat | bnsgcn | fp32 | 1 | 1 | 3.0000 |" in (tmp_path / "gpu.md").read_text()
    # another precision, rank count or p is another record, kept beside the first
    save(tmp_path, "gpu", second | {"runs": [run("gat", 1.5) | {"precision": "bf16", "ranks": 2, "p": 0.1}]})
    document = json.loads((tmp_path / "gpu.json").read_text())
    assert sorted((r["model"], r.get("precision", "fp32"), r["epoch_time_s"]) for r in document["runs"]) == [
        ("gat", "bf16", 1.5),
        ("gat", "fp32", 3.0),
        ("graphsage", "fp32", 2.0),
    ]
    assert "| reference | gat | bnsgcn | bf16 | 2 | 0.1 | 1.5000 |" in (tmp_path / "gpu.md").read_text()
