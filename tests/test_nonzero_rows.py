"""Boundary rows that cross as their nonzero entries (:func:`bnsgcn.exchange.transfers.start_nonzero_rows`).

A hidden layer that aggregates first exchanges its input, a ReLU's output after dropout: a
zero entry passes no gradient back, so its row crosses as a bitmap and the nonzero entries,
and its gradient at those entries alone.

* One rank, the exchange alone: the rows arrive bit for bit; the gradient reaching the
  owner is the gathered rows' gradient summed at each index, kept where the entry was
  nonzero and zero elsewhere (a loop in the test), and the dense path's where it was nonzero.
* Two ranks at p = 1 without dropout (ReLU zeros alone), ``--nonzero-rows on``: the dense
  float64 reference of :mod:`tests.helpers.reference`, for GraphSAGE and GCN.
* Two ranks, whole runs with sampling and dropout: the same losses, gradients at every step
  and final parameters (to float32 rounding) as ``--nonzero-rows off`` (whose GraphSAGE multiplies
  first at equal widths: made to aggregate first there, the same sums); fewer feature and
  gradient bytes for GraphSAGE and GCN, the same for GAT (it exchanges projections).
* Four ranks on two emulated machines, node-aware exchange (rows cross machines as nonzero
  entries, and are relayed inside the machine whole): the same, in fewer bytes between
  machines.
* ``auto`` is on exactly when the job spans several machines.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bnsgcn.comm.communicator import Comm
from bnsgcn.comm.plan import ExchangePlan
from bnsgcn.exchange.synchronous import BoundaryExchange
from bnsgcn.metrics import report

from .helpers import reference
from .helpers.graphs import partition, random_graph
from .helpers.ranks import record_gradients, run_ranks


def _one_rank_exchange(nonzero_rows: bool, x: torch.Tensor, plan: ExchangePlan, weights: torch.Tensor):
    comm = Comm(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), timeout=5.0)
    x = x.clone().requires_grad_(True)
    rows = BoundaryExchange(comm, nonzero_rows=nonzero_rows).start(x, plan, 0, zeros_need_no_gradient=True).wait()
    (rows * weights).sum().backward()
    return rows.detach(), x.grad


@pytest.mark.parametrize("width", [5, 16, 19])
def test_rows_arrive_whole_and_gradients_reach_the_nonzero_entries(width):
    g = torch.Generator().manual_seed(width)
    x = torch.randn(12, width, generator=g)
    x[torch.rand(12, width, generator=g) < 0.6] = 0.0
    x[4] = 0.0  # a row with no nonzero entry
    index = torch.tensor([2, 4, 0, 2, 11, 7, 2])
    weights = torch.randn(len(index), width, generator=g)
    plan = ExchangePlan(index, [len(index)], [len(index)])

    rows, grad = _one_rank_exchange(True, x, plan, weights)
    assert torch.equal(rows, x[index])
    expected = torch.zeros_like(x)
    for i, target in enumerate(index.tolist()):
        expected[target] += weights[i]
    expected[x == 0] = 0.0
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-6)

    dense_rows, dense_grad = _one_rank_exchange(False, x, plan, weights)
    assert torch.equal(dense_rows, rows)
    assert torch.equal(dense_grad[x != 0], grad[x != 0])
    assert not torch.equal(dense_grad, grad)  # the dense path does send the zero entries' gradients


@pytest.fixture(scope="module")
def graph():
    return random_graph(num_nodes=900, avg_degree=6, features=24, seed=21)


@pytest.fixture(scope="module")
def parts(graph, tmp_path_factory):
    return partition(graph, 2, tmp_path_factory.mktemp("nonzero") / "parts", method="random")


def _losses(config) -> list[float]:
    return [
        line["loss"]
        for line in map(json.loads, (config.run.out / "metrics.jsonl").read_text().splitlines())
        if "loss" in line
    ]


VARIANTS = [
    dict(model="graphsage", precompute=True),
    dict(model="graphsage", precompute=False, norm="batch"),
    dict(model="gcn", precompute=False, remat=True),
    dict(model="gcn", precompute=True, norm="none", layers=4),
    dict(model="gat", precompute=False),
]


def test_at_p1_runs_match_the_dense_reference(tmp_path):
    graph = random_graph(num_nodes=64, avg_degree=6, features=12, seed=13)
    parts = partition(graph, 2, tmp_path / "parts", method="random")
    configs = [
        reference.exact_config(m, pre, parts, tmp_path / f"{m}-{pre}", nonzero_rows="on")
        for m, pre in [("graphsage", True), ("graphsage", False), ("gcn", False)]
    ]
    configs.append(
        reference.exact_config("gcn", True, parts, tmp_path / "gcn-4", nonzero_rows="on", layers=4, norm="batch")
    )
    results = run_ranks(2, configs)
    for i, config in enumerate(configs):
        reference.assert_run_matches(config, graph, [results[rank][i]["params"] for rank in range(2)])


def record_gradients_aggregating_first():
    """:func:`record_gradients`, with GraphSAGE's equal-width layers aggregating first, as
    they do under ``--nonzero-rows on`` (``off`` multiplies first: the same result, other
    sums): dense rows then run the very sums the nonzero ones do."""
    from bnsgcn.nn.layers import LAYERS, SAGEConv

    class AggregatingFirst(SAGEConv):
        def __init__(self, d_in: int, d_out: int, slot: int, exchange_input: bool = False):
            super().__init__(d_in, d_out, slot, exchange_input=True)

    LAYERS["graphsage"] = AggregatingFirst
    collect = record_gradients()

    def restore():
        LAYERS["graphsage"] = SAGEConv
        return collect()

    return restore


def _run_against_dense_rows(nonzero: list, world: int, nodes: list[int] | None = None) -> list[tuple]:
    """Run ``nonzero`` (``--nonzero-rows on``) and the same configs with ``off`` (and the same
    layer order); assert the same losses, every step's gradients and the final parameters on
    every rank, to float32 rounding (rarely two runs of one multi-rank job differ in the last
    place: see test_lag's seed test; a row sent wrong moves them by far more); return the
    pairs of runs' reports (rank by rank)."""
    dense = [
        c.replace(nonzero_rows="off", out=c.run.out.with_name(c.run.out.name.replace("nonzero", "dense")))
        for c in nonzero
    ]
    results_nonzero = run_ranks(world, nonzero, nodes=nodes, instrument=record_gradients)
    results_dense = run_ranks(world, dense, nodes=nodes, instrument=record_gradients_aggregating_first)
    for i, (a, b) in enumerate(zip(nonzero, dense)):
        label = (
            f"{a.model.name} precompute={a.model.use_precompute} norm={a.model.norm} remat={a.model.remat} "
            f"layers={a.model.layers}"
        )
        np.testing.assert_allclose(_losses(a), _losses(b), rtol=1e-6, atol=0, err_msg=label)
        for rank in range(world):
            run_a, run_b = results_nonzero[rank][i], results_dense[rank][i]
            for grads_a, grads_b in zip(run_a["instrumented"], run_b["instrumented"], strict=True):
                for ga, gb in zip(grads_a, grads_b, strict=True):
                    np.testing.assert_allclose(ga, gb, rtol=1e-5, atol=1e-9, err_msg=label)
            for name in run_a["params"]:
                np.testing.assert_allclose(
                    run_a["params"][name], run_b["params"][name], rtol=1e-6, atol=1e-9, err_msg=f"{label} {name}"
                )
    return [
        (a, list(zip(report.load(a.run.out)["ranks"], report.load(b.run.out)["ranks"]))) for a, b in zip(nonzero, dense)
    ]


def test_runs_equal_the_dense_rows_in_fewer_bytes(parts, tmp_path):
    nonzero = []
    for i, variant in enumerate(VARIANTS):
        model, precompute = variant["model"], variant["precompute"]
        overrides = dict(p=0.6, dropout=0.5, hidden=32, epochs=3) | {
            k: v for k, v in variant.items() if k not in ("model", "precompute")
        }
        nonzero.append(
            reference.exact_config(model, precompute, parts, tmp_path / f"nonzero-{i}", nonzero_rows="on", **overrides)
        )
    for config, rank_reports in _run_against_dense_rows(nonzero, 2):
        for ra, rb in rank_reports:
            for kind in ("features", "gradients"):
                sent_nonzero, sent_dense = ra["per_epoch"][f"sent_{kind}"], rb["per_epoch"][f"sent_{kind}"]
                if config.model.name == "gat":
                    assert sent_nonzero == sent_dense, kind
                else:  # a quarter of the hidden rows' entries is nonzero, about
                    assert sent_nonzero < 0.8 * sent_dense, (config.model.name, kind, sent_nonzero, sent_dense)


def test_node_aware_runs_equal_the_dense_rows(graph, tmp_path):
    parts = partition(graph, 4, tmp_path / "parts", method="random")
    base = dict(p=0.7, dropout=0.5, hidden=32, epochs=3, exchange="hierarchical")
    nonzero = [
        reference.exact_config("graphsage", True, parts, tmp_path / "nonzero-sage", nonzero_rows="on", **base),
        reference.exact_config("gcn", False, parts, tmp_path / "nonzero-gcn", nonzero_rows="on", remat=True, **base),
    ]
    for config, rank_reports in _run_against_dense_rows(nonzero, 4, nodes=[0, 0, 1, 1]):
        for ra, rb in rank_reports:
            assert ra["per_epoch"]["intra_node_features"] > 0  # rows were relayed inside the machine
            for kind in ("features", "gradients"):
                across_a, across_b = ra["per_epoch"][f"inter_node_{kind}"], rb["per_epoch"][f"inter_node_{kind}"]
                assert across_a < 0.8 * across_b, (config.model.name, kind, across_a, across_b)


@pytest.mark.parametrize(("keys", "expected"), [(["a", "a"], "off"), (["a", "b"], "on")])
def test_auto_is_on_when_the_job_spans_machines(keys, expected):
    from bnsgcn.comm.communicator import Nodes
    from bnsgcn.config import TrainConfig
    from bnsgcn.exchange import resolve_exchange_settings

    class TwoRanks:
        nodes = Nodes.from_keys(keys)

    def resolved(setting: str) -> str:
        config = TrainConfig.from_settings(nonzero_rows=setting, exchange="direct")
        return resolve_exchange_settings(config, TwoRanks()).exchange.nonzero_rows

    assert resolved("auto") == expected
    assert resolved("off") == "off" and resolved("on") == "on"
