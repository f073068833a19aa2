"""The order of the nodes within each partition: blocks of nodes that share neighbours.

A rank's sparse products read one feature row per adjacency entry, in the order of its
rows (the inner nodes) and of their columns. With the inner nodes in ascending global id
those reads jump across the whole feature matrix, unless the dataset's ids happen to follow
its communities. Grouping each partition's inner nodes into blocks of about
:data:`BLOCK_NODES` nodes with many edges among them, and numbering them block by block,
makes consecutive rows read many of the same rows, from the cache. On the reference graph
(2 parts, 100,178 inner nodes and 2.6M entries per part) one thread's 128-wide ``A X`` over
the inner columns took 126 ms in block order against 240 ms in id order, and ``A^T dY``
147 ms against 245 ms (``benchmarks/node_order.py``).

The blocks come from METIS k-way on the partition's inner subgraph (its edges between inner
nodes), ``ceil(n_k / BLOCK_NODES)`` parts. METIS' time grows with the parts: 7 s for the
reference graph's 251 blocks per partition, but 327 s for two partitions of 1,250 blocks
(500,000 nodes and about 21M edges each). So for partitions of more than
:data:`METIS_MAX_BLOCKS` blocks, or where METIS' estimated memory does not fit, the blocks
come from size-capped label propagation instead, which the coarse partitioner uses too
(23 s for those two partitions; coarser clusters, so less of the gain). Memory
beyond the graph: three int64 arrays of ``N`` and one partition's inner subgraph at a time.

The result is a *position* per node: the writer orders each partition's inner nodes by it,
and each owner's group of boundary nodes too (so the rows a peer sends are read in its own
order). Deterministic for a fixed seed.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from bnsgcn.metrics.progress import Progress

from .coarse import LP_ROUNDS, _label_propagation, metis_bytes
from .graph import Graph
from .partitioner import available_memory, metis_parts
from .writer import inner_order, part_sizes

ORDERS = ("blocks", "ids")  # --node-order: blocks of neighbours (default), or ascending global id
BLOCK_NODES = 400  # nodes per block: 400 rows of 128 floats are 200 KiB, well inside a core's L2
LP_CAP_BLOCKS = 16  # label propagation's cluster cap, in blocks: its clusters stop growing far below the cap
METIS_MAX_BLOCKS = 512  # larger partitions take label propagation: METIS k-way slows down with its part count


def block_positions(
    graph: Graph,
    assignment: np.ndarray,
    parts: int,
    *,
    seed: int = 0,
    memory_limit: int | None = None,
    progress: bool = True,
) -> tuple[np.ndarray, dict]:
    """Each node's position within its partition in block order, int64 [N], and how the blocks
    were found (the manifest's ``partitioner.blocks_by``): ``{"block_nodes": ..., "parts": [per
    partition "metis", "label propagation" or "one block"]}``."""
    by_owner, starts, local_index = inner_order(assignment, parts)
    position = np.empty(graph.num_nodes, dtype=np.int64)
    clustering = []
    with Progress(parts, "ordering nodes into blocks", enabled=progress) as bar:
        for k in range(parts):
            inner = by_owner[starts[k] : starts[k + 1]]
            block, how = _blocks(graph, inner, assignment, k, local_index, seed, memory_limit)
            position[inner[np.argsort(block, kind="stable")]] = np.arange(inner.shape[0], dtype=np.int64)
            clustering.append(how)
            bar.update()
    return position, {"block_nodes": BLOCK_NODES, "parts": clustering}


def _blocks(
    graph: Graph,
    inner: np.ndarray,
    assignment: np.ndarray,
    k: int,
    local_index: np.ndarray,
    seed: int,
    memory_limit: int | None,
) -> tuple[np.ndarray, str]:
    """The block of each inner node of partition ``k`` (ids ascending within a block keep their order)."""
    n = inner.shape[0]
    blocks = math.ceil(n / BLOCK_NODES)
    if blocks <= 1:
        return np.zeros(n, dtype=np.int64), "one block"
    counts = np.zeros(n + 1, dtype=np.int64)
    _inner_degrees(graph.indptr, graph.indices, inner, assignment, k, counts)
    sub_indptr = np.cumsum(counts)
    sub_indices = np.empty(int(sub_indptr[-1]), dtype=np.int32 if n < 2**31 else np.int64)
    _inner_edges(graph.indptr, graph.indices, inner, assignment, k, local_index, sub_indptr, sub_indices)
    if blocks <= METIS_MAX_BLOCKS and metis_bytes(n, sub_indices.shape[0]) <= available_memory(memory_limit):
        return metis_parts(sub_indptr, sub_indices, np.ones(n, dtype=np.int64), 1, None, blocks, "cut", seed), "metis"
    order = np.random.default_rng(seed).permutation(n)
    none = np.zeros(0, dtype=np.int64)
    label, _ = _label_propagation(
        sub_indptr, sub_indices, none, none, LP_CAP_BLOCKS * BLOCK_NODES, order, LP_ROUNDS, none
    )
    return label, "label propagation"


@numba.njit(cache=True, nogil=True)
def _inner_degrees(indptr, indices, inner, assignment, k, counts):  # pragma: no cover - numba
    """``counts[i + 1]`` = edges of ``inner[i]`` to other inner nodes of partition ``k``."""
    for i in range(inner.shape[0]):
        v = inner[i]
        for e in range(indptr[v], indptr[v + 1]):
            if assignment[indices[e]] == k:
                counts[i + 1] += 1


@numba.njit(cache=True, nogil=True)
def _inner_edges(
    indptr, indices, inner, assignment, k, local_index, sub_indptr, sub_indices
):  # pragma: no cover - numba
    """Fill the inner subgraph's CSR (local ids, the graph's order within a row)."""
    for i in range(inner.shape[0]):
        v = inner[i]
        pos = sub_indptr[i]
        for e in range(indptr[v], indptr[v + 1]):
            u = indices[e]
            if assignment[u] == k:
                sub_indices[pos] = local_index[u]
                pos += 1


def order_bytes(graph: Graph, assignment: np.ndarray, parts: int) -> int:
    """Estimated peak memory of :func:`block_positions` beyond the graph and METIS' own (which
    it runs only where that fits): the ``N``-sized arrays (owner order and its sort keys,
    local index, position) and the largest partition's inner subgraph (int32 entries, and
    the int64 copy METIS is given; at most its in-edges)."""
    sizes, in_edges = part_sizes(graph, assignment, parts)
    return int(40 * graph.num_nodes + (12 * in_edges + 24 * sizes).max())
