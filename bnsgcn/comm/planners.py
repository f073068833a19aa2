"""Exchange plans: direct, or node-aware (hierarchical) when ranks share machines.

Direct: every boundary row travels from its owner to each rank that sampled it. When k
ranks of one remote node sampled the same row, it crosses the slow link between machines
k times.

Node-aware (the DGCL idea, specialised to two levels): the row crosses once, to one of those
k ranks, its *delegate*, which relays it to the other k - 1 over the node's fast local path
(:class:`~bnsgcn.comm.plan.Relay`). Backward, the k gradient rows are summed at the delegate
and one row crosses back. Inter-node rows per layer drop from the sum over remote ranks to
the size of the union over remote nodes, by the boundary rows' replication factor.

Delegates, with no message beyond the direct plan's: owner q's candidate rows for node N
form ``union(N, q)``, sorted by q's local row index (every rank of N sorts its copy the
same way: boundary nodes are numbered by global id, and q's inner rows ascend in global
id). The row at position i there, sampled this epoch by the ranks S of N (node-local
indices, ascending), goes to ``S[i mod |S|]``, which spreads relaying over the node. An
owner learns S from the selections all-to-all it already takes part in; the ranks of N
share their selections of union rows with one all-gather inside the node.
"""

from __future__ import annotations

from typing import Protocol

import torch

from bnsgcn.comm.communicator import Comm
from bnsgcn.comm.plan import (
    ExchangePlan,
    Relay,
    empty_plan,
    exchange_selections,
    fetch_boundary,
    full_plan,
    make_plan,
    pack_segments,
    unpack_segments,
)
from bnsgcn.data.shard import Topology

_ROW_BITS = 40  # a union key is (owner or node) << 40 | row: rows below 2**40


def resolve_mode(mode: str, comm: Comm) -> str:
    """``auto`` is hierarchical when the job spans several nodes and some node runs several ranks."""
    if mode == "auto":
        return "hierarchical" if comm.nodes.spans_machines_with_shared_nodes else "direct"
    return mode


class Planner(Protocol):
    """Makes the exchange plans of one topology."""

    def full(self) -> ExchangePlan:
        """Every boundary row (p = 1, evaluation)."""

    def sample(self, keep: torch.Tensor, p: float) -> ExchangePlan:
        """The plan for boundary columns ``keep`` (bool [n_boundary]) drawn with probability
        ``p``; all ranks call together."""


class DirectPlanner:
    """Direct plans (:func:`bnsgcn.comm.plan.make_plan`)."""

    def __init__(self, comm: Comm, topology: Topology) -> None:
        self.comm, self.topology = comm, topology
        self._full = full_plan(topology, comm.device)

    def full(self) -> ExchangePlan:
        """Every boundary row (p = 1, evaluation)."""
        return self._full

    def sample(self, keep: torch.Tensor, p: float) -> ExchangePlan:
        """The plan for boundary columns ``keep`` (bool [n_boundary]); all ranks call together."""
        return self._full if p >= 1.0 else make_plan(self.comm, self.topology, keep, p)


class NodeAwarePlanner:
    """Node-aware plans for one topology. Building one is collective (one all-to-all to learn
    the owners' row numbers of boundary nodes, two all-gathers inside each node)."""

    def __init__(self, comm: Comm, topology: Topology) -> None:
        self.comm, self.topology = comm, topology
        nodes = comm.nodes
        world = comm.world_size
        node_of = torch.tensor(nodes.node_of, dtype=torch.int64)
        self._members = torch.full((nodes.count, max(len(m) for m in nodes.members)), -1, dtype=torch.int64)
        node_index = torch.empty(world, dtype=torch.int64)  # position of each rank in its node
        for n, members in enumerate(nodes.members):
            self._members[n, : len(members)] = torch.tensor(members)
            node_index[list(members)] = torch.arange(len(members))

        # As a requester: boundary columns owned by ranks of other nodes, keyed by owner and
        # the owner's row; the node's union of those keys, and who of the node has each.
        self._column_owner = torch.repeat_interleave(
            torch.arange(world), torch.tensor(topology.boundary_counts, dtype=torch.int64)
        )
        self._remote_column = node_of[self._column_owner] != comm.node
        owner_row = fetch_boundary(comm, topology, torch.arange(topology.n_inner, dtype=torch.int64))
        keys = (self._column_owner[self._remote_column] << _ROW_BITS) | owner_row[self._remote_column]
        peer_keys = _gather_within_node(comm, keys)
        union = torch.unique(torch.cat(peer_keys))
        self._column_union = torch.full((topology.n_boundary,), -1, dtype=torch.int64)
        self._column_union[self._remote_column] = torch.searchsorted(union, keys)
        self._presence = torch.zeros(len(peer_keys), union.numel(), dtype=torch.bool)
        for local, peer in enumerate(peer_keys):
            self._presence[local, torch.searchsorted(union, peer)] = True
        self._union_owner = union >> _ROW_BITS
        self._union_position = _position_in_group(self._union_owner)

        # As an owner: candidate rows per remote node (send entries to ranks of other nodes).
        destination = torch.repeat_interleave(
            torch.arange(world), torch.tensor(topology.send_counts, dtype=torch.int64)
        )
        self._remote_entry = node_of[destination] != comm.node
        self._local_entry_destination = destination[~self._remote_entry]
        self._local_entry_row = topology.send_nodes[~self._remote_entry]
        node_rows = (node_of[destination[self._remote_entry]] << _ROW_BITS) | topology.send_nodes[self._remote_entry]
        out_union, self._entry_column = torch.unique(node_rows, return_inverse=True)
        self._out_node = out_union >> _ROW_BITS
        self._out_row = out_union & ((1 << _ROW_BITS) - 1)
        self._out_position = _position_in_group(self._out_node)
        self._entry_requester = node_index[destination[self._remote_entry]]
        self._full: ExchangePlan | None = None

    def full(self) -> ExchangePlan:
        """Every boundary row (p = 1, evaluation): known without communication."""
        if self._full is None:
            everything = torch.ones(self.topology.n_boundary, dtype=torch.bool)
            every_entry = torch.ones(self.topology.send_nodes.numel(), dtype=torch.bool)
            self._full = self._plan(every_entry, self._presence, everything)
        return self._full

    def sample(self, keep: torch.Tensor, p: float) -> ExchangePlan:
        """The plan for boundary columns ``keep`` (bool [n_boundary]) drawn with probability
        ``p``: the selections all-to-all of the direct plan, plus one all-gather of this
        node's selections of union rows inside the node. All ranks call together."""
        if p >= 1.0:
            return self.full()
        if p <= 0.0:
            return empty_plan(self.topology, self.comm.device)
        wanted = exchange_selections(self.comm, self.topology, keep)
        ranks_here, union_size = self._presence.shape
        node_wanted = torch.zeros(ranks_here, union_size, dtype=torch.bool)
        if union_size:  # the same on every rank of the node: all gather, or none
            mine = torch.zeros(union_size, dtype=torch.bool)
            mine[self._column_union[keep & self._remote_column]] = True
            gathered = self.comm.all_gather_within_node(
                pack_segments(mine, [union_size]).to(self.comm.device, non_blocking=True), "selections"
            ).cpu()
            node_wanted = unpack_segments(gathered.flatten(), [union_size] * ranks_here).view(ranks_here, union_size)
        return self._plan(wanted, node_wanted, keep)

    def _plan(self, wanted: torch.Tensor, node_wanted: torch.Tensor, keep: torch.Tensor) -> ExchangePlan:
        """The plan from what each requester wants of this rank's rows (``wanted``, bool
        [sum(send_counts)]), what each rank of this node wants of the union rows
        (``node_wanted``, bool [ranks on node, union]) and this rank's columns ``keep``."""
        world, device = self.comm.world_size, self.comm.device

        # Sending: local requesters directly; a remote node's union rows to their delegates.
        requested = torch.zeros(self._members.shape[1], self._out_row.numel(), dtype=torch.bool)
        requested[self._entry_requester, self._entry_column] = wanted[self._remote_entry]
        delegate = _delegates(requested, self._out_position)
        chosen = delegate >= 0
        local = wanted[~self._remote_entry]
        destination = torch.cat(
            [self._local_entry_destination[local], self._members[self._out_node[chosen], delegate[chosen]]]
        )
        rows = torch.cat([self._local_entry_row[local], self._out_row[chosen]])
        by_destination = torch.argsort(destination, stable=True)
        send_counts = torch.bincount(destination, minlength=world).tolist()

        # Receiving, first stage: from owners on this node the kept columns (column order);
        # from owners elsewhere the union rows this rank is delegate of (union order).
        me = self.comm.node_rank
        node_delegate = _delegates(node_wanted, self._union_position)
        mine = torch.nonzero(node_delegate == me).flatten()
        local_columns = torch.nonzero(keep & ~self._remote_column).flatten()
        item_owner = torch.cat([self._column_owner[local_columns], self._union_owner[mine]])
        item_order = torch.cat([local_columns, mine])
        arrival = _ranks_of(
            torch.argsort(
                item_owner * (item_order.numel() + self._union_owner.numel() + self.topology.n_boundary) + item_order
            )
        )
        recv_counts = torch.bincount(item_owner, minlength=world).tolist()
        first_stage = sum(recv_counts)
        position = torch.full((self._union_owner.numel(),), -1, dtype=torch.int64)
        position[mine] = arrival[local_columns.numel() :]

        # Relay: hand delegated rows on to the node's other ranks that want them; take the
        # rows others are delegates of. Both grouped by node rank, union order inside.
        hand_on = node_wanted & (node_delegate == me).unsqueeze(0)
        hand_on[me] = False
        to_rank, union_index = torch.nonzero(hand_on, as_tuple=True)
        incoming = node_wanted[me] & (node_delegate >= 0) & (node_delegate != me)
        from_union = torch.nonzero(incoming).flatten()
        from_rank = node_delegate[from_union]
        by_source = torch.argsort(from_rank, stable=True)
        position[from_union[by_source]] = first_stage + torch.arange(from_union.numel())

        kept = torch.nonzero(keep).flatten()
        order = torch.empty(kept.numel(), dtype=torch.int64)
        remote = self._remote_column[kept]
        order[~remote] = arrival[: local_columns.numel()]
        order[remote] = position[self._column_union[kept[remote]]]
        ranks_here = node_wanted.shape[0]
        relay = Relay(
            send_index=position[union_index].to(device, non_blocking=True),
            send_counts=torch.bincount(to_rank, minlength=ranks_here).tolist(),
            recv_counts=torch.bincount(from_rank, minlength=ranks_here).tolist(),
            order=order.to(device, non_blocking=True),
        )
        return ExchangePlan(rows[by_destination].to(device, non_blocking=True), send_counts, recv_counts, relay)


def _delegates(wanted: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """For each column of ``wanted`` (bool [ranks, rows]), the rank that receives it: the
    ``position mod count``-th of the ranks that want it (ascending); -1 where none does."""
    count = wanted.sum(0)
    pick = position % count.clamp(min=1) + 1
    # The chosen rank is the first whose running count of wanting ranks reaches pick, i.e.
    # the number of ranks before it, whose running count is still below (a sum, not an
    # argmax over the short first dimension, which is 10x slower).
    delegate = (wanted.cumsum(0) < pick).sum(0)
    delegate[count == 0] = -1
    return delegate


def _position_in_group(groups: torch.Tensor) -> torch.Tensor:
    """For sorted group ids, each entry's position inside its group: [0, 1, 0, 1, 2] for [3, 3, 5, 5, 5]."""
    return torch.arange(groups.numel()) - torch.searchsorted(groups, groups)


def _ranks_of(permutation: torch.Tensor) -> torch.Tensor:
    """Inverse of a permutation: where each item lands when ``permutation`` orders them."""
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(permutation.numel())
    return inverse


def _gather_within_node(comm: Comm, values: torch.Tensor) -> list[torch.Tensor]:
    """Every rank of this node's ``values`` (int64, lengths may differ), in node-rank order."""
    lengths = (
        comm.all_gather_within_node(torch.tensor([values.numel()], device=comm.device), "control").flatten().tolist()
    )
    padded = torch.zeros(max(max(lengths), 1), dtype=torch.int64)
    padded[: values.numel()] = values
    gathered = comm.all_gather_within_node(padded.to(comm.device), "control").cpu()
    return [row[:n] for row, n in zip(gathered, lengths)]


def make_planner(comm: Comm, topology: Topology, mode: str) -> Planner:
    """The planner of an exchange ``mode`` (already resolved: direct or hierarchical)."""
    return NodeAwarePlanner(comm, topology) if mode == "hierarchical" else DirectPlanner(comm, topology)
