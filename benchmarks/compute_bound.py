"""Compute-only bound: the engine's sparse and dense products, one process, nothing else.

The same sequence of products the engine runs per epoch on the whole graph, forward and
backward, through ``bnsgcn.kernels`` and ``nn.Linear``, without sampling, boundary
exchange, normalisation, dropout or optimizer:

* ``graphsage`` (first layer precomputed): ``W_s x + W_n x_agg``, then per layer
  ``W_s h + W_n (A h)`` when ``d_in <= d_out`` else ``W_s h + A (W_n h)``, with
  ``A[v, u] = 1 / deg(v)`` (self-loop included);
* ``gat``: ``z = W h``, attention scores, ``gat_aggregate`` over the pattern.

No epoch of the engine can be faster than this on the same threads. Prints one JSON line::

    python -m benchmarks.compute_bound --parts-dir parts/g-1 --model graphsage --layers 3 --hidden 128 --threads 2
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.fullgraph import load_full_graph, measure_epochs, run_and_emit
from bnsgcn.kernels import Adjacency, gat_aggregate, spmm


class SageProducts(nn.Module):
    def __init__(self, widths: list[int]):
        super().__init__()
        self.lin_self = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.lin_neigh = nn.ModuleList(nn.Linear(a, b, bias=False) for a, b in zip(widths[:-1], widths[1:]))

    def forward(self, adj: Adjacency, x: Tensor, x_agg: Tensor) -> Tensor:
        h = self.lin_self[0](x) + self.lin_neigh[0](x_agg)
        for lin_self, lin_neigh in zip(self.lin_self[1:], self.lin_neigh[1:]):
            if lin_neigh.in_features <= lin_neigh.out_features:
                h = lin_self(h) + lin_neigh(spmm(adj, h))
            else:
                h = lin_self(h) + spmm(adj, lin_neigh(h))
        return h


class GatProducts(nn.Module):
    def __init__(self, widths: list[int], heads: int):
        super().__init__()
        self.heads = heads
        self.lins = nn.ModuleList(
            nn.Linear(a if i == 0 else a * heads, b * heads, bias=False)
            for i, (a, b) in enumerate(zip(widths[:-1], widths[1:]))
        )
        self.att = nn.ParameterList(nn.Parameter(torch.randn(2, heads, b) * 0.1) for b in widths[1:])

    def forward(self, adj: Adjacency, x: Tensor, x_agg: Tensor | None) -> Tensor:
        h = x
        for i, (lin, att) in enumerate(zip(self.lins, self.att)):
            z = lin(h).view(h.shape[0], self.heads, -1)
            out = gat_aggregate(adj, z, (z * att[0]).sum(-1), (z * att[1]).sum(-1))
            h = out.reshape(out.shape[0], -1) if i < len(self.lins) - 1 else out.mean(1)
        return h


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    graph = load_full_graph(args.parts_dir)
    n = graph.num_nodes
    rows = graph.rows()
    degree = graph.indptr.diff().clamp_min(1).float()
    widths = [graph.features.shape[1]] + [args.hidden] * (args.layers - 1) + [graph.num_classes]
    if args.model == "graphsage":
        adj = Adjacency.from_csr(graph.indptr, graph.indices, n, 1.0 / degree[rows])
        x_agg = spmm(adj, graph.features)  # precomputed once, as the engine does
        model: nn.Module = SageProducts(widths)
    else:
        adj = Adjacency.from_csr(graph.indptr, graph.indices, n)
        x_agg = None
        model = GatProducts(widths, args.heads)
    mask = graph.train_mask

    def step() -> None:
        model.zero_grad(set_to_none=False)
        logits = model(adj, graph.features, x_agg)
        F.cross_entropy(logits[mask], graph.labels[mask], reduction="sum").backward()

    return measure_epochs(step, args.epochs) | {
        "reference": "compute_bound",
        "model": args.model,
        "threads": args.threads,
        "nodes": n,
        "edges": int(graph.indices.numel()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--parts-dir", type=Path, required=True, help="a one-partition set (bnsgcn-partition --parts 1)"
    )
    parser.add_argument("--model", choices=("graphsage", "gat"), default="graphsage")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    return run_and_emit(run, args)


if __name__ == "__main__":
    raise SystemExit(main())
