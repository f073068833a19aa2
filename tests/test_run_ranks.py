"""The test helper that runs ranks: each rank sees the test's environment at the call."""

from __future__ import annotations

import torch

from bnsgcn.config import TrainConfig
from bnsgcn.kernels.backend import ENV_VAR, kernel_backend

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
