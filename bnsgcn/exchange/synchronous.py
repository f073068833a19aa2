"""The synchronous boundary exchange: this epoch's rows, moved while the layer waits.

Forward, each owner sends the rows of its inner nodes that other ranks sampled this
epoch; backward, the gradients of those rows travel back and are added into the owner's
inner-row gradients. One all-to-all per layer and direction, plus, in a node-aware plan
(:mod:`bnsgcn.comm.planners`), one more among the ranks of each node that relays rows which
crossed the network once to the other ranks of the node needing them (the steps:
:mod:`bnsgcn.exchange.transfers`).
"""

from __future__ import annotations

import torch

from bnsgcn.comm.communicator import Comm
from bnsgcn.comm.plan import ExchangePlan
from bnsgcn.comm.wire import EXACT, WireFormat
from bnsgcn.exchange.base import Exchange, Sampling
from bnsgcn.exchange.transfers import (
    Buffer,
    GradBuffers,
    NonzeroPattern,
    finish_grads,
    finish_nonzero_grads,
    finish_nonzero_rows,
    finish_rows,
    start_grads,
    start_nonzero_grads,
    start_nonzero_rows,
    start_rows,
)
from bnsgcn.kernels import Adjacency, kernel_backend, spmm, spmm_add_


class BoundaryExchange(Exchange):
    """The synchronous exchange of one model, reusing its buffers across layers and epochs.

    Send and gradient buffers are only alive during a collective and are shared by all
    layers; each layer keeps its own receive buffer because the rows it receives may be
    saved for its backward (GAT). ``rows_format`` and ``grads_format`` say how rows and
    their gradients cross the network during training (:mod:`bnsgcn.comm.wire`);
    evaluation's rows (category ``evaluation``) always travel exact. A relay inside a node
    hands rows on as they arrived, and sums gradients in float32 before they cross.
    ``nonzero_rows``: rows the caller promises need no gradient at zero entries cross as
    their nonzero entries (:meth:`start`); those land in the gradients' send buffer, idle
    in forward, and are written whole into the layer's receive buffer. ``sampling`` draws
    each training epoch's sample and plan (None for an exchange that serves another:
    evaluation's, a stale exchange's first epoch).
    """

    def __init__(
        self,
        comm: Comm,
        rows_format: WireFormat | None = None,
        grads_format: WireFormat | None = None,
        nonzero_rows: bool = False,
        sampling: Sampling | None = None,
    ) -> None:
        self.comm, self.sampling = comm, sampling
        self.rows_format = rows_format or EXACT
        self.grads_format = grads_format or EXACT
        self.nonzero_rows = nonzero_rows
        self.send_buffer = Buffer()
        self.grad_buffers = GradBuffers()
        # Rows are sent only in forward passes and gradients received only in backward
        # ones, never both at once: one buffer serves both (one activation-sized buffer less).
        self.grad_buffers.recv = self.send_buffer
        self.recv_buffers: dict[int, Buffer] = {}

    def draw(self, epoch: int) -> tuple[torch.Tensor, ExchangePlan]:
        """This epoch's sample and plan, drawn now (all ranks together)."""
        return self.sampling.draw(epoch)

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
