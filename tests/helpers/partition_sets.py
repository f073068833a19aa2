"""The partitioner tests' graphs (random edges, isolated nodes, a path, dense clusters), built
directly so that those tests do not depend on the dataset loaders, and
:func:`check_partition_set`: every invariant of the partition set format that a training rank
relies on, checked against the graph the set was written from."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bnsgcn.data.format import load_partition, read_manifest
from bnsgcn.partition.graph import Graph, canonical_csr


def make_graph(
    name: str, src: np.ndarray, dst: np.ndarray, num_nodes: int, seed: int, multilabel: bool = False
) -> Graph:
    rng = np.random.default_rng(seed)
    indptr, indices, directed = canonical_csr(src, dst, num_nodes)
    num_classes = 4
    labels = (
        (rng.random((num_nodes, num_classes)) < 0.3).astype(np.uint8)
        if multilabel
        else rng.integers(0, num_classes, num_nodes)
    )
    split = rng.random(num_nodes)
    return Graph(
        name=name,
        indptr=indptr,
        indices=indices,
        features=rng.standard_normal((num_nodes, 6)).astype(np.float32),
        labels=labels,
        train_mask=split < 0.4,
        val_mask=(split >= 0.4) & (split < 0.6),
        test_mask=split >= 0.6,
        num_classes=num_classes,
        multilabel=multilabel,
        symmetrized=directed,
    )


def random_graph(num_nodes: int = 300, num_edges: int = 1500, seed: int = 0) -> Graph:
    rng = np.random.default_rng(seed)
    return make_graph(
        "random", rng.integers(0, num_nodes, num_edges), rng.integers(0, num_nodes, num_edges), num_nodes, seed
    )


def isolated_graph(seed: int = 1) -> Graph:
    """Edges only among the first 200 of 260 nodes: 60+ isolated nodes; multi-label."""
    rng = np.random.default_rng(seed)
    return make_graph("isolated", rng.integers(0, 200, 800), rng.integers(0, 200, 800), 260, seed, multilabel=True)


def path_graph(num_nodes: int = 30) -> Graph:
    nodes = np.arange(num_nodes - 1)
    return make_graph("path", nodes, nodes + 1, num_nodes, seed=2)


def clustered_graph(clusters: int = 4, size: int = 250, seed: int = 4) -> Graph:
    """Dense clusters joined by few edges, with every training node in cluster 0."""
    rng = np.random.default_rng(seed)
    n = clusters * size
    cluster = rng.integers(0, clusters, 8000)
    src = cluster * size + rng.integers(0, size, 8000)
    dst = cluster * size + rng.integers(0, size, 8000)
    bridges = rng.integers(0, n, (2, 40))
    graph = make_graph("clustered", np.concatenate([src, bridges[0]]), np.concatenate([dst, bridges[1]]), n, seed)
    graph.train_mask = np.arange(n) < size
    return graph


def edge_keys(graph: Graph) -> np.ndarray:
    """Sorted ``dst * N + src`` of every edge plus one self-loop per node."""
    n = graph.num_nodes
    dst = np.repeat(np.arange(n), graph.in_degree())
    keys = np.concatenate([dst * n + graph.indices, np.arange(n) * (n + 1)])
    return np.sort(keys)


def check_partition_set(graph: Graph, out_dir: Path, parts: int, position: np.ndarray | str | None = None) -> None:
    """Assert every invariant of the format against ``graph``; nodes ordered by ``position``
    within a partition (and within an owner's boundary group), by global id when None, in
    the order the set has (checking the boundary groups against it) when "as written"."""
    n = graph.num_nodes
    loaded = [load_partition(out_dir, k, verify=True) for k in range(parts)]
    key = np.arange(n) if position is None else position
    if isinstance(position, str):
        key = np.empty(n, dtype=np.int64)
        for p in loaded:
            key[p["inner_nodes"]] = np.arange(p["inner_nodes"].shape[0])
    manifest = read_manifest(out_dir)
    assert manifest["parts"] == parts and len(manifest["partitions"]) == parts
    assert manifest["dataset"]["num_nodes"] == n and manifest["dataset"]["num_edges"] == graph.num_edges

    # Inner sets: in order, disjoint, covering.
    inner = [p["inner_nodes"] for p in loaded]
    for nodes in inner:
        assert np.all(np.diff(key[nodes]) > 0)
    assert np.array_equal(np.sort(np.concatenate(inner)), np.arange(n))
    owner = np.empty(n, dtype=np.int64)
    for k, nodes in enumerate(inner):
        owner[nodes] = k

    in_degree = graph.in_degree()
    dst_all = np.repeat(np.arange(n), in_degree)
    src_all = graph.indices.astype(np.int64)
    reconstructed = []
    for k, p in enumerate(loaded):
        boundary = p["boundary_nodes"]
        # Boundary = exactly the off-partition in-neighbours of the inner nodes, grouped by owner, then in order.
        into_k = (owner[dst_all] == k) & (owner[src_all] != k)
        assert np.array_equal(np.sort(boundary), np.unique(src_all[into_k]))
        assert np.array_equal(np.lexsort((key[boundary], owner[boundary])), np.arange(boundary.shape[0]))
        offsets = p["boundary_offsets"]
        assert np.array_equal(np.diff(offsets), np.bincount(owner[boundary], minlength=parts))
        assert offsets[k] == offsets[k + 1]  # no boundary node is owned by k itself

        # Local CSR: one row per inner node, ascending columns, self-loop in every row.
        indptr, indices = p["adj_indptr"], p["adj_indices"].astype(np.int64)
        assert indptr.shape[0] == inner[k].shape[0] + 1 and indptr[-1] == indices.shape[0]
        rows = np.repeat(np.arange(inner[k].shape[0]), np.diff(indptr))
        same_row = rows[1:] == rows[:-1]
        assert np.all(np.diff(indices)[same_row] > 0)
        assert np.all(np.isin(np.arange(inner[k].shape[0]), indices[indices == rows]))
        local_to_global = np.concatenate([inner[k], boundary])
        reconstructed.append(inner[k][rows] * n + local_to_global[indices])

        # Full-graph degrees with the self-loop, for inner and boundary columns.
        assert np.array_equal(p["degree"], (in_degree[local_to_global] + 1).astype(np.float32))
        # Node data of the inner nodes.
        assert np.array_equal(p["features"], graph.features[inner[k]])
        assert np.array_equal(p["labels"], graph.labels[inner[k]])
        for mask in ("train_mask", "val_mask", "test_mask"):
            assert np.array_equal(p[mask], getattr(graph, mask)[inner[k]])

        entry = manifest["partitions"][k]
        assert entry["n_inner"] == inner[k].shape[0] and entry["n_boundary"] == boundary.shape[0]
        assert entry["cut_edges"] == int(into_k.sum())
        assert entry["local_edges"] + entry["cut_edges"] == int(in_degree[inner[k]].sum())
        assert entry["train_nodes"] == int(graph.train_mask[inner[k]].sum())

    # Every edge and every self-loop appears in exactly one partition.
    assert np.array_equal(np.sort(np.concatenate(reconstructed)), edge_keys(graph))

    # Send lists: what k sends to q is q's boundary owned by k, in q's order.
    for k, p in enumerate(loaded):
        send_offsets, send_nodes = p["send_offsets"], p["send_nodes"]
        assert send_offsets.shape == (parts + 1,) and send_offsets[-1] == send_nodes.shape[0]
        for q, peer in enumerate(loaded):
            sent = inner[k][send_nodes[send_offsets[q] : send_offsets[q + 1]]]
            expected = peer["boundary_nodes"][peer["boundary_offsets"][k] : peer["boundary_offsets"][k + 1]]
            assert np.array_equal(sent, expected if q != k else expected[:0])

    totals = manifest["report"]["totals"]
    assert totals["inner"] == n and totals["cut_edges"] + totals["local_edges"] == graph.num_edges
    assert totals["boundary"] == sum(p["boundary_nodes"].shape[0] for p in loaded)


def edit_array(path: Path, edit) -> None:
    """Change values of a partition array in place, keeping dtype, shape and file size
    (only ``--verify`` would notice from the checksum)."""
    array = np.load(path)
    size = path.stat().st_size
    edit(array)
    np.save(path, array)
    assert path.stat().st_size == size
