"""Compressed boundary messages: the wire formats against bounds derived here, and training
with them against training without."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from bnsgcn.comm.wire import FORMATS, WireFormat, dequantize, quantize
from bnsgcn.config import TrainConfig
from bnsgcn.kernels import ENV_VAR

from .helpers.graphs import partition, random_graph
from .helpers.ranks import run_ranks


def _step_bound(x: torch.Tensor, bits: int) -> torch.Tensor:
    """An upper bound of each row's quantisation step: the row's range, widened by rounding
    its lower end down to bfloat16 (8 significant bits: at most |min| 2^-7), divided into
    2^b - 1 steps, and the step rounded up to bfloat16 (at most a factor 1 + 2^-7)."""
    lo, hi = x.amin(1), x.amax(1)
    return ((hi - lo) + lo.abs() * 2**-7) / ((1 << bits) - 1) * (1 + 2**-7) + 1e-30


@pytest.fixture(params=["numba", "torch"])
def kernels(request, monkeypatch):
    """Run the test with each CPU kernel backend (the codes come from either)."""
    monkeypatch.setenv(ENV_VAR, request.param)
    return request.param


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_is_unbiased_within_one_step(bits, kernels):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(6, 37, generator=generator) * torch.tensor(
        [[1e-6], [1.0], [30.0], [1.0], [5.0], [0.1]]
    ) + torch.tensor([[0.0], [0.0], [-7.0], [100.0], [0.0], [3.0]])
    step = _step_bound(x, bits)[:, None]
    draws = 4000
    total = torch.zeros_like(x, dtype=torch.float64)
    for _ in range(draws):
        decoded = dequantize(quantize(x, bits, generator), x.shape[1], bits)
        assert ((decoded - x).abs() < step).all()  # below one step, every draw
        total += decoded
    # A draw is one of the two grid points around x: variance <= step^2 / 4, so the mean of
    # the draws is within 6 standard deviations, step / (2 sqrt(draws)) each, of x.
    assert ((total / draws - x).abs() <= 6 * step / (2 * math.sqrt(draws)) + 1e-6 * x.abs()).all()


@pytest.mark.parametrize("name", ["int8", "int4", "fp16", "bf16"])
@pytest.mark.parametrize("row", [(1,), (5,), (33,), (3, 7), (0,)])
def test_round_trip_of_any_row_shape(name, row, kernels):
    wire = WireFormat(name)
    x = torch.randn(11, *row, generator=torch.Generator().manual_seed(len(row) * 100 + math.prod(row)))
    x[0] = 0.25  # a constant row
    x[1] = 3e-6  # fp16 subnormal
    out = torch.empty((11, *wire.wire_shape(row)), dtype=wire.wire_dtype(torch.float32))
    decoded = wire.decode(wire.encode(x, out), row, torch.float32)
    assert decoded.shape == x.shape and decoded.dtype == torch.float32
    flat, back = x.reshape(11, -1), decoded.reshape(11, -1)
    if name in ("int8", "int4"):
        bits = 8 if name == "int8" else 4
        assert out.shape[1] == (math.prod(row) if bits == 8 else (math.prod(row) + 1) // 2) + 4
        if flat.shape[1]:
            assert ((back - flat).abs() < _step_bound(flat, bits)[:, None]).all()
            assert torch.equal(back[0], flat[0])  # a constant row has a zero step
    else:
        # half a unit in the last place; fp16 below 2^-14 is subnormal, spaced 2^-24 apart
        relative, absolute = (2**-11, 2**-25) if name == "fp16" else (2**-8, 0.0)
        assert ((back - flat).abs() <= flat.abs() * relative + absolute).all()


def _records(run_dir) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_training_with_compressed_messages(tmp_path):
    """p = 1, no dropout: fp16 and int8 follow the exact run closely, int4 loosely; wire
    bytes of features shrink by the row sizes; evaluation stays exact; the same seed gives
    the same run; hierarchical exchange relays compressed rows."""
    parts = partition(random_graph(num_nodes=160, avg_degree=6, seed=9), 4, tmp_path / "parts")
    base = dict(
        parts_dir=parts,
        p=1.0,
        model="graphsage",
        layers=2,
        hidden=8,
        epochs=4,
        eval_every=1,
        precompute=False,
        dropout=0.0,
        seed=2,
    )
    runs = {
        "none": dict(),
        "fp16": dict(compress="fp16"),
        "int8": dict(compress="int8"),
        "int8-again": dict(compress="int8"),
        "int4": dict(compress="int4", compress_grad="none"),
        "int8-hier": dict(compress="int8", exchange="hierarchical"),
    }
    configs = [TrainConfig.from_settings(**base, **extra, out=tmp_path / name) for name, extra in runs.items()]
    run_ranks(4, configs, nodes=[0, 0, 1, 1])
    records = {name: _records(tmp_path / name) for name in runs}
    exact = [r["loss"] for r in records["none"]]
    for name, tolerance in (("fp16", 1e-3), ("int8", 1e-2), ("int8-hier", 1e-2), ("int4", 5e-2)):
        assert [r["loss"] for r in records[name]] == pytest.approx(exact, rel=tolerance), name
    assert [r["loss"] for r in records["int8"]] != exact  # the rounding is there
    assert [r["loss"] for r in records["int8-again"]] == [r["loss"] for r in records["int8"]]  # same seed, same run
    # features: 8 then 3 columns per row (aggregate first, then multiply first)
    widths = (8, 3)
    feature_bytes = lambda name: records[name][0]["bytes_sent_by_kind"]["features"]  # noqa: E731
    rows = feature_bytes("none") / (4 * sum(widths))
    assert feature_bytes("fp16") == rows * 2 * sum(widths)
    assert feature_bytes("int8") == rows * sum(w + 4 for w in widths)
    assert feature_bytes("int4") == rows * sum((w + 1) // 2 + 4 for w in widths)
    assert (
        records["int4"][0]["bytes_sent_by_kind"]["gradients"] == records["none"][0]["bytes_sent_by_kind"]["gradients"]
    )
    for name in runs:  # evaluation rows travel exact
        assert (
            records[name][0]["bytes_sent_by_kind"]["evaluation"]
            == records["none"][0]["bytes_sent_by_kind"]["evaluation"]
        )
    resolved = json.loads((tmp_path / "int8" / "config.json").read_text())
    assert (resolved["compress"], resolved["compress_grad"]) == ("int8", "int8")


@pytest.mark.parametrize("flag", ["--compress", "--compress-grad"])
def test_unknown_wire_format_is_one_line_error(tmp_path, flag):
    done = subprocess.run(
        [sys.executable, "-m", "bnsgcn.launch.cli", "--parts-dir", str(tmp_path), flag, "int3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: unknown wire format {flag} int3; choose from {', '.join(FORMATS)}"
    ]


def test_gradients_of_compressed_rows_reach_their_owners():
    """One rank: the exchange's backward decodes what its forward's sender receives."""
    from bnsgcn.comm.communicator import Comm
    from bnsgcn.comm.plan import ExchangePlan
    from bnsgcn.exchange.synchronous import BoundaryExchange

    comm = Comm(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), timeout=1.0)
    plan = ExchangePlan(torch.tensor([2, 0, 2]), [3], [3])
    x = torch.randn(4, 6, requires_grad=True)
    rows = BoundaryExchange(comm, WireFormat("fp16"), WireFormat("fp16")).start(x, plan, 0).wait()
    np.testing.assert_allclose(rows.detach(), x.detach()[[2, 0, 2]], rtol=2**-11)
    (rows * torch.arange(3.0)[:, None]).sum().backward()
    expected = torch.zeros(4, 6)
    expected[2] = 0 + 2
    expected[0] = 1
    assert torch.equal(x.grad, expected)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("row", [(5,), (3, 7)])
def test_no_rows_at_all(name, row, kernels):
    """A rank that sends or receives nothing to or from a peer encodes and decodes 0 rows."""
    wire = WireFormat(name)
    out = torch.empty((0, *wire.wire_shape(row)), dtype=wire.wire_dtype(torch.float32))
    assert wire.decode(wire.encode(torch.empty(0, *row), out), row, torch.float32).shape == (0, *row)
