"""The reference a user would otherwise pick: the same model, full-graph, one process, PyTorch Geometric.

The model mirrors ``bnsgcn.nn.model.GNN`` layer for layer (dropout before each layer, layer
norm and activation between layers, Adam, summed cross entropy over training nodes /
their count):

* ``graphsage``: the first layer's neighbour mean is precomputed once, as the engine does,
  so layer 1 is ``W_s x + W_n mean(x)``; the others are ``SAGEConv(aggr="mean")`` over the
  graph with self-loops (the engine's normalisation by the degree with the self-loop).
  ``--variant edge_index`` aggregates by gather/scatter over an edge list, ``--variant csr``
  by ``torch.sparse.mm(..., reduce="mean")`` over a CSR ``adj_t`` (PyG's fast CPU path).
* ``gat``: ``GATConv`` (self-loops already in the graph), heads concatenated, averaged in
  the output layer; edge list only.

Prints one JSON line (epoch time, peak resident memory, memory above the process after
imports)::

    python -m benchmarks.pyg_reference --parts-dir parts/g-1 --model graphsage --layers 3 \
        --hidden 128 --threads 2 --epochs 5 --variant csr
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.fullgraph import (
    FullGraph,
    load_full_graph,
    measure_epochs,
    peak_rss_bytes,
    rss_bytes,
    run_and_emit,
)
from bnsgcn.errors import UserError

VARIANTS = ("edge_index", "csr")


class PygSAGE(nn.Module):
    """GraphSAGE with the first layer's aggregation precomputed: x, x_agg [N, F] -> [N, C]."""

    def __init__(self, d_in: int, hidden: int, classes: int, layers: int, dropout: float):
        from torch_geometric.nn import SAGEConv

        super().__init__()
        self.dropout = dropout
        self.first_self = nn.Linear(d_in, hidden)
        self.first_neigh = nn.Linear(d_in, hidden, bias=False)
        widths = [hidden] * (layers - 1) + [classes]
        self.convs = nn.ModuleList(SAGEConv(a, b, aggr="mean") for a, b in zip(widths[:-1], widths[1:]))
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(layers - 1))

    def forward(self, x: Tensor, x_agg: Tensor, adj) -> Tensor:
        drop = lambda t: F.dropout(t, self.dropout, self.training)  # noqa: E731
        h = self.first_self(drop(x)) + self.first_neigh(drop(x_agg))
        for norm, conv in zip(self.norms, self.convs):
            h = conv(drop(F.relu(norm(h))), adj)
        return h


class PygGAT(nn.Module):
    """Multi-head GAT: x [N, F] -> [N, C]."""

    def __init__(self, d_in: int, hidden: int, classes: int, layers: int, heads: int, dropout: float):
        from torch_geometric.nn import GATConv

        super().__init__()
        self.dropout = dropout
        self.convs = nn.ModuleList()
        for i in range(layers):
            last = i == layers - 1
            self.convs.append(
                GATConv(d_in, classes if last else hidden, heads=heads, concat=not last, add_self_loops=False)
            )
            d_in = hidden * heads
        self.norms = nn.ModuleList(nn.LayerNorm(hidden * heads) for _ in range(layers - 1))

    def forward(self, x: Tensor, x_agg: Tensor | None, adj) -> Tensor:
        h = x
        for i, conv in enumerate(self.convs):
            h = conv(F.dropout(h, self.dropout, self.training), adj)
            if i < len(self.norms):
                h = F.elu(self.norms[i](h))
        return h


def adjacency(graph: FullGraph, variant: str):
    """``edge_index`` [2, nnz] (source, target) or a CSR ``adj_t`` [N, N] (rows are targets)."""
    if variant == "edge_index":
        return torch.stack([graph.indices, graph.rows()])
    n = graph.num_nodes
    return torch.sparse_csr_tensor(graph.indptr, graph.indices, torch.ones(graph.indices.numel()), (n, n))


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    try:  # imported before the baseline: it is part of the process
        import torch_geometric
        from torch_geometric.utils import spmm
    except ImportError:
        raise UserError("the PyTorch Geometric reference needs torch-geometric: pip install bnsgcn[bench]") from None

    baseline = rss_bytes()
    graph = load_full_graph(args.parts_dir)
    adj = adjacency(graph, args.variant)
    if args.model == "graphsage":
        csr = adj if args.variant == "csr" else adjacency(graph, "csr")
        x_agg = spmm(csr, graph.features, reduce="mean")  # once, like the engine's precomputation
        model: nn.Module = PygSAGE(graph.features.shape[1], args.hidden, graph.num_classes, args.layers, args.dropout)
    else:
        x_agg = None
        model = PygGAT(graph.features.shape[1], args.hidden, graph.num_classes, args.layers, args.heads, args.dropout)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    mask, n_train = graph.train_mask, int(graph.train_mask.sum())

    def step() -> None:
        model.train()
        optimizer.zero_grad()
        logits = model(graph.features, x_agg, adj)
        loss = F.cross_entropy(logits[mask], graph.labels[mask], reduction="sum") / n_train
        loss.backward()
        optimizer.step()

    result = measure_epochs(step, args.epochs)
    peak = peak_rss_bytes()
    return result | {
        "reference": "pyg",
        "variant": args.variant,
        "model": args.model,
        "threads": args.threads,
        "torch_geometric": torch_geometric.__version__,
        "nodes": graph.num_nodes,
        "edges": int(graph.indices.numel()),
        "peak_rss_bytes": peak,
        "baseline_rss_bytes": baseline,
        "memory_above_baseline_bytes": peak - baseline,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--parts-dir", type=Path, required=True, help="a one-partition set (bnsgcn-partition --parts 1)"
    )
    parser.add_argument("--model", choices=("graphsage", "gat"), default="graphsage")
    parser.add_argument("--variant", choices=VARIANTS, default="csr", help="aggregation path (gat: edge_index only)")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.5)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    if args.model == "gat" and args.variant != "edge_index":
        parser.error("--model gat runs with --variant edge_index only")
    return run_and_emit(run, args)


if __name__ == "__main__":
    raise SystemExit(main())
