"""Exchange plans: which boundary rows each rank sends to which rank in one pass.

A plan comes from the epoch's boundary sample: each rank tells the owners which of their
rows it kept (one bit per boundary node, :func:`exchange_selections`), and learns which
of its own rows the others kept. At p = 1 and p = 0 every rank knows the plan without a
message. A node-aware plan (:mod:`bnsgcn.comm.planners`) adds a second, node-local stage
(:class:`Relay`). :func:`fetch_boundary` moves values of every boundary node once, at setup.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from bnsgcn.comm.communicator import Comm
from bnsgcn.data.shard import Topology, segment_counts


@dataclass(frozen=True)
class Relay:
    """The second, node-local stage of a node-aware plan.

    ``send_index`` int64 [sum(send_counts)]: rows of the first stage's receive buffer to hand
    on, grouped by destination (``send_counts[l]`` to the l-th rank of this node);
    ``recv_counts[l]``: rows arriving from the l-th rank of this node. ``order`` int64
    [n_rows]: for each sampled boundary node, in column order, its row in the first stage's
    rows followed by the relayed ones (a permutation: every row received is used once).
    """

    send_index: torch.Tensor
    send_counts: list[int]
    recv_counts: list[int]
    order: torch.Tensor


@dataclass(frozen=True)
class ExchangePlan:
    """Who sends which rows to whom this epoch.

    ``send_index`` int64 [sum(send_counts)]: inner rows to send, grouped by destination
    rank; ``recv_counts[q]``: rows arriving from rank q. Without ``relay`` these are the
    sampled boundary nodes owned by q, in column order; with it, see :class:`Relay`.
    """

    send_index: torch.Tensor
    send_counts: list[int]
    recv_counts: list[int]
    relay: Relay | None = None

    @property
    def num_received(self) -> int:
        """Rows of sampled boundary nodes this rank receives (both stages)."""
        return sum(self.recv_counts) + (sum(self.relay.recv_counts) if self.relay else 0)


def full_plan(topology: Topology, device: torch.device) -> ExchangePlan:
    """Every boundary row (p = 1, evaluation, precomputation): known without communication."""
    return ExchangePlan(topology.send_nodes.to(device), list(topology.send_counts), list(topology.boundary_counts))


def empty_plan(topology: Topology, device: torch.device) -> ExchangePlan:
    """No boundary row at all (p = 0)."""
    zeros = [0] * len(topology.send_counts)
    return ExchangePlan(torch.empty(0, dtype=torch.int64, device=device), zeros, list(zeros))


def exchange_selections(comm: Comm, topology: Topology, keep: torch.Tensor) -> torch.Tensor:
    """Tell owners which boundary rows this rank kept (one bit per boundary node) and learn
    which of its send candidates the others kept: bool [sum(send_counts)] (on the CPU).
    All ranks must call this together."""
    # The bits travel on the communication device; packing, unpacking and the topology
    # stay on the CPU (no-op moves there). Copies to the device are non-blocking: a
    # blocking one waits for the device's queue (pageable memory is staged at once, so the
    # source may change after the call).
    kept_bits = pack_segments(keep, topology.boundary_counts).to(comm.device, non_blocking=True)
    wanted_bits = torch.empty(sum(_packed_sizes(topology.send_counts)), dtype=torch.uint8, device=comm.device)
    comm.all_to_all(
        kept_bits,
        _packed_sizes(topology.boundary_counts),
        _packed_sizes(topology.send_counts),
        wanted_bits,
        "selections",
    )
    return unpack_segments(wanted_bits.cpu(), topology.send_counts)


def make_plan(comm: Comm, topology: Topology, keep: torch.Tensor, p: float) -> ExchangePlan:
    """The direct plan for boundary columns ``keep`` (bool [n_boundary]) drawn with
    probability ``p``: every row travels from its owner straight to each rank that kept it.

    At p = 1 and p = 0 every rank knows the plan already; otherwise the selections are
    exchanged (:func:`exchange_selections`). All ranks must call this together.
    """
    if p >= 1.0:
        return full_plan(topology, comm.device)
    if p <= 0.0:
        return empty_plan(topology, comm.device)
    wanted = exchange_selections(comm, topology, keep)
    return ExchangePlan(
        send_index=topology.send_nodes[wanted].to(comm.device, non_blocking=True),
        send_counts=segment_counts(wanted, topology.send_counts),
        recv_counts=segment_counts(keep, topology.boundary_counts),
    )


def _packed_sizes(counts: list[int]) -> list[int]:
    return [(n + 7) // 8 for n in counts]


def pack_segments(mask: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """One bit per entry of ``mask`` (bool [sum(counts)], on the CPU), the first of each byte
    the highest, each segment starting on a byte boundary: uint8 [sum(ceil(n / 8))].
    (numpy's bit packing: 0.05 ms for 100,000 entries, where scattering them into a padded
    byte array took about 2 ms of every epoch.)"""
    bits = mask.numpy()
    starts = itertools.accumulate(counts, initial=0)
    return torch.from_numpy(
        np.concatenate(
            [np.packbits(bits[start : start + n]) for start, n in zip(starts, counts)] or [np.empty(0, np.uint8)]
        )
    )


def unpack_segments(packed: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Inverse of :func:`pack_segments` (``packed`` on the CPU): bool [sum(counts)]."""
    bytes_, sizes = packed.numpy(), _packed_sizes(counts)
    starts = itertools.accumulate(sizes, initial=0)
    bits = [np.unpackbits(bytes_[start : start + size], count=n) for start, size, n in zip(starts, sizes, counts)]
    return torch.from_numpy(np.concatenate(bits or [np.empty(0, np.uint8)]).view(np.bool_))


@torch.no_grad()
def fetch_boundary(comm: Comm, topology: Topology, values_inner: torch.Tensor) -> torch.Tensor:
    """Values of every boundary node from its owner, once (setup, no autograd).

    ``values_inner`` [n_inner, *row] -> [n_boundary, *row], on the device of
    ``values_inner`` (the CPU for topology data, such as degrees); the rows travel on
    ``comm.device``.
    """
    plan = full_plan(topology, comm.device)
    send = values_inner.to(comm.device).index_select(0, plan.send_index)
    out = send.new_empty((plan.num_received, *values_inner.shape[1:]))
    return comm.all_to_all(send, plan.send_counts, plan.recv_counts, out, "control").to(values_inner.device)
