"""The test helper that runs ranks: each rank sees the test's environment at the call."""

from __future__ import annotations

import json

import torch

from bnsgcn.config import TrainConfig
from bnsgcn.kernels.backend import ENV_VAR, kernel_backend

from .helpers.cli import train_on, train_without_numba
from .helpers.graphs import partition, random_graph
from .helpers.ranks import run_ranks


def kernels_in_use():
    """Instrument: the CPU kernel backend the rank resolves (from ``BNSGCN_KERNELS``)."""
    return lambda: kernel_backend(torch.device("cpu")).__name__.rsplit(".", 1)[-1]


def test_each_call_passes_the_tests_current_environment(tmp_path, monkeypatch):
    """Ranks are forked from a server started by an earlier call: a variable the test sets
    afterwards must still reach them (tests choose kernels this way)."""
    parts = partition(random_graph(), 2, tmp_path / "parts")
    config = dict(parts_dir=parts, layers=2, hidden=4, epochs=1, seed=0, device="cpu")
    monkeypatch.setenv(ENV_VAR, "numba")
    before = run_ranks(2, [TrainConfig.from_settings(**config, out=tmp_path / "numba")], instrument=kernels_in_use)
    monkeypatch.setenv(ENV_VAR, "torch")
    after = run_ranks(2, [TrainConfig.from_settings(**config, out=tmp_path / "torch")], instrument=kernels_in_use)
    assert [rank[0]["instrumented"] for rank in before + after] == ["numba_backend"] * 2 + ["torch_backend"] * 2


def test_a_job_on_the_torch_kernels_never_imports_numba(tmp_path):
    """What a GPU job runs on (the torch kernels, as BNSGCN_KERNELS=torch selects on the CPU):
    launcher, ranks, exchange and report, with any import of numba failing. numba is for the
    CPU kernels alone: a GPU job neither imports it nor compiles them (tests/test_gpu.py runs
    the same on CUDA)."""
    parts = partition(random_graph(), 2, tmp_path / "parts")
    run_dir = tmp_path / "run"
    done = train_without_numba(train_on(parts, run_dir, "--p", "0.5", "--compress", "int8"), tmp_path, "torch")
    assert done.code == 0, done.stderr[-3000:]
    assert json.loads((run_dir / "report.json").read_text())["ranks"]
