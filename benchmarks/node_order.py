"""A partition's sparse products in its own node order against ascending global ids.

``bnsgcn-partition`` numbers each partition's nodes in blocks that share neighbours
(``--node-order blocks``, :mod:`bnsgcn.partition.order`). This benchmark takes one partition
of a set, renumbers it in ascending global id (inner nodes, and boundary nodes within each
owner's group: the ``--node-order ids`` numbering of the same partition), and times the
engine's aggregation kernels on both numberings in one process, taking turns: ``A X`` and
``A^T dY`` over the inner columns and over the boundary columns (the two products a
GraphSAGE layer runs, ``bnsgcn.nn.graph.ShardGraph``), for each width. One thread, as a rank
runs. Medians and minimums of ``--repeat`` calls (after one unmeasured call each).

    python benchmarks/node_order.py --parts-dir /tmp/ref-parts --out benchmarks/results/node_order.json
"""

from __future__ import annotations

import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as bnsgcn-train runs its ranks

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import replace  # noqa: E402
from datetime import date  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runnable as a script from a checkout
    sys.path.insert(0, str(REPO))

from benchmarks.suite import machine, write_json  # noqa: E402
from bnsgcn.data.format import load_partition, read_manifest  # noqa: E402
from bnsgcn.data.shard import Topology, load_shard  # noqa: E402
from bnsgcn.kernels import backend  # noqa: E402
from bnsgcn.nn.graph import ShardGraph  # noqa: E402
from bnsgcn.nn.layers import shard_graph  # noqa: E402


def in_id_order(topology: Topology, inner_ids: np.ndarray, boundary_ids: np.ndarray) -> Topology:
    """``topology`` renumbered: inner nodes by ascending global id, boundary nodes by ascending
    global id within each owner's group (rows and columns both; entries ascending per row)."""
    n, counts = topology.n_inner, topology.boundary_counts
    owner = np.repeat(np.arange(len(counts)), counts)
    old_of_new = np.concatenate([np.argsort(inner_ids, kind="stable"), n + np.lexsort((boundary_ids, owner))])
    new_of_old = np.empty_like(old_of_new)
    new_of_old[old_of_new] = np.arange(old_of_new.shape[0])
    indptr, indices = topology.indptr.numpy(), topology.indices.numpy()
    lengths = np.diff(indptr)[old_of_new[:n]]
    new_indptr = np.concatenate([[0], np.cumsum(lengths)])
    rows = np.repeat(np.arange(n), lengths)
    columns = new_of_old[np.concatenate([indices[indptr[o] : indptr[o + 1]] for o in old_of_new[:n]])]
    columns = columns[np.lexsort((columns, rows))]
    return replace(
        topology,
        indptr=torch.from_numpy(new_indptr),
        indices=torch.from_numpy(columns.astype(np.int32)),
        degree=topology.degree[torch.from_numpy(old_of_new)],
    )


def time_products(graphs: dict[str, ShardGraph], width: int, repeat: int) -> list[dict]:
    """Median and minimum seconds of each product of each numbering, the numberings taking turns."""
    kernels = backend.kernel_backend(torch.device("cpu"))
    generator = torch.Generator().manual_seed(width)
    calls = {}
    for order, graph in graphs.items():
        for columns, adj in (("inner", graph.inner), ("boundary", graph.boundary)):
            x = torch.randn(adj.n_cols, width, generator=generator)
            dy = torch.randn(adj.n_rows, width, generator=generator)
            calls[(order, columns, "A X")] = lambda adj=adj, x=x: kernels.spmm(adj, x)
            calls[(order, columns, "A^T dY")] = lambda adj=adj, dy=dy: kernels.spmm_transposed(adj, dy)
    times = {key: [] for key in calls}
    for key, call in calls.items():
        call()
    for _ in range(repeat):
        for key, call in calls.items():
            start = time.perf_counter()
            call()
            times[key].append(time.perf_counter() - start)
    return [
        {
            "order": order,
            "columns": columns,
            "product": product,
            "width": width,
            "median_s": float(np.median(t)),
            "min_s": float(np.min(t)),
        }
        for (order, columns, product), t in times.items()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts-dir", type=Path, required=True, help="a partition set (bnsgcn-partition)")
    parser.add_argument("--part", type=int, default=0, help="which partition (default 0)")
    parser.add_argument("--widths", type=int, nargs="+", default=[128, 16], help="feature widths (default 128 16)")
    parser.add_argument("--repeat", type=int, default=9, help="timed calls per product (default 9)")
    parser.add_argument("--out", type=Path, help="write the record here (JSON)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    node_order = read_manifest(args.parts_dir)["partitioner"].get("node_order", "ids")
    shard = load_shard(args.parts_dir, args.part, None)
    arrays = load_partition(args.parts_dir, args.part)
    ids = in_id_order(shard.topology, np.asarray(arrays["inner_nodes"]), np.asarray(arrays["boundary_nodes"]))
    graphs = {
        f"as written ({node_order})": shard_graph(shard.topology, "graphsage", torch.device("cpu")),
        "ascending ids": shard_graph(ids, "graphsage", torch.device("cpu")),
    }
    rows = [row for width in args.widths for row in time_products(graphs, width, args.repeat)]
    print(
        f"partition {args.part} of {args.parts_dir}: {shard.topology.n_inner:,} inner, "
        f"{shard.topology.n_boundary:,} boundary nodes, "
        f"{shard.topology.nnz:,} entries; one thread, median (min) of {args.repeat} calls, ms"
    )
    print(f"| width | columns | product | {' | '.join(graphs)} |")
    print("|---|---|---|" + "---|" * len(graphs))
    for width in args.widths:
        for columns in ("inner", "boundary"):
            for product in ("A X", "A^T dY"):
                cells = [
                    next(
                        r
                        for r in rows
                        if (r["order"], r["columns"], r["product"], r["width"]) == (order, columns, product, width)
                    )
                    for order in graphs
                ]
                print(
                    f"| {width} | {columns} | `{product}` | "
                    + " | ".join(f"{c['median_s'] * 1e3:.1f} ({c['min_s'] * 1e3:.1f})" for c in cells)
                    + " |"
                )
    if args.out is not None:
        write_json(
            args.out,
            {
                "date": date.today().isoformat(),
                "command": " ".join(sys.argv),
                "machine": machine(),
                "parts_dir": str(args.parts_dir),
                "part": args.part,
                "node_order": node_order,
                "n_inner": shard.topology.n_inner,
                "n_boundary": shard.topology.n_boundary,
                "entries": shard.topology.nnz,
                "repeat": args.repeat,
                "products": rows,
            },
        )
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
