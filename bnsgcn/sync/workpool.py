r"""``--work-pool``: more partitions than ranks, handed out from a pool in the job's store.

The scheme of the thesis that trained Cluster-GCN partitions with gossip and a work pool (fast
workers take more partitions): a partition set of ``K``
parts trains on ``W <= K`` ranks. Each epoch's pool holds the ``K`` partition ids in an
order drawn from (``--seed``, epoch); a rank takes the next one with one atomic counter in
the store (``pool/<epoch>``: ``store.add`` hands out ``0, 1, 2, ...``, so every index, and
every partition, goes to exactly one rank), trains one step on it and takes the next, until
the pool is empty; a fast rank takes more. A step on partition ``k`` is exactly what a rank
owning ``k`` computes in a ``K``-rank job at ``p = 0``: the partition's own subgraph, edges
to other partitions dropped, normalised by full-graph degrees, its loss the mean over its
training nodes:

.. math::
    \mathcal{L}_k = \frac{1}{|T_k|} \sum_{v \in T_k} \ell(f_\theta(A_{kk}, X_k)_v, y_v)

(with the first layer's aggregation precomputed over the full graph where that is exact,
as always). The partitions' arrays are memory-mapped (:mod:`bnsgcn.data.format`): a rank touches
the pages of the partitions it takes, and builds each partition's graph once.

Evaluation stays exact over the full graph: rank ``r`` holds the union of the partitions
``{k : k mod W = r}`` as one shard (:func:`merge_partitions`), with the usual boundary
exchange between ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from bnsgcn.comm.communicator import Comm
from bnsgcn.comm.plan import empty_plan
from bnsgcn.config import check_pool_size
from bnsgcn.data.format import load_partition
from bnsgcn.data.sampler import derive_seed
from bnsgcn.data.shard import Shard, Topology, load_shard
from bnsgcn.errors import UserError
from bnsgcn.exchange.base import LocalExchange
from bnsgcn.nn.graph import EpochGraph
from bnsgcn.nn.layers import shard_graph

POOL_STREAM = 7  # derive_seed stream of the pool's order (the sampler uses 0, dropout 1)


def pool_groups(num_parts: int, world: int) -> list[list[int]]:
    """The partitions each rank holds for evaluation: ``k mod world = rank``."""
    return [list(range(rank, num_parts, world)) for rank in range(world)]


def pool_order(seed: int, epoch: int, num_parts: int) -> Tensor:
    """The pool's order of partition ids in ``epoch`` (int64 [K]), the same on every rank."""
    generator = torch.Generator().manual_seed(derive_seed(seed, 0, epoch, POOL_STREAM))
    return torch.randperm(num_parts, generator=generator)


@dataclass
class PartInputs:
    """One partition's step: its graph (boundary columns never kept: the same every step),
    node data and the precomputed first-layer aggregation (None when the model uses none)."""

    part: int
    graph: EpochGraph
    features: Tensor  # float32 [n_inner, F]
    x_agg: Tensor | None  # float32 [n_inner, F]
    labels: Tensor
    train_index: Tensor  # int64 [n_train]: rows with a training label

    @property
    def num_train(self) -> int:
        return int(self.train_index.numel())


class WorkPool:
    """The job's pool of partitions (see the module): every rank loads every partition
    (memory-mapped) and builds a partition's inputs the first time it takes it."""

    def __init__(
        self, comm: Comm, parts_dir: Path, model: str, precompute: bool, seed: int, verify: bool = False
    ) -> None:
        self.comm, self.parts_dir, self.model, self.precompute, self.seed = (
            comm,
            Path(parts_dir),
            model,
            precompute,
            seed,
        )
        first = load_shard(parts_dir, 0, None, verify=verify)
        self.num_parts = first.num_parts
        check_pool_size(self.num_parts, comm.world_size, parts_dir)
        self.shards = [first] + [
            load_shard(parts_dir, k, self.num_parts, verify=verify) for k in range(1, self.num_parts)
        ]
        self._inputs: dict[int, PartInputs] = {}
        self._order: tuple[int, list[int]] | None = None
        self.taken: dict[int, list[int]] = {}  # epoch -> the partitions this rank took

    def take(self, epoch: int) -> tuple[int, int] | None:
        """The next (pool index, partition id) of ``epoch``'s pool, or None once it is empty."""
        index = self.comm.store.add(f"pool/{epoch}", 1) - 1
        if index >= self.num_parts:
            return None
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, pool_order(self.seed, epoch, self.num_parts).tolist())
        part = self._order[1][index]
        self.taken.setdefault(epoch, []).append(part)
        return index, part

    def inputs(self, part: int) -> PartInputs:
        """Partition ``part``'s step inputs (built once, then kept)."""
        if part not in self._inputs:
            self._inputs[part] = self._build(part)
        return self._inputs[part]

    def _build(self, part: int) -> PartInputs:
        shard = self.shards[part]
        device = self.comm.device
        graph = shard_graph(shard.topology, self.model, device)
        x_agg = None
        if self.precompute:
            with torch.no_grad():
                x_agg = graph.aggregate(shard.features.to(device), self._boundary_features(part).to(device))
        no_boundary = torch.zeros(shard.topology.n_boundary, dtype=torch.bool)
        step_graph = graph.epoch(no_boundary, 0.0, empty_plan(shard.topology, device), LocalExchange())
        train_index = shard.train_mask.nonzero().flatten().to(device)
        return PartInputs(part, step_graph, shard.features.to(device), x_agg, shard.labels.to(device), train_index)

    def _boundary_features(self, part: int) -> Tensor:
        """Features of partition ``part``'s boundary nodes [n_boundary, F], read from their
        owners' arrays: owner q's send list for ``part`` names the rows in ``part``'s order."""
        blocks = []
        for q, count in enumerate(self.shards[part].topology.boundary_counts):
            if count:
                owner = self.shards[q]
                start = sum(owner.topology.send_counts[:part])
                blocks.append(
                    owner.features[owner.topology.send_nodes[start : start + owner.topology.send_counts[part]]]
                )
        features = self.shards[part].features
        return torch.cat(blocks) if blocks else features.new_zeros((0, features.shape[1]))

    def adjacency_tensors(self) -> list[Tensor | None]:
        """The graphs of the partitions built so far (for memory accounting)."""
        return [
            t
            for i in self._inputs.values()
            for adj in (i.graph.inner, i.graph.boundary, i.graph.full)
            if adj is not None
            for t in adj.tensors()
        ]

    def precomputed_tensors(self) -> list[Tensor | None]:
        return [i.x_agg for i in self._inputs.values()]

    def merged_shard(self) -> Shard:
        """This rank's evaluation shard: :func:`merge_partitions` of its pool group."""
        rank, world = self.comm.rank, self.comm.world_size
        ids = {}
        for k in pool_groups(self.num_parts, world)[rank]:
            arrays = load_partition(self.parts_dir, k)  # memory-mapped: only the ids are read
            ids[k] = (arrays["inner_nodes"], arrays["boundary_nodes"])
        return merge_partitions(self.shards, ids, rank, world)


def merge_partitions(
    shards: list[Shard], ids: dict[int, tuple[np.ndarray, np.ndarray]], rank: int, world: int
) -> Shard:
    """The union of the partitions ``k mod world = rank`` of a ``K``-part set, as the shard
    of rank ``rank`` in a ``world``-rank job (columns: the parts' inner nodes in part order,
    then boundary nodes grouped by owner *rank*, ascending global id within an owner, the
    order both sides derive on their own). ``ids[k]``: the global ids of partition ``k``'s
    inner and boundary nodes, for this rank's parts.

    A boundary node of one of this rank's parts owned by another of them becomes an inner
    column; the owner's send list for the requesting part gives its row. The send list to
    rank ``o``: every row of this rank's parts that a part of ``o`` lists as boundary, in
    global-id order. Degrees are the full graph's, as in every partition.
    """
    mine = pool_groups(len(shards), world)[rank]
    group_of = np.arange(len(shards)) % world
    sizes = [shards[k].topology.n_inner for k in mine]
    offset = dict(zip(mine, np.cumsum([0, *sizes[:-1]]).tolist()))
    n_inner = sum(sizes)

    # boundary nodes owned by other ranks: keys (owner rank << 40 | global id), unique, sorted
    def external(k: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions in k's boundary, keys) of k's boundary nodes owned by other ranks."""
        owners = np.repeat(group_of, shards[k].topology.boundary_counts)
        outside = np.flatnonzero(owners != rank)
        return outside, (owners[outside].astype(np.int64) << 40) | ids[k][1][outside]

    keys = np.unique(np.concatenate([external(k)[1] for k in mine])) if mine else np.empty(0, np.int64)
    boundary_counts = np.bincount((keys >> 40).astype(np.int64), minlength=world).tolist()
    n_boundary = len(keys)
    if n_inner + n_boundary >= 2**31:
        raise UserError(
            f"rank {rank}'s union of partitions has {n_inner + n_boundary} columns, beyond int32 indices; use fewer "
            "parts per rank (more ranks)"
        )

    indptr, indices, degree_boundary = [np.zeros(1, np.int64)], [], np.zeros(n_boundary, np.float32)
    for k in mine:
        topo = shards[k].topology
        column = np.empty(topo.n_inner + topo.n_boundary, np.int64)
        column[: topo.n_inner] = offset[k] + np.arange(topo.n_inner)
        start = topo.n_inner
        for q, count in enumerate(topo.boundary_counts):
            if count and group_of[q] == rank:  # another of this rank's parts: an inner column
                owner = shards[q].topology
                first = sum(owner.send_counts[:k])
                column[start : start + count] = offset[q] + owner.send_nodes[first : first + count].numpy()
            start += count
        outside, outside_keys = external(k)
        column[topo.n_inner + outside] = n_inner + np.searchsorted(keys, outside_keys)
        degree_boundary[np.searchsorted(keys, outside_keys)] = topo.degree.numpy()[topo.n_inner + outside]
        indptr.append(topo.indptr[1:].numpy() + indptr[-1][-1])
        indices.append(column[topo.indices.numpy()].astype(np.int32))

    send_nodes, send_counts = [], []
    for other in range(world):
        rows, global_ids = [], []
        for k in mine if other != rank else []:
            topo = shards[k].topology
            bounds = np.cumsum([0, *topo.send_counts])
            for q in pool_groups(len(shards), world)[other]:
                local = topo.send_nodes[bounds[q] : bounds[q + 1]].numpy()
                rows.append(offset[k] + local)
                global_ids.append(ids[k][0][local])
        if rows:
            _, first = np.unique(np.concatenate(global_ids), return_index=True)  # global-id order
            send_nodes.append(np.concatenate(rows)[first])
        send_counts.append(len(send_nodes[-1]) if rows else 0)

    indptr = np.concatenate(indptr)
    indices = np.concatenate(indices) if indices else np.zeros(0, np.int32)
    rows = np.repeat(np.arange(n_inner), np.diff(indptr))
    indices = indices[np.lexsort((indices, rows))]  # the format's CSR: columns ascending in a row
    parts = [shards[k] for k in mine]
    topology = Topology(
        n_inner=n_inner,
        indptr=torch.from_numpy(indptr),
        indices=torch.from_numpy(indices),
        degree=torch.cat(
            [*(s.topology.degree[: s.topology.n_inner] for s in parts), torch.from_numpy(degree_boundary)]
        ),
        boundary_counts=boundary_counts,
        send_nodes=torch.from_numpy(np.concatenate(send_nodes) if send_nodes else np.zeros(0, np.int64)),
        send_counts=send_counts,
    )
    cat = lambda name: torch.cat([getattr(s, name) for s in parts])  # noqa: E731
    return Shard(
        part=rank,
        num_parts=world,
        manifest=shards[0].manifest,
        topology=topology,
        features=cat("features"),
        labels=cat("labels"),
        train_mask=cat("train_mask"),
        val_mask=cat("val_mask"),
        test_mask=cat("test_mask"),
    )
