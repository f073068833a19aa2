"""An epoch's autograd graph is freed by reference counting alone, without Python's cycle
collector: the exchange's records hold no reference cycle (each epoch's sampled adjacency
and buffers would otherwise live until the collector happens to run)."""

from __future__ import annotations

import gc
import weakref

import torch

from bnsgcn.comm.communicator import Comm
from bnsgcn.comm.plan import ExchangePlan
from bnsgcn.comm.wire import EXACT, WireFormat
from bnsgcn.data.shard import Topology
from bnsgcn.exchange.stale import StaleExchange
from bnsgcn.exchange.synchronous import BoundaryExchange


def _one_rank() -> Comm:
    return Comm(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), timeout=1.0, pipelined=True)


def _topology() -> Topology:
    """One rank whose 4 inner rows are also its own 'boundary' columns (a world of one)."""
    return Topology(
        n_inner=4,
        indptr=torch.zeros(5, dtype=torch.int64),
        indices=torch.zeros(0, dtype=torch.int64),
        degree=torch.ones(8),
        boundary_counts=[4],
        send_nodes=torch.arange(4),
        send_counts=[4],
    )


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
    from bnsgcn.data.shard import load_shard
    from bnsgcn.nn.layers import shard_graph

    from .helpers.graphs import partition, random_graph

    topology = load_shard(partition(random_graph(40, seed=2), 2, tmp_path / "parts"), 0, 2).topology
    gat = shard_graph(topology, "gat", torch.device("cpu"))
    assert gat.full is not None and gat.inner is None and gat.boundary is None
    for model in ("graphsage", "gcn"):
        graph = shard_graph(topology, model, torch.device("cpu"))
        assert graph.full is None and graph.inner is not None and graph.boundary is not None
    keep = torch.rand(topology.n_boundary) < 0.5
    epoch = gat.epoch(keep, 0.5, None, None)
    assert epoch.inner is None and epoch.boundary is None and epoch.full.n_cols == topology.n_inner + int(keep.sum())


def test_gcn_with_precomputed_aggregation_draws_no_input_mask(monkeypatch):
    """GCN's first layer then reads only x_agg: a mask over x would be drawn and thrown away."""
    from bnsgcn.config import TrainConfig
    from bnsgcn.nn import model as model_module

    masked: list[torch.Tensor] = []
    real = model_module.RecomputedDropout.__call__  # the input dropout of layer 0
    monkeypatch.setattr(
        model_module.RecomputedDropout,
        "__call__",
        lambda self, t, p, training: masked.append(t) or real(self, t, p, training),
    )
    x, x_agg = torch.randn(5, 4), torch.randn(5, 4)
    for name, reads_x in (("gcn", False), ("graphsage", True)):
        masked.clear()
        net = model_module.GNN(
            TrainConfig.from_settings(model=name, layers=1, hidden=3, dropout=0.5), 4, 3, lambda t: t
        )
        net(x, None, x_agg)
        assert any(t is x for t in masked) == reads_x, name
        assert any(t is x_agg for t in masked), name


def _sage_layer_run(exchange_input: bool, seed: int = 5) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """One GraphSAGE layer, 6 -> 6 columns, over a world of one whose 4 inner rows are also
    its boundary columns: (output, gradients of input and weights, bytes kept for backward
    in tensors of a row per node, as the input)."""
    from bnsgcn.comm.plan import full_plan
    from bnsgcn.nn.layers import SAGEConv, shard_graph

    indptr = torch.tensor([0, 3, 5, 8, 10])
    indices = torch.tensor([0, 5, 6, 1, 4, 2, 3, 7, 3, 6])
    topology = Topology(
        n_inner=4,
        indptr=indptr,
        indices=indices,
        degree=torch.tensor([3.0, 2, 3, 2, 1, 1, 1, 1]),
        boundary_counts=[4],
        send_nodes=torch.arange(4),
        send_counts=[4],
    )
    graph = shard_graph(topology, "graphsage", torch.device("cpu"))
    epoch = graph.epoch(
        torch.ones(4, dtype=torch.bool), 1.0, full_plan(topology, torch.device("cpu")), BoundaryExchange(_one_rank())
    )
    torch.manual_seed(seed)
    layer = SAGEConv(6, 6, slot=1, exchange_input=exchange_input).double()
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    kept = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x, epoch)
    kept_bytes = sum(
        t.numel() * t.element_size() for t in {t.data_ptr(): t for t in kept if t.shape[:1] == x.shape[:1]}.values()
    )
    out.backward(torch.arange(24.0, dtype=torch.float64).view(4, 6))
    return out.detach(), [x.grad, *(p.grad for p in layer.parameters())], kept_bytes


def test_graphsage_multiplying_first_at_equal_widths_keeps_one_activation_less():
    """At equal widths GraphSAGE multiplies first (unless its input rows should cross as
    nonzero entries): the same output and gradients as aggregating first, and backward
    keeps the input alone, not also the aggregation."""
    from bnsgcn.nn.layers import SAGEConv

    assert SAGEConv(6, 6, slot=1).multiplies_first and not SAGEConv(6, 6, slot=1, exchange_input=True).multiplies_first
    out_mf, grads_mf, kept_mf = _sage_layer_run(exchange_input=False)
    out_af, grads_af, kept_af = _sage_layer_run(exchange_input=True)
    torch.testing.assert_close(out_mf, out_af)
    for a, b in zip(grads_mf, grads_af, strict=True):
        torch.testing.assert_close(a, b)
    assert kept_mf == 4 * 6 * 8 and kept_af == 2 * 4 * 6 * 8  # x alone; x and A x
