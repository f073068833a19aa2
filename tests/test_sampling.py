"""Boundary sampling: unbiased aggregation, exchanged volume, p = 0, reproducibility."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bnsgcn.comm.plan import full_plan, pack_segments, unpack_segments
from bnsgcn.config import TrainConfig
from bnsgcn.data.sampler import sample_boundary
from bnsgcn.data.shard import load_shard
from bnsgcn.kernels import spmm
from bnsgcn.nn.layers import shard_graph

from .helpers.graphs import partition, random_graph
from .helpers.ranks import run_ranks


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_sampled_mean_aggregation_is_unbiased(tmp_path):
    graph = random_graph(num_nodes=120, avg_degree=8, seed=5)
    parts = partition(graph, 3, tmp_path / "parts")
    shard = load_shard(parts, 1, 3)
    topo = shard.topology
    sg = shard_graph(topo, "graphsage", torch.device("cpu"))
    boundary_ids = np.load(parts / "part-1" / "boundary_nodes.npy")
    x_inner = shard.features
    x_boundary = torch.from_numpy(graph.features[boundary_ids])
    plan = full_plan(topo, torch.device("cpu"))
    exact = spmm(sg.inner, x_inner) + spmm(sg.boundary, x_boundary)

    p, draws = 0.3, 1500
    total = torch.zeros_like(exact)
    kept = 0
    for epoch in range(draws):
        keep = sample_boundary(topo.boundary_counts, p, seed=0, rank=1, epoch=epoch)
        g = sg.epoch(keep, p, plan, exchange=None)
        total += spmm(g.inner, x_inner) + spmm(g.boundary, x_boundary[keep])
        kept += int(keep.sum())
    mean = total / draws
    assert kept / (draws * topo.n_boundary) == pytest.approx(p, abs=0.01)
    # the sampling error of the mean over `draws` samples is a few percent of the boundary part
    boundary_part = (exact - spmm(sg.inner, x_inner)).abs().mean()
    assert (mean - exact).abs().mean() < 0.05 * boundary_part
    # and a biased estimate (no 1/p scaling) would be far off: the check can fail
    g = sg.epoch(keep, p, plan, exchange=None)
    unscaled = spmm(g.inner, x_inner) + p * spmm(g.boundary, x_boundary[keep])  # undo the 1/p
    assert (unscaled - exact).abs().mean() > 0.3 * boundary_part


def _config(parts, out, **kw) -> TrainConfig:
    base = dict(
        parts_dir=parts,
        model="graphsage",
        layers=2,
        hidden=8,
        dropout=0.5,
        epochs=6,
        eval_every=3,
        device="cpu",
        out=out,
        seed=11,
        precompute=False,
    )
    return TrainConfig.from_settings(**(base | kw))


def test_exchanged_rows_p0_and_reproducibility(tmp_path):
    graph = random_graph(num_nodes=200, avg_degree=6, seed=2)
    parts = partition(graph, 2, tmp_path / "parts")
    boundary = [len(np.load(parts / f"part-{r}" / "boundary_nodes.npy")) for r in range(2)]
    boundary_total = sum(boundary)
    configs = [
        _config(parts, tmp_path / "p03-a", p=0.3, epochs=20, eval_every=0),
        _config(parts, tmp_path / "p03-b", p=0.3, epochs=20, eval_every=0),
        _config(parts, tmp_path / "p03-c", p=0.3, epochs=20, eval_every=0, seed=12),
        _config(parts, tmp_path / "p0", p=0.0),
        _config(parts, tmp_path / "p1", p=1.0),
    ]
    results = run_ranks(2, configs)
    a, b, c, zero, one = (_metrics(cfg.run.out) for cfg in configs)

    # p of each owner's boundary rows move each epoch (up to one row per owner), and
    # exactly those rows' bytes; selections cost one bit per boundary node
    sampled = [r["sampled_boundary"] for r in a if "epoch" in r]
    assert all(abs(n - 0.3 * boundary_total) <= 2 for n in sampled)
    assert len(set(sampled)) > 1  # the rounding is random, so E[rows] = p * boundary exactly
    assert all(r["bytes_sent_by_kind"]["selections"] == sum((n + 7) // 8 for n in boundary) for r in a if "epoch" in r)
    assert all(r["sampled_boundary"] == boundary_total for r in one if "epoch" in r)
    # layer 1 (8 -> 8) aggregates first: 8 floats a row; layer 2 (8 -> 3) multiplies first: 3
    row_bytes = (8 + 3) * 4
    for rec in a:
        if "epoch" in rec:
            assert rec["bytes_sent_by_kind"]["features"] == rec["sampled_boundary"] * row_bytes
            # the features need no gradient, so only layer 2's rows send one back
            assert rec["bytes_sent_by_kind"]["gradients"] == rec["sampled_boundary"] * 3 * 4

    # p = 0: no boundary traffic at all
    for rec in zero:
        if "epoch" in rec:
            assert rec["sampled_boundary"] == 0
            for kind in ("features", "gradients", "selections"):
                assert rec["bytes_sent_by_kind"][kind] == 0

    # same seed, same run; another seed, another run
    assert [r.get("loss") for r in a] == [r.get("loss") for r in b]
    assert sampled == [r["sampled_boundary"] for r in b if "epoch" in r]
    assert [r.get("loss") for r in a] != [r.get("loss") for r in c]
    for rank in range(2):
        for name, value in results[rank][0]["params"].items():
            np.testing.assert_array_equal(value, results[rank][1]["params"][name])


@pytest.mark.parametrize("counts", [[], [0], [5], [0, 0, 3], [7, 0, 9, 16, 1], [13, 4000, 0, 8]])
def test_selection_bits_pack_each_segment_from_a_byte_boundary(counts):
    """The selections cross as bits: segment by segment, each padded to whole bytes, the
    first entry of a byte its highest bit; unpacking gives the mask back."""
    mask = torch.rand(sum(counts), generator=torch.Generator().manual_seed(len(counts))) < 0.3
    expected, start = [], 0
    for n in counts:
        for first in range(0, n, 8):
            expected.append(sum(128 >> j for j in range(min(8, n - first)) if mask[start + first + j]))
        start += n
    packed = pack_segments(mask, counts)
    assert packed.dtype == torch.uint8 and packed.tolist() == expected
    unpacked = unpack_segments(packed, counts)
    assert unpacked.dtype == torch.bool and torch.equal(unpacked, mask)
