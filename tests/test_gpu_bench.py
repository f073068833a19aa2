"""benchmarks/gpu.py end to end on the CPU (``--device cpu --quick``): every step runs and
writes what the GPU session will read; no number here is a GPU measurement."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu", *args], cwd=REPO, capture_output=True, text=True, timeout=240)


def test_quick_cpu_run_writes_every_measurement(tmp_path):
    pyg = importlib.util.find_spec("torch_geometric") is not None
    done = _bench("--device", "cpu", "--quick", "--threads", "1", "--work", str(tmp_path / "work"), "--results", str(tmp_path), *([] if pyg else ["--skip-pyg"]))
    assert done.returncode == 0, done.stderr[-2000:]
    document = json.loads((tmp_path / "gpu-quick.json").read_text())
    assert document["machine"]["device"] == "cpu" and document["machine"]["copy_bandwidth_gb_s"] > 0
    assert document["graphs"]["quick"]["error"] is None
    runs = {(r["model"], r["impl"], r.get("variant")): r for r in document["runs"]}
    expected = {("graphsage", "bnsgcn", None), ("gat", "bnsgcn", None)}
    if pyg:
        expected |= {("graphsage", "pyg", "edge_index"), ("graphsage", "pyg", "csr"), ("gat", "pyg", "edge_index")}
    assert set(runs) == expected
    for key, run in runs.items():
        assert "error" not in run, (key, run.get("error"))
        assert run["epoch_time_s"] > 0 and len(run["epoch_times_s"]) == 4, key
        assert run.get("peak_device_allocated_bytes") is None and run["peak_rss_bytes"] > 0, key  # CPU: no device figure
    products = {(r["product"], r["width"]) for r in document["spmm"]}
    assert products == {(p, w) for p in ("A X", "A^T Y") for w in (16, 128)}
    for row in document["spmm"]:
        assert row["seconds"] > 0 and row["bytes_compulsory"] < row["bytes_gathered"]
        assert row["fraction_of_copy_bandwidth"] == pytest.approx(row["bytes_compulsory"] / row["seconds"] / (document["machine"]["copy_bandwidth_gb_s"] * 1e9))
    table = (tmp_path / "gpu-quick.md").read_text()
    assert "| quick | graphsage | bnsgcn |" in table and "| quick | A X | 128 |" in table and "Device: cpu" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cuda_without_a_gpu_is_one_line():
    done = _bench("--device", "cuda")
    assert done.returncode == 2 and done.stderr.strip().splitlines() == ["error: no CUDA GPU visible; pass --device cpu --quick to check the script on the CPU"]
