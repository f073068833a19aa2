"""An epoch's autograd graph is freed by reference counting alone, without Python's cycle
collector: the exchange's records hold no reference cycle (each epoch's sampled adjacency
and buffers would otherwise live until the collector happens to run)."""

from __future__ import annotations

import gc
import weakref

import torch

from bnsgcn.comm import Comm
from bnsgcn.compress import EXACT, WireFormat
from bnsgcn.exchange import BoundaryExchange, ExchangePlan
from bnsgcn.shard import Topology
from bnsgcn.stale import StaleExchange


def _one_rank() -> Comm:
    return Comm(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), timeout=1.0, pipelined=True)


def _topology() -> Topology:
    """One rank whose 4 inner rows are also its own 'boundary' columns (a world of one)."""
    return Topology(n_inner=4, indptr=torch.zeros(5, dtype=torch.int64), indices=torch.zeros(0, dtype=torch.int64),
                    degree=torch.ones(8), boundary_counts=[4], send_nodes=torch.arange(4), send_counts=[4])


def _epoch(exchange, plan: ExchangePlan) -> tuple[weakref.ref, weakref.ref]:
    x = torch.randn(4, 6, requires_grad=True)
    flight = exchange.start(x * 2, plan, 0)
    rows = flight.wait()
    (rows * torch.arange(1.0, 5.0)[:, None]).sum().backward()
    return weakref.ref(flight), weakref.ref(rows)


def _freed_without_collector(exchange, plan: ExchangePlan, epochs: int) -> None:
    gc.collect()
    gc.disable()
    try:
        for _ in range(epochs):
            flight, rows = _epoch(exchange, plan)
            assert flight() is None and rows() is None, "an epoch's exchange record outlived its epoch"
    finally:
        gc.enable()


def test_synchronous_exchange_leaves_no_cycle():
    plan = ExchangePlan(torch.arange(4), [4], [4])
    for fmt in (EXACT, WireFormat("int8")):
        _freed_without_collector(BoundaryExchange(_one_rank(), fmt, fmt), plan, epochs=3)


def test_stale_exchange_leaves_no_cycle():
    comm, topology = _one_rank(), _topology()
    plan = ExchangePlan(torch.arange(4), [4], [4])
    stale = StaleExchange(comm, topology, BoundaryExchange(comm), EXACT, EXACT, smoothing=0.5)
    stale.prepare(plan, torch.ones(4, dtype=torch.bool))
    _freed_without_collector(stale, plan, epochs=4)  # the first synchronous, then stale ones


def test_each_model_builds_only_the_adjacencies_it_uses(tmp_path):
    from bnsgcn.graph import ShardGraph
    from bnsgcn.shard import load_shard

    from .distributed import partition, random_graph

    topology = load_shard(partition(random_graph(40, seed=2), 2, tmp_path / "parts"), 0, 2).topology
    gat = ShardGraph(topology, "gat", torch.device("cpu"))
    assert gat.full is not None and gat.inner is None and gat.boundary is None
    for model in ("graphsage", "gcn"):
        graph = ShardGraph(topology, model, torch.device("cpu"))
        assert graph.full is None and graph.inner is not None and graph.boundary is not None
    keep = torch.rand(topology.n_boundary) < 0.5
    epoch = gat.epoch(keep, 0.5, None, None)
    assert epoch.inner is None and epoch.boundary is None and epoch.full.n_cols == topology.n_inner + int(keep.sum())


def test_gcn_with_precomputed_aggregation_draws_no_input_mask(monkeypatch):
    """GCN's first layer then reads only x_agg: a mask over x would be drawn and thrown away."""
    from bnsgcn import model as model_module
    from bnsgcn.config import TrainConfig

    masked: list[torch.Tensor] = []
    real = model_module.RecomputedDropout.__call__  # the input dropout of layer 0
    monkeypatch.setattr(model_module.RecomputedDropout, "__call__", lambda self, t, p, training: masked.append(t) or real(self, t, p, training))
    x, x_agg = torch.randn(5, 4), torch.randn(5, 4)
    for name, reads_x in (("gcn", False), ("graphsage", True)):
        masked.clear()
        net = model_module.GNN(TrainConfig(model=name, layers=1, hidden=3, dropout=0.5), 4, 3, lambda t: t)
        net(x, None, x_agg)
        assert any(t is x for t in masked) == reads_x, name
        assert any(t is x_agg for t in masked), name
