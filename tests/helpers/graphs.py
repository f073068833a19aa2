"""Small graphs and partition sets for the tests: a random graph whose features carry the
label, Cora (from ../shared/data) split by METIS, a set with a partition that is an island,
a graph of shuffled communities; each written as a partition set by the real writer."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from bnsgcn.partition.graph import Graph, canonical_csr
from bnsgcn.partition.partitioner import assign, method_info
from bnsgcn.partition.writer import write_partition_set

from . import REPO

SHARED_DATA = REPO.parent / "shared" / "data"
NUM_CLASSES = 3  # of the small graphs the error tests write (write_npz)


def random_graph(
    num_nodes: int = 60,
    avg_degree: int = 4,
    features: int = 8,
    classes: int = 3,
    seed: int = 0,
    multilabel: bool = False,
) -> Graph:
    """A random graph with an isolated node, features that carry the label, and a split."""
    rng = np.random.default_rng(seed)
    m = num_nodes * avg_degree // 2
    src, dst = rng.integers(0, num_nodes - 1, m), rng.integers(0, num_nodes - 1, m)  # node N-1 isolated
    indptr, indices, _ = canonical_csr(src, dst, num_nodes)
    if multilabel:
        labels = (rng.random((num_nodes, classes)) < 0.4).astype(np.uint8)
        signal = labels.astype(np.float32) @ rng.normal(size=(classes, features)).astype(np.float32)
    else:
        labels = rng.integers(0, classes, num_nodes).astype(np.int64)
        signal = np.eye(classes, features, dtype=np.float32)[labels]
    x = (signal + rng.normal(scale=0.5, size=(num_nodes, features))).astype(np.float32)
    role = rng.permutation(num_nodes)
    train, val, test = (np.zeros(num_nodes, bool) for _ in range(3))
    train[role[: num_nodes // 2]] = True
    val[role[num_nodes // 2 : 3 * num_nodes // 4]] = True
    test[role[3 * num_nodes // 4 :]] = True
    return Graph("random", indptr, indices, x, labels, train, val, test, classes, multilabel=multilabel)


def partition(graph: Graph, parts: int, out: Path, method: str = "random", seed: int = 0) -> Path:
    assignment = assign(graph, parts, method=method, seed=seed)
    write_partition_set(
        graph, assignment, out, parts=parts, method_info=method_info(method, "cut", seed), progress=False
    )
    return out


def cora_metis(parts: int, out: Path, components: int | None = None) -> Path:
    """The Cora of ../shared/data (public split), METIS into ``parts``, written to ``out``.

    ``components``: Cora with its 1,433 features replaced by their ``components`` leading
    principal directions (the SVD of the row-normalised features, scaled to unit variance).
    The first layer's products and dropout over 1,433 columns are most of a Cora epoch; the
    tests that compare modes with each other, not with a published score, train on 64 such
    columns at about a third of the time, to about the same accuracy.
    """
    from bnsgcn.partition.datasets import load_dataset

    graph = load_dataset("cora", SHARED_DATA / "planetoid", progress=False)
    if components is not None:
        u, s, _ = np.linalg.svd(graph.features.astype(np.float64), full_matrices=False)
        x = u[:, :components] * s[:components]
        graph = dataclasses.replace(
            graph, features=(x / x.std()).astype(np.float32), feature_preprocessing={"kind": "none"}
        )
    return partition(graph, parts, out, method="metis")


def graph_with_island(out: Path) -> Path:
    """A 4-part set whose partition 3 is a component of its own: no boundary node, and no
    other rank needs its rows (zero-sized splits in every all-to-all it takes part in)."""
    main, island = random_graph(num_nodes=90, avg_degree=5, seed=11), random_graph(num_nodes=30, avg_degree=4, seed=12)
    n = main.num_nodes + island.num_nodes
    rows = np.concatenate(
        [
            np.repeat(np.arange(g.num_nodes), np.diff(g.indptr)) + offset
            for g, offset in ((main, 0), (island, main.num_nodes))
        ]
    )
    sources = np.concatenate([main.indices, island.indices + main.num_nodes])
    indptr, indices, _ = canonical_csr(sources, rows, n)
    joined = Graph(
        "joined",
        indptr,
        indices,
        *(
            np.concatenate([getattr(main, k), getattr(island, k)])
            for k in ("features", "labels", "train_mask", "val_mask", "test_mask")
        ),
        main.num_classes,
    )
    assignment = np.concatenate([np.arange(main.num_nodes) % 3, np.full(island.num_nodes, 3)])
    write_partition_set(joined, assignment, out, parts=4, method_info=method_info("random", "cut", 0), progress=False)
    return out


def community_graph(communities: int = 8, size: int = 250, seed: int = 0) -> Graph:
    """``communities`` groups of ``size`` nodes, 12 edges per node inside its group and 1 to
    anywhere, with the node ids shuffled: ascending ids say nothing about who neighbours whom."""
    rng = np.random.default_rng(seed)
    n = communities * size
    group = rng.permutation(n) // size  # node -> community, ids shuffled
    members = np.argsort(group, kind="stable").reshape(communities, size)
    src = np.repeat(np.arange(n), 6)
    inside = members[group[src], rng.integers(0, size, src.shape[0])]
    anywhere = rng.integers(0, n, n // 2)
    indptr, indices, _ = canonical_csr(np.concatenate([src, np.arange(n // 2)]), np.concatenate([inside, anywhere]), n)
    labels = group % 4
    split = rng.random(n)
    return Graph(
        "communities",
        indptr,
        indices,
        rng.standard_normal((n, 4)).astype(np.float32),
        labels,
        split < 0.5,
        (split >= 0.5) & (split < 0.75),
        split >= 0.75,
        4,
    )


def write_npz(path: Path, features: np.ndarray | None = None, labels: np.ndarray | None = None) -> Path:
    """A small graph in the npz layout of docs/datasets.md, optionally with bad arrays."""
    graph = random_graph(num_nodes=40, avg_degree=4, classes=NUM_CLASSES, seed=2)
    np.savez(
        path,
        adj_indptr=graph.indptr,
        adj_indices=graph.indices,
        adj_data=np.ones(graph.indices.shape[0], np.float32),
        adj_shape=np.array([graph.num_nodes, graph.num_nodes]),
        features=graph.features if features is None else features,
        labels=graph.labels if labels is None else labels,
        train_mask=graph.train_mask,
        val_mask=graph.val_mask,
        test_mask=graph.test_mask,
    )
    return path
