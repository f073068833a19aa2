"""The steps of moving boundary rows and their gradients, shared by every exchange strategy.

Forward, an owner encodes the rows a plan sends into a send buffer and starts the
all-to-all (:func:`start_rows`); where a node-aware plan relays rows, the rank that received
them hands them on inside its node (:func:`start_row_relay`); the receiver decodes them in
column order (:func:`finish_rows`). Backward, the gradients travel the same way back:
summed at the rank that relayed (:func:`first_stage_grads`), then across to the owner
(:func:`start_first_grads`, :func:`finish_grads`). Rows whose zero entries need no gradient
(ReLU outputs) may cross as their nonzero entries and a bitmap (:func:`start_nonzero_rows`):
one small all-to-all of counts and two more per layer. Buffers (:class:`Buffer`) grow as
needed and are reused across layers and epochs.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from bnsgcn.comm.communicator import Comm
from bnsgcn.comm.plan import ExchangePlan
from bnsgcn.comm.wire import WireFormat
from bnsgcn.kernels import kernel_backend


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
    relayed rows' gradients first come back whole and are summed (:func:`first_stage_grads`).
    Returns the work, the entries being sent and the buffer the owner's arrive in (a spare
    slot at its end)."""
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
