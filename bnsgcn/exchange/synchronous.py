"""Moving boundary rows between ranks: plans, the autograd exchange, reusable buffers.

Forward, each owner sends the rows of its inner nodes that other ranks sampled this
epoch; backward, the gradients of those rows travel back and are added into the owner's
inner-row gradients. One all-to-all per layer and direction, plus, in a node-aware plan
(:mod:`bnsgcn.comm.planners`), one more among the ranks of each node that relays rows which
crossed the network once to the other ranks of the node needing them. Rows whose zero
entries need no gradient (ReLU outputs) may cross as their nonzero entries and a bitmap
(:func:`start_nonzero_rows`): one small all-to-all of counts and two more per layer.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

from bnsgcn.comm.communicator import Comm
from bnsgcn.comm.wire import EXACT, WireFormat
from bnsgcn.data.shard import Topology, segment_counts
from bnsgcn.kernels import Adjacency, kernel_backend, spmm, spmm_add_


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


def resolve_nonzero_rows(setting: str, comm: Comm) -> str:
    """``--nonzero-rows auto`` is on when the job spans several machines: between them the
    bytes saved cost more than packing and unpacking the rows; over one machine's loopback
    or NVLink they do not (docs/benchmarks.md, "Results: rows as their nonzero entries")."""
    if setting == "auto":
        return "on" if comm.nodes.count > 1 else "off"
    return setting


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


class Buffer:
    """Flat byte storage that grows as needed and hands out contiguous views of it, of any
    dtype (so one buffer serves rows and gradients of different wire formats)."""

    def __init__(self) -> None:
        self.storage: torch.Tensor | None = None  # uint8
        self.largest = 0  # bytes of the largest storage it has held (for the memory report)

    def view(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        s = self.storage
        if s is None or s.numel() < nbytes or s.device != device:
            self.storage = s = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
            self.largest = max(self.largest, s.numel())
        return s[:nbytes].view(dtype).view(shape)


def start_rows(
    comm: Comm,
    x_inner: torch.Tensor,
    plan: ExchangePlan,
    wire: WireFormat,
    send_buffer: Buffer,
    recv_buffer: Buffer,
    category: str,
    pipelined: bool = False,
) -> tuple[object, torch.Tensor]:
    """Encode the rows ``plan`` sends from ``x_inner`` [n_inner, *row] into ``send_buffer``
    and start the first stage's all-to-all. Returns the started work and the buffer
    [plan.num_received, *wire row] the rows land in (the network's first, the relayed ones
    after them, see :func:`start_row_relay`). Both buffers stay in use until the work is waited for."""
    row = tuple(x_inner.shape[1:])
    wire_row, wire_dtype = wire.wire_shape(row), wire.wire_dtype(x_inner.dtype)
    send = send_buffer.view((plan.send_index.numel(), *wire_row), wire_dtype, x_inner.device)
    if wire.exact:
        torch.index_select(x_inner, 0, plan.send_index, out=send)
    else:
        wire.encode(x_inner.index_select(0, plan.send_index), send)
    arrived = recv_buffer.view((plan.num_received, *wire_row), wire_dtype, x_inner.device)
    work = comm.all_to_all_start(
        send, plan.send_counts, plan.recv_counts, arrived[: sum(plan.recv_counts)], category, pipelined=pipelined
    )
    return work, arrived


def start_row_relay(
    comm: Comm, plan: ExchangePlan, arrived: torch.Tensor, send_buffer: Buffer, category: str, pipelined: bool = False
):
    """Once the first stage has arrived: hand its rows on inside the node (second stage).
    ``send_buffer`` (the first stage's, free again) carries them. Returns the work."""
    relay, first = plan.relay, sum(plan.recv_counts)
    hand_on = send_buffer.view((relay.send_index.numel(), *arrived.shape[1:]), arrived.dtype, arrived.device)
    torch.index_select(arrived[:first], 0, relay.send_index, out=hand_on)
    return comm.all_to_all_start(
        hand_on, relay.send_counts, relay.recv_counts, arrived[first:], category, within_node=True, pipelined=pipelined
    )


def in_column_order(plan: ExchangePlan, rows: torch.Tensor) -> torch.Tensor:
    """Both stages' rows [plan.num_received, *row], as they arrived, in column order."""
    return rows if plan.relay is None else rows.index_select(0, plan.relay.order)


def decode_rows(
    plan: ExchangePlan, arrived: torch.Tensor, wire: WireFormat, row: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """Both stages' rows, all arrived, decoded: [plan.num_received, *row] in column order."""
    return in_column_order(plan, wire.decode(arrived, row, dtype))


def relay_rows(comm: Comm, plan: ExchangePlan, arrived: torch.Tensor, send_buffer: Buffer, category: str) -> None:
    """Once the first stage has arrived in ``arrived``, relay its rows inside the node and
    wait for the second stage (nothing without a relay)."""
    if plan.relay is not None:
        comm.wait(start_row_relay(comm, plan, arrived, send_buffer, category), category)


def finish_rows(
    comm: Comm,
    plan: ExchangePlan,
    work,
    arrived: torch.Tensor,
    send_buffer: Buffer,
    wire: WireFormat,
    row: tuple[int, ...],
    dtype: torch.dtype,
    category: str,
) -> torch.Tensor:
    """Wait for rows started by :func:`start_rows`, relay them inside the node, decode them."""
    comm.wait(work, category)
    relay_rows(comm, plan, arrived, send_buffer, category)
    return decode_rows(plan, arrived, wire, row, dtype)


def start_grad_relay(
    comm: Comm, plan: ExchangePlan, grad_rows: torch.Tensor, buffers: GradBuffers, pipelined: bool = False
) -> tuple[object, torch.Tensor]:
    """The gradients ``grad_rows`` [plan.num_received, *row] (column order) of relayed rows
    go back to the ranks that relayed them. Returns the work and the gradients in buffer
    order (its first stage's part is completed by :func:`finish_grad_relay`)."""
    relay = plan.relay
    arrived = torch.empty_like(grad_rows).index_copy_(0, relay.order, grad_rows)
    relayed = buffers.relay.view((relay.send_index.numel(), *grad_rows.shape[1:]), grad_rows.dtype, grad_rows.device)
    work = comm.all_to_all_start(
        arrived[sum(plan.recv_counts) :],
        relay.recv_counts,
        relay.send_counts,
        relayed,
        "gradients",
        within_node=True,
        pipelined=pipelined,
    )
    return work, arrived


def finish_grad_relay(
    comm: Comm, plan: ExchangePlan, work, arrived: torch.Tensor, buffers: GradBuffers
) -> torch.Tensor:
    """Wait for the relayed gradients and add them, in float32, to the rows this rank had
    relayed: the first stage's gradients [sum(plan.recv_counts), *row]."""
    comm.wait(work, "gradients")
    first = arrived[: sum(plan.recv_counts)]
    relayed = buffers.relay.view((plan.relay.send_index.numel(), *arrived.shape[1:]), arrived.dtype, arrived.device)
    return first.index_add_(0, plan.relay.send_index, relayed)


def start_first_grads(
    comm: Comm,
    plan: ExchangePlan,
    first_grads: torch.Tensor,
    wire: WireFormat,
    buffers: GradBuffers,
    pipelined: bool = False,
) -> tuple[object, torch.Tensor, torch.Tensor]:
    """Start sending the first stage's gradients [sum(plan.recv_counts), *row] to the owners.
    Returns the work, the tensor being sent (keep it alive until the work is done) and the
    buffer the owner's gradients land in [plan.send_index.numel(), *wire row]."""
    wire_row, wire_dtype = wire.wire_shape(tuple(first_grads.shape[1:])), wire.wire_dtype(first_grads.dtype)
    if not wire.exact:
        first_grads = wire.encode(
            first_grads, buffers.send.view((first_grads.shape[0], *wire_row), wire_dtype, first_grads.device)
        )
    received = buffers.recv.view((plan.send_index.numel(), *wire_row), wire_dtype, first_grads.device)
    work = comm.all_to_all_start(
        first_grads, plan.recv_counts, plan.send_counts, received, "gradients", pipelined=pipelined
    )
    return work, first_grads, received


def first_stage_grads(comm: Comm, plan: ExchangePlan, grad_rows: torch.Tensor, buffers: GradBuffers) -> torch.Tensor:
    """The gradients of the rows that crossed to this rank [sum(plan.recv_counts), *row]
    from those of all received rows ``grad_rows`` (column order): with a relay, the relayed
    rows' gradients sent back inside the node (waited for) and summed."""
    grad_rows = grad_rows.contiguous()
    if plan.relay is None:
        return grad_rows[: sum(plan.recv_counts)]
    work, arrived = start_grad_relay(comm, plan, grad_rows, buffers)
    return finish_grad_relay(comm, plan, work, arrived, buffers)


def start_grads(
    comm: Comm, plan: ExchangePlan, grad_rows: torch.Tensor, wire: WireFormat, buffers: GradBuffers
) -> tuple[object, torch.Tensor, torch.Tensor]:
    """Relay (inside the node, waited for) and start the first stage: see :func:`start_first_grads`."""
    return start_first_grads(comm, plan, first_stage_grads(comm, plan, grad_rows, buffers), wire, buffers)


def finish_grads(
    comm: Comm, work, received: torch.Tensor, wire: WireFormat, row: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """Wait for gradients started by :func:`start_first_grads` and decode them:
    [plan.send_index.numel(), *row], one per row sent (add them at ``plan.send_index``)."""
    comm.wait(work, "gradients")
    return wire.decode(received, row, dtype)


@dataclass
class NonzeroPattern:
    """Which entries of a layer's rows crossed as nonzero ones (:func:`start_nonzero_rows`):
    what its backward needs to send and place the gradients of those entries alone.

    ``width``: entries per row (d); ``sent_bits`` uint8 [len(plan.send_index), ceil(d / 8)]
    and ``received_bits`` uint8 [sum(plan.recv_counts), ceil(d / 8)] (the rows that crossed
    to this rank; a node-aware plan relays more, whole): one bit per entry, set
    where it is nonzero (bit j % 8 of byte j // 8); ``sent_counts[q]`` /
    ``received_counts[q]``: nonzero entries sent to / received from rank q.
    """

    width: int
    sent_bits: torch.Tensor
    sent_counts: list[int]
    received_bits: torch.Tensor
    received_counts: list[int]


def start_nonzero_rows(
    comm: Comm, x_inner: torch.Tensor, plan: ExchangePlan, send_buffer: Buffer, values_buffer: Buffer, category: str
) -> tuple[tuple[object, object], torch.Tensor, NonzeroPattern]:
    """Start moving the rows ``plan`` sends from ``x_inner`` [n_inner, d] as their nonzero
    entries and a bitmap (exact): a row after a ReLU and dropout 0.5 is about a quarter
    nonzero, so about 28% of its bytes cross. Each rank first learns how many entries each
    owner sends it (a small all-to-all, waited for), then bitmaps and entries travel. In a
    node-aware plan this is the first stage, the one that crosses machines; the relay inside
    the node hands the rows on whole (:func:`finish_nonzero_rows`). Returns both works, the
    buffer the entries land in (a spare slot at its end) and the pattern backward needs."""
    backend = kernel_backend(x_inner.device)
    width = x_inner.shape[1]
    sent_bits = torch.empty((plan.send_index.numel(), (width + 7) // 8), dtype=torch.uint8, device=x_inner.device)
    values = send_buffer.view((plan.send_index.numel() * width,), x_inner.dtype, x_inner.device)
    offsets = backend.pack_nonzero_rows(x_inner, plan.send_index, sent_bits, values)
    segment_ends = torch.tensor([0, *itertools.accumulate(plan.send_counts)]).to(offsets.device, non_blocking=True)
    sent = offsets[segment_ends].diff()
    received = torch.empty(len(plan.recv_counts), dtype=torch.int64, device=comm.device)
    comm.all_to_all(sent, [1] * sent.numel(), [1] * received.numel(), received, category)
    sent_counts, received_counts = sent.tolist(), received.tolist()  # the all-to-alls' sizes
    received_bits = torch.empty((sum(plan.recv_counts), sent_bits.shape[1]), dtype=torch.uint8, device=x_inner.device)
    bits_work = comm.all_to_all_start(sent_bits, plan.send_counts, plan.recv_counts, received_bits, category)
    arrived = values_buffer.view((sum(received_counts) + 1,), x_inner.dtype, x_inner.device)
    values_work = comm.all_to_all_start(
        values[: sum(sent_counts)], sent_counts, received_counts, arrived[:-1], category
    )
    return (
        (bits_work, values_work),
        arrived,
        NonzeroPattern(width, sent_bits, sent_counts, received_bits, received_counts),
    )


def finish_nonzero_rows(
    comm: Comm,
    plan: ExchangePlan,
    works: tuple[object, object],
    arrived: torch.Tensor,
    pattern: NonzeroPattern,
    out: torch.Tensor,
    send_buffer: Buffer,
    category: str,
) -> torch.Tensor:
    """Wait for rows started by :func:`start_nonzero_rows`, write them whole into ``out``
    [plan.num_received, d] and relay them inside the node (whole, as
    :func:`finish_rows` does); returns them in column order."""
    for work in works:
        comm.wait(work, category)
    kernel_backend(out.device).unpack_nonzero_rows(pattern.received_bits, arrived, out[: sum(plan.recv_counts)])
    relay_rows(comm, plan, out, send_buffer, category)
    return in_column_order(plan, out)


def start_nonzero_grads(
    comm: Comm, plan: ExchangePlan, grad_rows: torch.Tensor, pattern: NonzeroPattern, buffers: GradBuffers
) -> tuple[object, torch.Tensor, torch.Tensor]:
    """Start sending the gradients of the received rows' nonzero entries to their owners;
    the rest need none (see :meth:`BoundaryExchange.start`). In a node-aware plan the
    relayed rows' gradients first come back whole and are summed (:func:`first_stage_grads`). Returns the work, the entries being sent and the buffer the owner's arrive in
    (a spare slot at its end)."""
    device, dtype = grad_rows.device, grad_rows.dtype
    first_grads = first_stage_grads(comm, plan, grad_rows, buffers)
    values = buffers.send.view((sum(pattern.received_counts) + 1,), dtype, device)
    values = kernel_backend(device).gather_nonzero(first_grads, pattern.received_bits, values)
    received = buffers.recv.view((sum(pattern.sent_counts) + 1,), dtype, device)
    work = comm.all_to_all_start(values, pattern.received_counts, pattern.sent_counts, received[:-1], "gradients")
    return work, values, received


def finish_nonzero_grads(
    comm: Comm,
    work,
    received: torch.Tensor,
    pattern: NonzeroPattern,
    plan: ExchangePlan,
    n_inner: int,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """Wait for gradients started by :func:`start_nonzero_grads`; returns them added into
    [n_inner, d] at the rows sent (zero where nothing was sent or an entry was zero), or
    into ``into`` in place."""
    comm.wait(work, "gradients")
    return kernel_backend(received.device).scatter_nonzero_rows(
        plan.send_index, pattern.sent_bits, received, (n_inner, pattern.width), into
    )


class GradBuffers:
    """Storage of one gradient exchange: what is sent (encoded), what arrives, what a relay sums."""

    def __init__(self) -> None:
        self.send, self.recv, self.relay = Buffer(), Buffer(), Buffer()


class BoundaryExchange:
    """The boundary exchange of one model, reusing its buffers across layers and epochs.

    Send and gradient buffers are only alive during a collective and are shared by all
    layers; each layer keeps its own receive buffer because the rows it receives may be
    saved for its backward (GAT). ``rows_format`` and ``grads_format`` say how rows and
    their gradients cross the network during training (:mod:`bnsgcn.comm.wire`);
    evaluation's rows (category ``evaluation``) always travel exact. A relay inside a node
    hands rows on as they arrived, and sums gradients in float32 before they cross.
    ``nonzero_rows``: rows the caller promises need no gradient at zero entries cross as
    their nonzero entries (:meth:`start`); those land in the gradients' send buffer, idle
    in forward, and are written whole into the layer's receive buffer.
    """

    def __init__(
        self,
        comm: Comm,
        rows_format: WireFormat | None = None,
        grads_format: WireFormat | None = None,
        nonzero_rows: bool = False,
    ) -> None:
        self.comm = comm
        self.rows_format = rows_format or EXACT
        self.grads_format = grads_format or EXACT
        self.nonzero_rows = nonzero_rows
        self.send_buffer = Buffer()
        self.grad_buffers = GradBuffers()
        # Rows are sent only in forward passes and gradients received only in backward
        # ones, never both at once: one buffer serves both (one activation-sized buffer less).
        self.grad_buffers.recv = self.send_buffer
        self.recv_buffers: dict[int, Buffer] = {}

    def _all_buffers(self) -> list[Buffer]:
        grads = self.grad_buffers  # grads.recv is send_buffer
        return [self.send_buffer, grads.send, grads.relay, *self.recv_buffers.values()]

    def buffers(self) -> list[torch.Tensor | None]:
        """The storage of every buffer now (tensors the rank holds anyway, for the accounting)."""
        return [b.storage for b in self._all_buffers()]

    def largest_bytes(self) -> int:
        """Bytes of all buffers at their largest (what the memory report shows)."""
        return sum(b.largest for b in self._all_buffers())

    def release(self) -> None:
        """Free every buffer (the next exchange allocates what it needs): after a pass that
        moved more rows than training will, e.g. a full-graph evaluation."""
        for buffer in self._all_buffers():
            buffer.storage = None

    def start(
        self,
        x_inner: torch.Tensor,
        plan: ExchangePlan,
        slot: int,
        category: str = "features",
        zeros_need_no_gradient: bool = False,
    ) -> InFlightRows:
        """Start fetching the rows of sampled boundary nodes for layer ``slot``;
        :meth:`InFlightRows.wait` returns them, [plan.num_received, *row] from ``x_inner``
        [n_inner, *row]. Differentiable: backward sends the rows' gradients to their owners.

        ``category`` names the forward traffic in the byte counts; gradients are counted
        as ``gradients``. ``zeros_need_no_gradient``: the caller's promise that the gradient
        reaching an exactly zero entry of ``x_inner`` is discarded (the output of a ReLU,
        or of dropout after one, is zero exactly where its backward passes nothing). The
        rows then cross as their nonzero entries (:func:`start_nonzero_rows`), and their
        gradients at those entries alone: the same result in fewer bytes, unless this
        exchange was made with ``nonzero_rows=False`` or compresses (its wire formats are
        not exact). A relay inside the node hands the rows on whole.
        """
        return self._start(x_inner, plan, slot, category, zeros_need_no_gradient)[0]

    def start_aggregating(
        self, x_inner: torch.Tensor, plan: ExchangePlan, slot: int, inner: Adjacency, into: torch.Tensor | None = None,
        category: str = "features", zeros_need_no_gradient: bool = False,
    ) -> tuple[InFlightRows, torch.Tensor]:  # fmt: skip
        """:meth:`start`, and while the rows travel the product of the inner columns'
        adjacency ``inner`` [n_inner, n_inner] with ``x_inner``: ``A_inner x_inner``
        [n_inner, *row] (with ``into``, summed into it in place, as
        :func:`~bnsgcn.kernels.spmm_add_`). Returns both. The product's backward is this
        exchange's: the gradients that come back for the rows sent are added into
        ``A_inner^T dY`` in place, so ``x_inner`` receives one gradient from the two uses,
        not two that autograd sums (a zero-filled [n_inner, *row] written, and a pass to add it).
        """
        return self._start(x_inner, plan, slot, category, zeros_need_no_gradient, inner, into)

    def _start(
        self, x_inner: torch.Tensor, plan: ExchangePlan, slot: int, category: str, zeros_need_no_gradient: bool,
        inner: Adjacency | None = None, into: torch.Tensor | None = None,
    ) -> tuple[InFlightRows, torch.Tensor]:  # fmt: skip
        recv = self.recv_buffers.setdefault(slot, Buffer())
        flight = InFlightRows(self, plan, category)
        if category != "evaluation":
            flight.rows_format, flight.grads_format = self.rows_format, self.grads_format
        flight.nonzero = (
            zeros_need_no_gradient
            and self.nonzero_rows
            and x_inner.dim() == 2
            and flight.rows_format.exact
            and flight.grads_format.exact
        )
        # the product is not kept on the flight: the node holds the flight, and a tensor the
        # node made, held there, would keep the epoch's graph alive past its backward
        flight.token, product = _Send.apply(x_inner, flight, recv, inner, into)
        return flight, product


class InFlightRows:
    """One layer's boundary exchange while its all-to-all runs: forward rows, then backward
    gradients. Work done between :meth:`BoundaryExchange.start` and :meth:`wait` (forward),
    and between the two halves of backward, overlaps the transfer (the first stage's: a
    relay inside the node runs when the first stage is waited for)."""

    def __init__(self, exchange: BoundaryExchange, plan: ExchangePlan, category: str) -> None:
        self.exchange, self.plan, self.category = exchange, plan, category
        self.rows_format = self.grads_format = EXACT
        self.token: torch.Tensor | None = None  # links _Send and _Receive in the autograd graph
        self.arrived: torch.Tensor | None = None  # both stages' rows, as they travel
        self.row: tuple[int, ...] = ()
        self.dtype = torch.float32
        self.work = None  # the forward all-to-all, then the gradients' one
        self.grads_sent: torch.Tensor | None = None  # kept alive while its all-to-all runs
        self.grads_received: torch.Tensor | None = None
        self.nonzero = False  # rows cross as their nonzero entries (see BoundaryExchange.start)
        self.pattern: NonzeroPattern | None = None  # which did, once started
        self.rows_buffer: Buffer | None = None  # where the nonzero path writes the rows whole

    def wait(self) -> torch.Tensor:
        """The received rows [plan.num_received, *row] (autograd-connected)."""
        # The token's autograd node holds this record: dropping the record's hold on the
        # token leaves no reference cycle, so an epoch's graph is freed when backward ends.
        token, self.token = self.token, None
        return _Receive.apply(token, self)


class _Send(torch.autograd.Function):
    """Forward: start the all-to-all of the requested rows (encoded for the wire), then (given
    ``inner``) aggregate the inner columns while they travel; returns an empty token that
    carries the gradient path to :class:`_Receive`, and the inner product (empty without
    ``inner``). Backward: the inner product's gradient ``A_inner^T dY``, then wait for the
    gradients that :class:`_Receive`'s backward sent and add them into the owners' rows."""

    @staticmethod
    def forward(ctx, x_inner, flight, recv, inner, into):  # noqa: D102
        ctx.flight, ctx.n_inner, ctx.inner, ctx.into_given = flight, x_inner.shape[0], inner, into is not None
        x_inner = x_inner.detach()
        flight.row, flight.dtype = tuple(x_inner.shape[1:]), x_inner.dtype
        exchange = flight.exchange
        if flight.nonzero:
            # the entries arrive in the gradients' send buffer, idle in forward
            flight.work, flight.arrived, flight.pattern = start_nonzero_rows(
                exchange.comm, x_inner, flight.plan, exchange.send_buffer, exchange.grad_buffers.send, flight.category
            )
            flight.rows_buffer = recv
        else:
            flight.work, flight.arrived = start_rows(
                exchange.comm, x_inner, flight.plan, flight.rows_format, exchange.send_buffer, recv, flight.category
            )
        if inner is None:
            product = x_inner.new_empty(0)
            ctx.mark_non_differentiable(product)
        elif into is None:
            product = spmm(inner, x_inner)
        else:
            product = spmm_add_(into, inner, x_inner)
            ctx.mark_dirty(into)
        return x_inner.new_empty(0), product

    @staticmethod
    def backward(ctx, _grad_token, grad_product):  # noqa: D102
        flight = ctx.flight
        comm = flight.exchange.comm
        # the inner product's gradient first: it runs while the rows' gradients travel
        grad_x = (
            None
            if ctx.inner is None or grad_product is None
            else kernel_backend(grad_product.device).spmm_transposed(ctx.inner, grad_product.contiguous())
        )
        grad_into = grad_product if ctx.into_given else None
        if flight.grads_received is None:  # the rows were not used: no gradient comes back for them
            return grad_x, None, None, None, grad_into
        backend = kernel_backend(flight.grads_received.device)
        if flight.pattern is not None:
            grad_x = finish_nonzero_grads(
                comm, flight.work, flight.grads_received, flight.pattern, flight.plan, ctx.n_inner, grad_x
            )
        else:
            grads = finish_grads(
                comm, flight.work, flight.grads_received, flight.grads_format, flight.row, flight.dtype
            )
            grad_x = backend.scatter_rows(flight.plan.send_index, grads, ctx.n_inner, grad_x)
        flight.work = flight.grads_sent = flight.grads_received = flight.pattern = None
        return grad_x, None, None, None, grad_into


class _Receive(torch.autograd.Function):
    """Forward: wait for the rows (and relay them inside the node), decode them. Backward:
    start sending their gradients to the owners (after summing relayed ones at the rank
    that relayed)."""

    @staticmethod
    def forward(ctx, token, flight):  # noqa: D102
        ctx.flight = flight
        exchange = flight.exchange
        if flight.pattern is not None:
            out = flight.rows_buffer.view((flight.plan.num_received, *flight.row), flight.dtype, flight.arrived.device)
            rows = finish_nonzero_rows(
                exchange.comm,
                flight.plan,
                flight.work,
                flight.arrived,
                flight.pattern,
                out,
                exchange.send_buffer,
                flight.category,
            )
            flight.rows_buffer = None
        else:
            rows = finish_rows(
                exchange.comm,
                flight.plan,
                flight.work,
                flight.arrived,
                exchange.send_buffer,
                flight.rows_format,
                flight.row,
                flight.dtype,
                flight.category,
            )
        flight.work = flight.arrived = None
        return rows

    @staticmethod
    def backward(ctx, grad_rows):  # noqa: D102
        flight = ctx.flight
        exchange = flight.exchange
        if flight.pattern is not None:
            flight.work, flight.grads_sent, flight.grads_received = start_nonzero_grads(
                exchange.comm, flight.plan, grad_rows, flight.pattern, exchange.grad_buffers
            )
        else:
            flight.work, flight.grads_sent, flight.grads_received = start_grads(
                exchange.comm, flight.plan, grad_rows, flight.grads_format, exchange.grad_buffers
            )
        return grad_rows.new_zeros(0), None


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
