"""``coarse``: METIS on a coarsened graph, projected back and refined, for graphs METIS cannot hold.

METIS keeps several copies of the graph (its CSR, a coarsening hierarchy, 64-bit indices
throughout): about 120 bytes per directed edge and 1,000 per node, see
:func:`metis_bytes`. This partitioner only *reads* the graph's CSR, one row at a time,
so the CSR may be memory-mapped from disk, and keeps ``O(N)`` arrays of its own:

1. **Coarsen** by size-constrained label propagation (the coarsening of KaHIP/ParHIP):
   every node starts in a cluster of its own; in a few rounds, in a seeded random order,
   each node joins the neighbouring cluster it has the most edge weight to, provided the
   cluster's node weight stays within a cap (ties: the smaller cluster id; no move
   without a strict gain). Nodes without edges are packed into shared clusters up to the
   cap (they cannot add to the cut). The clusters are contracted into a weighted graph:
   node weights ``[nodes, training nodes]``, edge weight = the number of fine edges between
   two clusters. This repeats on the coarse graph, the cap growing 4x per level (at most
   ``N / 8K``), until the coarse graph has at most ``coarse_nodes`` nodes *and* METIS
   would fit it in the memory budget. A level that would leave fewer than ``8 K``
   clusters is not taken; one whose coarse graph would take more than half the budget
   (graphs without locality, where clusters of a few nodes hardly merge any edges) first
   grows its clusters further, label propagation resuming from its clusters with a 4x cap.
2. **Partition** the coarsest graph with METIS k-way, with the same two balance
   constraints as ``metis`` (node count and training-node count per part).
3. **Project** the parts back to the fine nodes.
4. **Refine** with ``REFINE_ROUNDS`` passes of greedy boundary moves on the fine graph
   (each node, in random order, moves to the part it has the most edges to if that
   strictly lowers the cut and the target stays within both caps), then **rebalance**:
   nodes of a part over a cap move to the best-connected part with room. The caps are
   ``ceil(1.03 N / K)`` nodes and ``ceil(1.03 T / K)`` training nodes (METIS' 3%).

Every loop is compiled with numba; all of it is deterministic for a fixed seed. Memory:
about ``COARSE_BYTES_PER_NODE`` bytes per node plus the coarse graphs (bounded by the
METIS budget) plus METIS on the coarsest graph, in a child process.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numba
import numpy as np

from bnsgcn.errors import UserError
from bnsgcn.metrics.progress import step

from .graph import Graph

BALANCE_TOLERANCE = 0.03  # METIS' default load imbalance, 1.03
LP_ROUNDS = 4  # label-propagation rounds per coarsening level
REFINE_ROUNDS = 4
COARSE_NODES = 1 << 16  # default: coarsen until at most this many clusters remain
CAP_GROWTH = 4  # the cluster-weight cap grows by this factor per level
CONTRACT_BYTES_PER_EDGE = 16  # a coarse edge: int64 neighbour and int64 weight
MIN_CLUSTERS_PER_PART = 8
# Fitted to pymetis' METIS_PartGraphKway (64-bit idx_t, 2 constraints), measured as the
# forked child's peak RSS on synthetic graphs of the reference family (docs/benchmarks.md).
# 1.25M-50M edges, degree 25-200: 0.17-6.4 GiB, each at or below the fit (by up to 45%; the
# Reddit-sized graph, degree 490: 7.7 GiB measured, 13.0 GiB estimated).
METIS_BYTES_PER_NODE = 1000
METIS_BYTES_PER_EDGE = 120
METIS_BYTES_FIXED = 16 << 20
# This partitioner's own arrays per fine node (order, labels, weights, scratch, members,
# cluster ids, part, refinement scratch), checked against measured peaks.
COARSE_BYTES_PER_NODE = 80


def format_bytes(size: float) -> str:
    """``1.5 GiB``, ``320 MiB``, ``12 KiB``, ``300 B``: memory and file sizes in error and progress lines."""
    if size >= 2**30:
        return f"{size / 2**30:.1f} GiB"
    if size >= 2**20:
        return f"{size / 2**20:.0f} MiB"
    return f"{size / 2**10:.0f} KiB" if size >= 2**10 else f"{size:.0f} B"


def metis_bytes(num_nodes: int, num_edges: int) -> int:
    """Estimated peak memory of METIS k-way on a graph of ``num_nodes`` and ``num_edges`` directed edges.

    Includes the int64 copies of the CSR and weights METIS is given (``metis_assignment``
    makes them) and METIS' own allocations; fitted as ``a N + b E + c`` on measured peaks.
    """
    return METIS_BYTES_PER_NODE * num_nodes + METIS_BYTES_PER_EDGE * num_edges + METIS_BYTES_FIXED


def coarse_bytes(num_nodes: int) -> int:
    """Estimated peak memory of this partitioner beyond the graph and the METIS run on the coarsest graph."""
    return COARSE_BYTES_PER_NODE * num_nodes


def _label_propagation(
    indptr: np.ndarray,
    indices: np.ndarray,
    adjwgt: np.ndarray,
    node_weight: np.ndarray,
    max_weight: int,
    order: np.ndarray,
    rounds: int,
    initial: np.ndarray,
) -> tuple[np.ndarray, int]:
    """Size-constrained label propagation; returns the cluster id (0..C-1) of every node and C.

    Starts from the clusters ``initial`` (ids in ``[0, n)``; length 0: every node alone).
    ``adjwgt`` / ``node_weight`` of length 0 mean all ones. Clusters are numbered in order
    of their smallest node. Each round is one compiled call, so Ctrl-C and SIGTERM (handled
    between calls) wait for one pass over the edges at most.
    """
    n = indptr.shape[0] - 1
    label = np.arange(n, dtype=np.int64) if initial.shape[0] == 0 else initial.astype(np.int64)
    weight = _cluster_weights(label, node_weight)
    gain = np.zeros(n, dtype=np.int64)
    touched = np.empty(n, dtype=np.int64)
    for _ in range(rounds):
        if _lp_round(indptr, indices, adjwgt, node_weight, max_weight, order, label, weight, gain, touched) == 0:
            break
    del weight, touched
    return label, _lp_finish(indptr, node_weight, max_weight, label, gain)


@numba.njit(cache=True, nogil=True)
def _cluster_weights(label, node_weight):  # pragma: no cover - numba
    """Node weight of every cluster id ``0..n-1`` (``node_weight`` of length 0: ones)."""
    weight = np.zeros(label.shape[0], dtype=np.int64)
    for v in range(label.shape[0]):
        weight[label[v]] += 1 if node_weight.shape[0] == 0 else node_weight[v]
    return weight


@numba.njit(cache=True, nogil=True)
def _lp_round(
    indptr, indices, adjwgt, node_weight, max_weight, order, label, weight, gain, touched
):  # pragma: no cover - numba
    """One label-propagation pass in ``order``; ``gain`` is zero on entry and exit; returns the moves made."""
    unit_edges = adjwgt.shape[0] == 0
    unit_nodes = node_weight.shape[0] == 0
    moved = 0
    for i in range(order.shape[0]):
        v = order[i]
        start, end = indptr[v], indptr[v + 1]
        if start == end:
            continue
        count = 0
        for e in range(start, end):
            c = label[indices[e]]
            if gain[c] == 0:
                touched[count] = c
                count += 1
            gain[c] += 1 if unit_edges else adjwgt[e]
        current = label[v]
        w = 1 if unit_nodes else node_weight[v]
        best, best_gain = current, gain[current]
        for t in range(count):
            c = touched[t]
            g = gain[c]
            if (
                c != current
                and weight[c] + w <= max_weight
                and (g > best_gain or (g == best_gain and best != current and c < best))
            ):
                best, best_gain = c, g
        for t in range(count):
            gain[touched[t]] = 0
        if best != current:
            weight[current] -= w
            weight[best] += w
            label[v] = best
            moved += 1
    return moved


@numba.njit(cache=True, nogil=True)
def _lp_finish(indptr, node_weight, max_weight, label, ids):  # pragma: no cover - numba
    """Pack nodes without edges into shared clusters up to the cap, then number the clusters
    0..C-1 in order of their smallest node (in place, ``ids`` is scratch); returns C."""
    n = label.shape[0]
    pack, pack_weight = -1, 0
    for v in range(n):
        if indptr[v] == indptr[v + 1] and label[v] == v:
            w = 1 if node_weight.shape[0] == 0 else node_weight[v]
            if pack < 0 or pack_weight + w > max_weight:
                pack, pack_weight = v, 0
            label[v] = pack
            pack_weight += w
    ids[:] = -1
    clusters = 0
    for v in range(n):
        c = label[v]
        if ids[c] < 0:
            ids[c] = clusters
            clusters += 1
        label[v] = ids[c]
    return clusters


@numba.njit(cache=True, nogil=True)
def _contract(
    indptr, indices, adjwgt, node_weight, train_weight, cluster, clusters, max_edges
):  # pragma: no cover - numba
    """The weighted graph of the clusters: (indptr, indices, edge weights, node weights, training weights).

    Two passes over the fine rows, cluster by cluster (members found by a counting sort):
    the first counts each cluster's distinct neighbouring clusters, the second fills them.
    Edges inside a cluster vanish. Lengths-0 weight arrays mean all ones (``train_weight``
    always has one entry per node). With more than ``max_edges`` coarse edges nothing is
    filled: indices and edge weights come back empty, ``indptr[-1]`` says how many there are.
    """
    n = indptr.shape[0] - 1
    unit_edges = adjwgt.shape[0] == 0
    unit_nodes = node_weight.shape[0] == 0
    start = np.zeros(clusters + 1, dtype=np.int64)
    for v in range(n):
        start[cluster[v] + 1] += 1
    for c in range(clusters):
        start[c + 1] += start[c]
    members = np.empty(n, dtype=np.int64)
    fill = start[:-1].copy()
    coarse_nodes = np.zeros(clusters, dtype=np.int64)
    coarse_train = np.zeros(clusters, dtype=np.int64)
    for v in range(n):
        c = cluster[v]
        members[fill[c]] = v
        fill[c] += 1
        coarse_nodes[c] += 1 if unit_nodes else node_weight[v]
        coarse_train[c] += train_weight[v]
    mark = np.full(clusters, -1, dtype=np.int64)
    coarse_indptr = np.zeros(clusters + 1, dtype=np.int64)
    for c in range(clusters):
        count = 0
        for m in range(start[c], start[c + 1]):
            v = members[m]
            for e in range(indptr[v], indptr[v + 1]):
                d = cluster[indices[e]]
                if d != c and mark[d] != c:
                    mark[d] = c
                    count += 1
        coarse_indptr[c + 1] = coarse_indptr[c] + count
    if coarse_indptr[clusters] > max_edges:
        return coarse_indptr, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), coarse_nodes, coarse_train
    coarse_indices = np.empty(coarse_indptr[clusters], dtype=np.int64)
    coarse_adjwgt = np.zeros(coarse_indptr[clusters], dtype=np.int64)
    slot = mark  # reused: position of neighbour cluster d in the current row, or -1
    slot[:] = -1
    for c in range(clusters):
        row = coarse_indptr[c]
        count = 0
        for m in range(start[c], start[c + 1]):
            v = members[m]
            for e in range(indptr[v], indptr[v + 1]):
                d = cluster[indices[e]]
                if d == c:
                    continue
                if slot[d] < 0:
                    slot[d] = row + count
                    coarse_indices[row + count] = d
                    count += 1
                coarse_adjwgt[slot[d]] += 1 if unit_edges else adjwgt[e]
        for t in range(row, row + count):
            slot[coarse_indices[t]] = -1
    return coarse_indptr, coarse_indices, coarse_adjwgt, coarse_nodes, coarse_train


@numba.njit(cache=True, nogil=True)
def _project(cluster, coarse_part):  # pragma: no cover - numba
    """``coarse_part[cluster[v]]`` for every node ``v`` of the finer level, int64."""
    part = np.empty(cluster.shape[0], dtype=np.int64)
    for v in range(cluster.shape[0]):
        part[v] = coarse_part[cluster[v]]
    return part


@numba.njit(cache=True, nogil=True)
def _move(v, source, target, part, size, train_size, train):  # pragma: no cover - numba
    """Move node ``v`` from part ``source`` to ``target``, keeping both parts' counts."""
    part[v] = target
    size[source] -= 1
    size[target] += 1
    train_size[source] -= train[v]
    train_size[target] += train[v]


@numba.njit(cache=True, nogil=True)
def _refine(indptr, indices, part, parts, train, cap_nodes, cap_train, order, rounds):  # pragma: no cover - numba
    """Greedy boundary moves that strictly lower the cut within both caps, then rebalancing; returns moves made."""
    n = indptr.shape[0] - 1
    size = np.zeros(parts, dtype=np.int64)
    train_size = np.zeros(parts, dtype=np.int64)
    for v in range(n):
        size[part[v]] += 1
        train_size[part[v]] += train[v]
    conn = np.zeros(parts, dtype=np.int64)
    total = 0
    for _ in range(rounds):
        moved = 0
        for i in range(n):
            v = order[i]
            p = part[v]
            start, end = indptr[v], indptr[v + 1]
            inside = 0
            for e in range(start, end):
                q = part[indices[e]]
                conn[q] += 1
                inside += q == p
            if inside < end - start:  # a boundary node
                best, best_conn = p, conn[p]
                for q in range(parts):
                    if (
                        conn[q] > best_conn
                        and size[q] + 1 <= cap_nodes
                        and (train[v] == 0 or train_size[q] + 1 <= cap_train)
                    ):
                        best, best_conn = q, conn[q]
                if best != p:
                    _move(v, p, best, part, size, train_size, train)
                    moved += 1
            for e in range(start, end):
                conn[part[indices[e]]] = 0
            conn[p] = 0
        total += moved
        if moved == 0:
            break
    # Rebalance: a part over a cap sends nodes to the best-connected part with room on both.
    # A training node leaving a part over the training cap may overfill a part by one node
    # (all others may be full); that part is then over the node cap and sheds a node itself.
    for _ in range(8 * rounds + 16):
        over = False
        for q in range(parts):
            over = over or size[q] > cap_nodes or train_size[q] > cap_train
        if not over:
            break
        for i in range(n):
            v = order[i]
            p = part[v]
            nodes_over = size[p] > cap_nodes
            if not (nodes_over or (train[v] != 0 and train_size[p] > cap_train)):
                continue
            node_room = cap_nodes if nodes_over else cap_nodes + 1
            for e in range(indptr[v], indptr[v + 1]):
                conn[part[indices[e]]] += 1
            best, best_conn = -1, -1
            for q in range(parts):
                if (
                    q != p
                    and conn[q] > best_conn
                    and size[q] + 1 <= node_room
                    and (train[v] == 0 or train_size[q] + 1 <= cap_train)
                ):
                    best, best_conn = q, conn[q]
            conn[:] = 0
            if best >= 0:
                _move(v, p, best, part, size, train_size, train)
                total += 1
    return total


def vertex_weights(num_nodes: int, node_weight: np.ndarray, train_weight: np.ndarray) -> tuple[np.ndarray, int]:
    """METIS' vertex weights ``[nodes, training nodes]`` per vertex, interleaved int64, and ``ncon``.

    ``node_weight`` of length 0 means one node per vertex. Without training nodes the second
    constraint would have zero total weight, which METIS rejects, so only node counts are
    balanced then (``ncon = 1``).
    """
    nodes = np.ones(num_nodes, dtype=np.int64) if node_weight.shape[0] == 0 else node_weight
    weights = [nodes, np.asarray(train_weight, dtype=np.int64)] if train_weight.any() else [nodes]
    return np.stack(weights, axis=1).reshape(-1), len(weights)


def balance_caps(num_nodes: int, num_train: int, parts: int) -> tuple[int, int]:
    """Most inner nodes and training nodes one part may hold: ``ceil(1.03 x mean)`` of each."""
    factor = 1.0 + BALANCE_TOLERANCE
    return math.ceil(factor * num_nodes / parts), math.ceil(factor * num_train / parts)


def coarse_assignment(
    graph: Graph,
    parts: int,
    objective: str,
    seed: int,
    metis: Callable[..., np.ndarray],
    *,
    memory_budget: int,
    coarse_nodes: int | None = None,
    progress: bool = True,
) -> np.ndarray:
    """Partition ``graph`` by METIS on its coarsening (module docstring); return ``assignment`` int64 [N].

    ``metis(xadj, adjncy, vwgt, ncon, adjwgt, parts, objective, seed)`` partitions a weighted
    graph (:func:`bnsgcn.partition.partitioner.metis_parts`). ``memory_budget`` (bytes) bounds
    METIS on the coarsest graph; a graph that cannot be coarsened that far is a
    :class:`UserError`. ``coarse_nodes`` (default :data:`COARSE_NODES`) is the most nodes
    the coarsest graph may keep.
    """
    coarse_nodes = COARSE_NODES if coarse_nodes is None else coarse_nodes
    num_nodes = graph.num_nodes
    rng = np.random.default_rng(seed)
    train = np.asarray(graph.train_mask, dtype=np.uint8)
    metis_budget = max(memory_budget - coarse_bytes(num_nodes), 0)
    empty = np.zeros(0, dtype=np.int64)
    # Level 0 is the input graph itself (unit weights); clusters[l] maps level-l nodes to level l+1.
    indptr, indices, adjwgt, node_weight, train_weight = graph.indptr, graph.indices, empty, empty, train
    clusters: list[np.ndarray] = []
    cap = max(1, math.ceil(num_nodes / coarse_nodes))
    cap_limit = max(1, num_nodes // (parts * MIN_CLUSTERS_PER_PART))
    level_nodes, level_edges = num_nodes, graph.num_edges
    # A coarse graph is held while the next level is built: it may take half the budget.
    max_coarse_edges = metis_budget // 2 // CONTRACT_BYTES_PER_EDGE
    while level_nodes > coarse_nodes or metis_bytes(level_nodes, level_edges) > metis_budget:
        cap = min(cap, cap_limit)
        with step(
            f"coarsening level {len(clusters) + 1}: {level_nodes:,} nodes, {level_edges:,} edges", enabled=progress
        ):
            order = rng.permutation(level_nodes)
            start = empty
            while True:
                cluster, count = _label_propagation(indptr, indices, adjwgt, node_weight, cap, order, LP_ROUNDS, start)
                # Too few clusters to balance, or too little progress at this cap: grow the cap instead.
                if count < parts * MIN_CLUSTERS_PER_PART or count > 0.95 * level_nodes:
                    coarse = None
                    break
                coarse = _contract(indptr, indices, adjwgt, node_weight, train_weight, cluster, count, max_coarse_edges)
                if coarse[1].shape[0] == coarse[0][-1] or cap >= cap_limit:
                    break
                # Too many coarse edges to hold (graphs without locality): merge the clusters further.
                start, cap = cluster, min(cap * CAP_GROWTH, cap_limit)
            del order, start
            if coarse is not None and coarse[1].shape[0] == coarse[0][-1]:
                indptr, indices, adjwgt, node_weight, train_weight = coarse
                clusters.append(cluster.astype(np.int32) if count < 2**31 else cluster)
                level_nodes, level_edges = count, int(indptr[-1])
            elif cap >= cap_limit:
                break
            del coarse, cluster
        cap *= CAP_GROWTH
    need = metis_bytes(level_nodes, level_edges) + coarse_bytes(num_nodes)
    if need > memory_budget:
        raise UserError(
            f"the coarsest graph ({level_nodes:,} nodes, {level_edges:,} edges) still needs about {format_bytes(need)} "
            f"for METIS, over the {format_bytes(memory_budget)} available; free memory, raise --memory-limit or use a "
            "larger machine"
        )
    with step(f"METIS on the coarsest graph: {level_nodes:,} nodes, {level_edges:,} edges", enabled=progress):
        vwgt, ncon = vertex_weights(level_nodes, node_weight, train_weight)
        part = metis(indptr, indices, vwgt, ncon, adjwgt if adjwgt.size else None, parts, objective, seed)
    del indptr, indices, adjwgt, node_weight, train_weight, vwgt
    for cluster in reversed(clusters):
        part = _project(cluster, np.asarray(part, dtype=np.int64))
    assignment = np.asarray(part, dtype=np.int64)
    cap_nodes, cap_train = balance_caps(num_nodes, int(train.sum()), parts)
    with step(f"refining {num_nodes:,} nodes ({REFINE_ROUNDS} rounds of boundary moves)", enabled=progress):
        order = rng.permutation(num_nodes)
        _refine(graph.indptr, graph.indices, assignment, parts, train, cap_nodes, cap_train, order, REFINE_ROUNDS)
    return assignment
