r"""The boundary exchange one epoch stale (``--staleness 1``, the PipeGCN idea), composed with
boundary sampling and wire compression.

Layer slot ``l`` sends a tensor ``s_l`` [n_inner, d] of its inner rows (its input, or the
input times a weight: see :mod:`bnsgcn.nn.layers`). With staleness, in epoch ``t``:

* forward: the layer aggregates rows ``R_l^t`` that their owners sent during epoch ``t-1``:
  ``s_l^{t-1}`` at the boundary columns of epoch ``t``'s sample (drawn one epoch ahead),
  scaled by ``1/p`` as always; meanwhile ``s_l^t`` goes out at epoch ``t+1``'s sample;
* backward: the gradients ``G_l^t = dL_t / dR_l^t`` go out to the owners, and the ones that
  arrived from epoch ``t-1`` (summed over the ranks that used a row) are added to
  ``dL_t / ds_l^t`` at their rows.

Every transfer has a whole epoch of compute to hide behind; a rank waits only when the
network is slower than that. The first epoch of a run has nothing stale yet: it exchanges
synchronously (exactly as ``--staleness 0``) and sends ahead. Each epoch also sends ahead for
the epoch after the last one, so that a checkpoint (:meth:`StaleExchange.state_dict`, taken
with nothing in flight) always holds the rows and gradients the next epoch needs and a
resumed run equals the uninterrupted one.

Smoothing ``gamma`` (PipeGCN-F/G): each rank keeps, per boundary column, an exponential
average of the stale rows it received, ``\hat r = gamma \hat r + (1 - gamma) r`` (starting at
the first row received for the column), and aggregates ``\hat r``; each owner keeps the same
average of the stale gradient summed per inner row (starting at the first one to arrive),
and adds that.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor

from bnsgcn.comm.communicator import Comm
from bnsgcn.comm.plan import ExchangePlan
from bnsgcn.comm.wire import WireFormat
from bnsgcn.data.shard import Topology
from bnsgcn.exchange.base import Exchange
from bnsgcn.exchange.synchronous import BoundaryExchange, InFlightRows
from bnsgcn.exchange.transfers import (
    Buffer,
    GradBuffers,
    decode_rows,
    finish_grad_relay,
    finish_grads,
    start_first_grads,
    start_grad_relay,
    start_row_relay,
    start_rows,
)
from bnsgcn.kernels import kernel_backend
from bnsgcn.metrics.memory import storage_bytes


@dataclass
class _RowsInFlight:
    """Rows sent ahead for the next epoch: the first stage's work, then (in a node-aware
    plan) the relay's."""

    work: object
    arrived: Tensor
    plan: ExchangePlan
    columns: Tensor  # int64 [plan.num_received]: the boundary columns they are for
    category: str
    relaying: bool = False


@dataclass
class _GradsInFlight:
    """This epoch's gradients on their way to the owners: first (in a node-aware plan) to
    the ranks that relayed the rows, summed there, then across."""

    work: object
    plan: ExchangePlan
    arrived: Tensor | None = None  # while relaying: the gradients in buffer order
    sent: Tensor | None = None  # while crossing: kept alive until the work is done
    received: Tensor | None = None


class _Slot:
    """The stale exchange of one layer slot: transfers in flight, what has arrived, averages."""

    def __init__(self) -> None:
        self.send = Buffer()
        self.recv = (Buffer(), Buffer())  # alternate: one arriving while the other's rows are in use
        self.parity = 0
        self.grad_buffers = GradBuffers()
        self.row: tuple[int, ...] = ()
        self.dtype = torch.float32
        self.rows_in_flight: _RowsInFlight | None = None
        self.rows: tuple[Tensor, Tensor] | None = None  # arrived: (rows, columns)
        self.grads_in_flight: _GradsInFlight | None = None
        self.grads: tuple[Tensor, Tensor] | None = None  # arrived: (send_index, grads)
        self.row_average: Tensor | None = None  # [n_boundary, *row]
        self.row_seen: Tensor | None = None  # bool [n_boundary]
        self.grad_average: Tensor | None = None  # [len(send_rows), *row]


class DelayedExchange(Exchange):
    """What the stale and bounded-lag exchanges share: ``synchronous``, a
    :class:`BoundaryExchange` for the epochs with nothing delayed in hand (its buffers are
    theirs too), and what they hold between epochs (:meth:`_held`)."""

    synchronous: BoundaryExchange

    @abstractmethod
    def _held(self) -> list[Tensor | None]:
        """The rows, gradients and averages held between epochs."""

    def buffers(self) -> list[Tensor | None]:
        return self.synchronous.buffers() + self._held()

    def largest_bytes(self) -> int:
        return self.synchronous.largest_bytes() + storage_bytes(self._held())

    def release(self) -> None:
        self.synchronous.release()  # the first epoch's; what is held is for the epochs ahead


class StaleExchange(DelayedExchange):
    """Boundary exchange one epoch behind (see the module). ``synchronous`` serves the epochs
    with no stale rows in hand, and its sampling draws the samples (one epoch ahead);
    ``topology`` is the training graph's."""

    checkpoint_part = "stale"

    def __init__(
        self,
        comm: Comm,
        topology: Topology,
        synchronous: BoundaryExchange,
        rows_format: WireFormat,
        grads_format: WireFormat,
        smoothing: float | None = None,
    ) -> None:
        self.comm, self.synchronous = comm, synchronous
        self.rows_format, self.grads_format, self.smoothing = rows_format, grads_format, smoothing
        self.n_inner, self.n_boundary = topology.n_inner, topology.n_boundary
        self.send_rows = torch.unique(topology.send_nodes).to(comm.device)  # inner rows any rank may request
        self.slots: dict[int, _Slot] = {}
        self.next_plan: ExchangePlan | None = None
        self.next_columns: Tensor | None = None
        self.ahead: tuple[Tensor, ExchangePlan] | None = None  # the next epoch's sample and plan

    def draw(self, epoch: int) -> tuple[Tensor, ExchangePlan]:
        """This epoch's sample and plan (drawn one epoch ahead), and the next epoch's, which
        this epoch's rows are sent ahead for (:meth:`prepare`); all ranks together."""
        keep, plan = self.ahead or self.synchronous.draw(epoch)
        self.ahead = self.synchronous.draw(epoch + 1)
        self.prepare(self.ahead[1], self.ahead[0])
        return keep, plan

    def _held(self) -> list[Tensor | None]:
        """Every buffer and running average of every slot, as allocated so far."""
        out: list[Tensor | None] = []
        for state in self.slots.values():
            grads = state.grad_buffers
            out += [b.storage for b in (state.send, *state.recv, grads.send, grads.recv, grads.relay)]
            out += [state.row_average, state.row_seen, state.grad_average]
        return out

    def prepare(self, next_plan: ExchangePlan, next_keep: Tensor) -> None:
        """At the start of an epoch: the next epoch's sample (bool [n_boundary]) and plan,
        what this epoch sends ahead for. The previous epoch's transfers move on to their
        next stage here (see :meth:`_relay_rows`, :meth:`_grads_cross`)."""
        for state in self.slots.values():
            self._grads_cross(state)
            self._relay_rows(state)
        self.next_plan = next_plan
        self.next_columns = next_keep.nonzero().flatten().to(self.comm.device, non_blocking=True)

    def start(
        self,
        x_inner: Tensor,
        plan: ExchangePlan,
        slot: int,
        category: str = "features",
        zeros_need_no_gradient: bool = False,
    ) -> InFlightRows | _StaleFlight:
        """Like :meth:`BoundaryExchange.start`: ``.wait()`` gives this epoch's rows for slot
        ``slot`` (stale ones once there are any) and ``x_inner`` goes out for the next epoch.
        Rows travel whole (``zeros_need_no_gradient`` is not used)."""
        state = self.slots.setdefault(slot, _Slot())
        if state.rows is None and state.rows_in_flight is None:
            flight = self.synchronous.start(x_inner, plan, slot, category)
            self._send_ahead(state, x_inner.detach(), category)
            return flight
        return _StaleFlight(self, state, plan, x_inner.shape[0], category).start(x_inner)

    def drain(self) -> None:
        """Wait for every transfer in flight (before a checkpoint, at the end of a run)."""
        for state in self.slots.values():
            self._rows_arrived(state)
            self._grads_arrived(state)

    def close(self) -> None:
        """The transfers for the epoch after the last one arrive before the groups close."""
        self.drain()

    # Rows for epoch t+1: the first stage starts in the layer's forward of epoch t; in a
    # node-aware plan the relay inside the node starts when epoch t+1 starts (prepare); the
    # layer's forward of epoch t+1 waits for them. Each stage runs behind compute.
    def _send_ahead(self, state: _Slot, x_inner: Tensor, category: str) -> None:
        assert self.next_plan is not None, "prepare() names the next epoch's sample before an epoch starts"
        state.row, state.dtype = tuple(x_inner.shape[1:]), x_inner.dtype
        state.parity ^= 1
        work, arrived = start_rows(
            self.comm,
            x_inner,
            self.next_plan,
            self.rows_format,
            state.send,
            state.recv[state.parity],
            category,
            pipelined=True,
        )
        state.rows_in_flight = _RowsInFlight(work, arrived, self.next_plan, self.next_columns, category)

    def _relay_rows(self, state: _Slot) -> None:
        flight = state.rows_in_flight
        if flight is not None and flight.plan.relay is not None and not flight.relaying:
            self.comm.wait(flight.work, flight.category)
            flight.work = start_row_relay(
                self.comm, flight.plan, flight.arrived, state.send, flight.category, pipelined=True
            )
            flight.relaying = True

    def _rows_arrived(self, state: _Slot) -> None:
        flight = state.rows_in_flight
        if flight is not None:
            self._relay_rows(state)
            self.comm.wait(flight.work, flight.category)
            state.rows = (
                decode_rows(flight.plan, flight.arrived, self.rows_format, state.row, state.dtype),
                flight.columns,
            )
            state.rows_in_flight = None

    # Gradients of epoch t: in a node-aware plan the relay inside the node starts in the
    # layer's backward of epoch t and the first stage (across) when epoch t+1 starts
    # (prepare), else the first stage starts at once; the layer's backward of epoch t+1
    # waits for them.
    def _send_grads(self, state: _Slot, plan: ExchangePlan, grad_rows: Tensor) -> None:
        grad_rows = grad_rows.contiguous()
        if plan.relay is None:
            state.grads_in_flight = _GradsInFlight(None, plan)
            self._grads_cross(state, grad_rows[: sum(plan.recv_counts)])
        else:
            work, arrived = start_grad_relay(self.comm, plan, grad_rows, state.grad_buffers, pipelined=True)
            state.grads_in_flight = _GradsInFlight(work, plan, arrived=arrived)

    def _grads_cross(self, state: _Slot, first_grads: Tensor | None = None) -> None:
        flight = state.grads_in_flight
        if first_grads is None:  # the relay's sum first
            if flight is None or flight.arrived is None:
                return
            first_grads = finish_grad_relay(self.comm, flight.plan, flight.work, flight.arrived, state.grad_buffers)
            flight.arrived = None
        flight.work, flight.sent, flight.received = start_first_grads(
            self.comm, flight.plan, first_grads, self.grads_format, state.grad_buffers, pipelined=True
        )

    def _grads_arrived(self, state: _Slot) -> None:
        flight = state.grads_in_flight
        if flight is not None:
            self._grads_cross(state)
            grads = finish_grads(self.comm, flight.work, flight.received, self.grads_format, state.row, state.dtype)
            state.grads, state.grads_in_flight = (flight.plan.send_index, grads), None

    def _take_rows(self, state: _Slot, plan: ExchangePlan) -> Tensor:
        """This epoch's rows [plan.num_received, *row] (smoothed when asked)."""
        self._rows_arrived(state)
        rows, columns = state.rows
        state.rows = None
        if rows.shape[0] != plan.num_received:
            raise RuntimeError(
                f"stale rows for {rows.shape[0]} boundary columns, but this epoch samples {plan.num_received}"
            )
        if self.smoothing is None:
            return rows
        if state.row_average is None:
            state.row_average = rows.new_zeros((self.n_boundary, *state.row))
            state.row_seen = torch.zeros(self.n_boundary, dtype=torch.bool, device=rows.device)
        seen = state.row_seen[columns].view(-1, *[1] * len(state.row))
        mixed = torch.where(seen, torch.lerp(rows, state.row_average[columns], self.smoothing), rows)
        state.row_average[columns] = mixed
        state.row_seen[columns] = True
        return mixed

    def _take_grads(self, state: _Slot) -> Tensor | None:
        """The stale gradients of the previous epoch, summed per inner row: [n_inner, *row]
        (smoothed when asked), or None when none were sent."""
        self._grads_arrived(state)
        if state.grads is None:
            return None
        send_index, grads = state.grads
        state.grads = None
        dense = kernel_backend(grads.device).scatter_rows(send_index, grads, self.n_inner)
        if self.smoothing is None:
            return dense
        current = dense[self.send_rows]
        state.grad_average = (
            current if state.grad_average is None else torch.lerp(current, state.grad_average, self.smoothing)
        )
        return dense.index_copy_(0, self.send_rows, state.grad_average)

    def state_dict(self) -> dict:
        """This rank's stale rows, gradients and averages (call :meth:`drain` first)."""
        slots = {}
        for slot, state in self.slots.items():
            assert state.rows_in_flight is None and state.grads_in_flight is None, "drain() before state_dict()"
            entry: dict = {"row": list(state.row)}
            if state.rows is not None:
                entry["rows"], entry["columns"] = (t.cpu() for t in state.rows)
            if state.grads is not None:
                entry["grad_index"], entry["grads"] = (t.cpu() for t in state.grads)
            for name in ("row_average", "row_seen", "grad_average"):
                if getattr(state, name) is not None:
                    entry[name] = getattr(state, name).cpu()
            slots[str(slot)] = entry
        return {"slots": slots}

    def load_state_dict(self, state: dict) -> None:
        device = self.comm.device
        for slot, entry in state["slots"].items():
            target = self.slots.setdefault(int(slot), _Slot())
            target.row = tuple(entry["row"])
            if "rows" in entry:
                target.rows = (entry["rows"].to(device), entry["columns"].to(device))
                target.dtype = entry["rows"].dtype
            if "grads" in entry:
                target.grads = (entry["grad_index"].to(device), entry["grads"].to(device))
                target.dtype = entry["grads"].dtype
            for name in ("row_average", "row_seen", "grad_average"):
                if name in entry:
                    setattr(target, name, entry[name].to(device))


class DelayedFlight:
    """One layer's exchange within an epoch whose rows and gradients are not this epoch's
    (stale here, lagged in :mod:`bnsgcn.exchange.bounded_lag`): forward takes the rows that arrived and sends
    this epoch's (:meth:`trade_rows`), backward takes the gradients that arrived for this
    rank's rows and sends this epoch's to their owners (:meth:`trade_grads`). Two autograd
    functions carry that: a token from :class:`_DelayedSend` (``x_inner``'s side) to
    :class:`_DelayedReceive` (the rows' side), so that backward reaches both."""

    def __init__(self) -> None:
        self.token: Tensor | None = None
        self.rows: Tensor | None = None
        self.stale_grads: Tensor | None = None

    def start(self, x_inner: Tensor) -> DelayedFlight:
        self.token = _DelayedSend.apply(x_inner, self)
        return self

    def wait(self) -> Tensor:
        """This epoch's rows [plan.num_received, *row], autograd-connected."""
        token, self.token = self.token, None  # no reference cycle (see InFlightRows.wait)
        return _DelayedReceive.apply(token, self)

    def trade_rows(self, x_inner: Tensor) -> Tensor:
        """The rows to aggregate now; sends ``x_inner`` (detached) on its way."""
        raise NotImplementedError

    def trade_grads(self, grad_rows: Tensor) -> Tensor | None:
        """The gradients that arrived for ``x_inner`` [n_inner, *row] (None: none yet);
        sends ``grad_rows``, this epoch's, to the owners."""
        raise NotImplementedError


class _StaleFlight(DelayedFlight):
    """One layer's stale exchange within an epoch (the object :meth:`StaleExchange.start` returns)."""

    def __init__(self, exchange: StaleExchange, state: _Slot, plan: ExchangePlan, n_inner: int, category: str) -> None:
        super().__init__()
        self.exchange, self.state, self.plan, self.n_inner, self.category = exchange, state, plan, n_inner, category

    def trade_rows(self, x_inner: Tensor) -> Tensor:
        rows = self.exchange._take_rows(self.state, self.plan)
        self.exchange._send_ahead(self.state, x_inner, self.category)
        return rows

    def trade_grads(self, grad_rows: Tensor) -> Tensor | None:
        grads = self.exchange._take_grads(self.state)  # frees their buffers
        self.exchange._send_grads(self.state, self.plan, grad_rows)
        return grads


class _DelayedSend(torch.autograd.Function):
    """Forward: the rows that arrived for this epoch, and ``x_inner`` sent on; returns an
    empty token carrying the gradient path to :class:`_DelayedReceive`. Backward: the
    gradients :class:`_DelayedReceive`'s backward collected, into ``x_inner``."""

    @staticmethod
    def forward(ctx, x_inner, flight):  # noqa: D102
        ctx.flight = flight
        flight.rows = flight.trade_rows(x_inner.detach())
        return x_inner.new_empty(0)

    @staticmethod
    def backward(ctx, _grad_token):  # noqa: D102
        grads, ctx.flight.stale_grads = ctx.flight.stale_grads, None
        return grads, None


class _DelayedReceive(torch.autograd.Function):
    """Forward: this epoch's rows. Backward: collect the gradients that arrived, then send
    this epoch's to the owners."""

    @staticmethod
    def forward(ctx, token, flight):  # noqa: D102
        ctx.flight = flight
        rows, flight.rows = flight.rows, None
        return rows

    @staticmethod
    def backward(ctx, grad_rows):  # noqa: D102
        ctx.flight.stale_grads = ctx.flight.trade_grads(grad_rows)
        return grad_rows.new_zeros(0), None
