r"""Bounded lag (``--staleness 1 --max-lag S``): ranks run up to ``S`` epochs apart.

The stale exchange of :mod:`bnsgcn.exchange.stale` is a set of all-to-all collectives every epoch (and
the selections all-to-all of the sample before them), so every rank meets every other rank
every epoch, however decoupled its ``--sync``. Here nothing of an epoch after the first is a
collective: rows and gradients travel point to point, as their owners produce them, and a
rank waits for another only where it would otherwise use something more than ``S`` epochs old.

**Versions.** In its epoch ``v`` an owner sends, for layer slot ``l``, its rows ``s_l^v`` to
each requester, at the boundary columns the requester samples in epoch ``v + 1`` (as
``--staleness 1`` does): *row version* ``v``. Sampling is seeded by (seed, rank, epoch)
(:func:`bnsgcn.data.sampler.sample_boundary`), so the owner draws the requester's sample itself
from the requester's ``boundary_counts`` (exchanged once, at setup): no selection exchange.
In its epoch ``t >= 1`` a rank takes, for each owner ``q``, the newest version ``v_q`` that
has fully arrived (every slot) with ``max(0, t - S) <= v_q <= t - 1``, waiting only while
there is none; it uses it for every slot of the epoch, so the epoch's graph keeps, in ``q``'s
block of boundary columns, the sample of epoch ``v_q + 1`` (the keep mask is assembled per
owner block). Backward, the gradients of the rows a rank used in epoch ``u`` go back to each
owner with ``(u, v_q)``: *gradient version* ``u``, at the sample of epoch ``v_q + 1``. In its
epoch ``t`` an owner adds to ``dL/ds_l^t``, per requester and slot, the newest gradient
version ``u`` that has arrived with ``t - S <= u <= t - 1`` (waiting while there is none;
before epoch ``S + 1`` it adds one only if one arrived), reusing it while no newer one
arrives, as rows are reused. With ``S = 1`` every version is exactly ``t - 1``: the
stale exchange's arithmetic (``--staleness 1``), tested equal. The first epoch exchanges
synchronously (one all-to-all per layer: every rank starts together) and sends ahead;
every epoch sends, the last one too (as ``--staleness 1`` does): a checkpoint of the last
epoch can then be continued with more ``--epochs``, and the stochastic rounding of a
compressed wire format draws the same random numbers as the stale exchange's.

A rank can then be at most ``S`` epochs ahead of each rank it shares boundary nodes with
(it needs their rows and gradients no older than ``S``), and a slow rank never waits for a
fast one (the newest version no newer than ``t - 1`` is there already).

**Transport.** One gloo process group of its own carries only these transfers. Per peer, a
sender thread sends the messages the training loop queues, in order, and a receiver thread
receives them, in order: a header (int64 ``[kind, slot, epoch, row version, values per row,
dtype]``), then the payload, whose size both sides compute from the version's sample (gloo
receives need the exact size; messages between two ranks arrive in the order sent). Threads,
because gloo's point-to-point work reports completion only to a blocking ``wait`` (its
``is_completed()`` stays false until then, measured with torch 2.13), and waiting in the
training loop would tie ranks together again; the threads keep the transfers moving while
the loop computes, sleeps (``--inject-delay``) or waits in a sync point. Their waits have no
deadline of their own: every wait of the training loop on them is bounded by ``--timeout``
and then ends the job naming the rank that stopped (:meth:`Comm.who_stopped`); a peer that
dies ends it at once. At the end of training every rank sends an end mark to each peer and
waits (bounded) until its own messages are delivered and every peer's end mark has arrived,
so nothing is in flight when the job's groups close.

**Wire formats** (``--compress``, ``--compress-grad``, :mod:`bnsgcn.comm.wire`). An owner
encodes the rows of all its requesters in one pass, in rank order, then sends each its
part; a rank encodes the gradients for all its owners in one pass, in column order, then
sends each its part; messages travel and are kept encoded (the header's values per row
and dtype are the wire's) and are decoded where an epoch uses them. That is the stale
exchange's encoding, tensor for tensor: int8 and int4 round stochastically from torch's
generator, which the epoch's dropout seed (seed, rank, epoch) sets, at the same points of
the epoch, so ``S = 1`` with compression equals ``--staleness 1`` with it (tested).

**Checkpoints** (``--checkpoint-every``, the stop signals of :mod:`bnsgcn.run.stopping`,
``--resume``). A checkpoint after epoch ``t`` is taken where every rank meets (with a
decoupled ``--sync`` a checkpoint epoch is a sync point, and a stop signal is acted on at
the next sync point). There each rank first waits (:meth:`LagExchange.drain`, bounded by
``--timeout``) until it holds every owner's rows and every requester's gradients of
epoch ``t``: exactly what ``--staleness 1`` holds then, and what the next epoch uses
whatever ``S`` is (the newest version within any bound). Its part of the checkpoint
(:meth:`LagExchange.state_dict`) holds those, as they came over the wire, with the
smoothing averages; a resumed run starts from them. So with ``S = 1`` a resumed run
equals the uninterrupted one; with ``S > 1`` the epoch after a checkpoint uses the
previous epoch's versions in both (the checkpoint costs the fast ranks their lead).

Not supported (refused in one line, :func:`check_config`): the node-aware exchange (rows
go point to point from owner to requester, leaving a relay nothing to do; ``--exchange
auto`` resolves to direct, :func:`exchange_mode`). ``--sync allreduce`` is allowed but
lets no rank run ahead (ranks meet at every step's all-reduce); the job logs so.

**Reproducibility.** Parameters, sampling and dropout are seeded as ever, but which version
a rank uses depends on what has arrived, i.e. on timing. ``S = 1`` leaves no choice; two
runs agree (to float32 rounding, see docs/training.md) as long as every rank used the
previous epoch's versions (per-rank ``lag`` 1 in the records): always with ``S = 1``, and
with ``S > 1`` without injected delays whenever the transfers arrive before they are needed.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import OrderedDict
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from bnsgcn.comm.communicator import Comm
from bnsgcn.comm.plan import ExchangePlan
from bnsgcn.comm.wire import WireFormat
from bnsgcn.data.sampler import sample_boundary
from bnsgcn.data.shard import Topology, segment_counts
from bnsgcn.errors import PeerLost, peer_lost_message
from bnsgcn.exchange.stale import DelayedExchange, DelayedFlight
from bnsgcn.exchange.synchronous import BoundaryExchange, InFlightRows

ROWS, GRADS, END = 0, 1, 2
HEADER = 6  # int64: kind, slot, epoch, row version, values per row, dtype (both on the wire)
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8)
TAG = 16
FOREVER = timedelta(days=365)  # the threads' waits: the training loop's are bounded instead
SAMPLES_KEPT = 512  # samples drawn for other ranks and for this one, most recently used kept


class _Peer:
    """The two threads and the queue of one peer."""

    def __init__(self) -> None:
        self.outbox: queue.Queue = queue.Queue()
        self.unsent = 0  # messages queued and not yet delivered (under the exchange's lock)
        self.ended = False  # its end mark arrived
        self.threads: list[threading.Thread] = []


class LagExchange(DelayedExchange):
    """Boundary exchange with bounded lag (see the module). ``synchronous`` serves the first
    epoch; ``topology`` is the training graph's. Collective to build (one gather of every
    rank's ``boundary_counts``, one new process group). ``rows_format`` and ``grads_format``:
    how rows and their gradients travel (see the module)."""

    checkpoint_part = "lag"

    def __init__(
        self,
        comm: Comm,
        topology: Topology,
        synchronous: BoundaryExchange,
        p: float,
        seed: int,
        max_lag: int,
        rows_format: WireFormat,
        grads_format: WireFormat,
        smoothing: float | None = None,
    ) -> None:
        self.comm, self.synchronous, self.p, self.seed, self.max_lag, self.smoothing = (
            comm,
            synchronous,
            p,
            seed,
            max_lag,
            smoothing,
        )
        self.rows_format, self.grads_format = rows_format, grads_format
        me, world = comm.rank, comm.world_size
        self.topology = topology
        self.n_inner, self.n_boundary = topology.n_inner, topology.n_boundary
        self.counts = [
            list(c) for c in comm.all_gather_object(list(topology.boundary_counts))
        ]  # every rank's boundary_counts
        for r in range(world):
            if self.counts[r][me] != topology.send_counts[r]:
                raise RuntimeError(
                    f"rank {r} has {self.counts[r][me]} boundary nodes of rank {me}, which sends "
                    f"{topology.send_counts[r]} rows to it; the partition set is inconsistent"
                )
        self.owners = [
            q for q in range(world) if q != me and topology.boundary_counts[q] > 0
        ]  # whose rows this rank uses
        self.requesters = [
            r for r in range(world) if r != me and topology.send_counts[r] > 0
        ]  # who uses this rank's rows
        starts = torch.tensor([0, *topology.boundary_counts]).cumsum(0).tolist()
        self.block = {q: (starts[q], starts[q + 1]) for q in range(world)}  # q's boundary columns here
        send_starts = torch.tensor([0, *topology.send_counts]).cumsum(0).tolist()
        self.send_nodes = {
            r: topology.send_nodes[send_starts[r] : send_starts[r + 1]].to(comm.device) for r in self.requesters
        }
        self.send_rows = torch.unique(topology.send_nodes).to(comm.device)  # for the gradient average
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=comm.timeout)) if world > 1 else None

        self.cond = threading.Condition()
        self.error: tuple[int, BaseException] | None = None
        self.rows: dict[tuple[int, int], dict[int, Tensor]] = {}  # (owner, slot) -> version -> flat rows, encoded
        self.grads: dict[
            tuple[int, int], dict[int, tuple[int, Tensor]]
        ] = {}  # (requester, slot) -> epoch -> (row version, flat grads, encoded)
        self.received = {"features": 0, "gradients": 0, "control": 0}  # bytes the threads took in since the last look
        self.samples: OrderedDict[tuple[int, int], Tensor] = OrderedDict()
        self.sample_lock = threading.Lock()

        self.epoch = -1
        self.slots: dict[
            int, tuple[tuple[int, ...], torch.dtype]
        ] = {}  # slot -> (row shape, dtype), from the first epoch
        self.grad_slots: set[int] = set()  # the slots whose rows get gradients (not a first layer's input features)
        self.chosen: dict[int, int] = {}  # owner -> row version used this epoch
        self.columns: Tensor | None = None  # this epoch's boundary columns (smoothing)
        self.row_average: dict[int, Tensor] = {}
        self.row_seen: dict[int, Tensor] = {}
        self.grad_average: dict[int, Tensor] = {}
        self.lag = 0  # this epoch: the most epochs behind of any version used
        self.waited = 0.0  # this epoch: seconds waited for versions within the bound
        self.finished = False

        self.peers = {q: _Peer() for q in sorted(set(self.owners) | set(self.requesters))}
        for q, peer in self.peers.items():
            peer.threads = [
                threading.Thread(target=self._receive, args=(q,), name=f"lag-recv-{q}", daemon=True),
                threading.Thread(target=self._send, args=(q, peer), name=f"lag-send-{q}", daemon=True),
            ]
            for thread in peer.threads:
                thread.start()

    # --- the threads ---------------------------------------------------------------------

    def _receive(self, q: int) -> None:
        """Receive ``q``'s messages in order until its end mark."""
        try:
            while True:
                header = torch.empty(HEADER, dtype=torch.int64)
                dist.irecv(header, q, group=self.group, tag=TAG).wait(FOREVER)
                kind, slot, epoch, version, width, dtype = header.tolist()
                if kind == END:
                    with self.cond:
                        self.peers[q].ended = True
                        self.received["control"] += header.nbytes
                        self.cond.notify_all()
                    return
                rows = self._block_count(kind, q, version)
                payload = torch.empty(rows * width, dtype=DTYPES[dtype])
                if payload.numel():
                    dist.irecv(payload, q, group=self.group, tag=TAG).wait(FOREVER)
                with self.cond:
                    if kind == ROWS:
                        self.rows.setdefault((q, slot), {})[version] = payload
                    else:
                        self.grads.setdefault((q, slot), {})[epoch] = (version, payload)
                    self.received["features" if kind == ROWS else "gradients"] += payload.nbytes
                    self.received["control"] += header.nbytes
                    self.cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 (reported by the training loop)
            self._fail(q, exc)

    def _send(self, q: int, peer: _Peer) -> None:
        """Send the queued messages to ``q`` in order; stop after the end mark."""
        try:
            while True:
                message = peer.outbox.get()
                for tensor in message:
                    dist.isend(tensor, q, group=self.group, tag=TAG).wait(FOREVER)
                with self.cond:
                    peer.unsent -= 1
                    self.cond.notify_all()
                if int(message[0][0]) == END:
                    return
        except BaseException as exc:  # noqa: BLE001
            self._fail(q, exc)

    def _fail(self, q: int, exc: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = (q, exc)
            self.cond.notify_all()

    # --- samples -------------------------------------------------------------------------

    def _sample(self, rank: int, epoch: int) -> Tensor:
        """``rank``'s boundary sample of ``epoch``: for this rank all of it (bool
        [n_boundary]), for another only its block of this rank's nodes (bool [send_counts[rank]])."""
        key = (rank, epoch)
        with self.sample_lock:
            if key in self.samples:
                self.samples.move_to_end(key)
                return self.samples[key]
        keep = sample_boundary(self.counts[rank], self.p, self.seed, rank, epoch)
        if rank != self.comm.rank:
            start = sum(self.counts[rank][: self.comm.rank])
            keep = keep[start : start + self.counts[rank][self.comm.rank]].clone()
        with self.sample_lock:
            self.samples[key] = keep
            while len(self.samples) > SAMPLES_KEPT:
                self.samples.popitem(last=False)
        return keep

    def _owner_block(self, q: int, version: int) -> Tensor:
        """Which of ``q``'s boundary columns here row version ``version`` carries."""
        lo, hi = self.block[q]
        return self._sample(self.comm.rank, version + 1)[lo:hi]

    def _block_count(self, kind: int, q: int, version: int) -> int:
        """Rows in a message of ``kind`` from ``q`` at row version ``version``."""
        if kind == ROWS:  # q's rows for this rank's sample of version + 1
            return int(self._owner_block(q, version).sum())
        return int(self._sample(q, version + 1).sum())  # gradients of the rows q used

    # --- the training loop's side --------------------------------------------------------

    def draw(self, epoch: int) -> tuple[Tensor, ExchangePlan]:
        """The boundary sample (bool [n_boundary], assembled per owner block) and plan of
        ``epoch``: this rank's own draw in the first epoch (exchanged synchronously), else
        the newest row version of each owner within the bound (waiting while there is none)."""
        self.epoch, self.lag, self.waited, self.chosen = epoch, 0, 0.0, {}
        self._count_received()
        own = self._sample(self.comm.rank, epoch)
        if not self.slots:  # the first epoch (or a model that exchanges nothing)
            return own, self._first_plan(own) if epoch == 0 else self._plan(own)
        low, high = max(0, epoch - self.max_lag), epoch - 1

        def newest(q: int) -> int | None:
            versions = [set(self.rows.get((q, slot), {})) for slot in self.slots]
            usable = [v for v in set.intersection(*versions) if low <= v <= high]
            return max(usable) if usable else None

        self._wait(
            lambda: all(newest(q) is not None for q in self.owners),
            "selections",
            f"rows of epoch {low} or later from ranks {self.owners}",
        )
        keep = own.clone()
        with self.cond:
            for q in self.owners:
                version = self.chosen[q] = newest(q)
                for slot in self.slots:  # older versions are never used again
                    versions = self.rows[(q, slot)]
                    for old in [v for v in versions if v < version]:
                        del versions[old]
        for q, version in self.chosen.items():
            lo, hi = self.block[q]
            keep[lo:hi] = self._owner_block(q, version)
            self.lag = max(self.lag, epoch - version)
        if self.smoothing is not None:
            self.columns = keep.nonzero().flatten().to(self.comm.device)
        return keep, self._plan(keep)

    def _plan(self, keep: Tensor) -> ExchangePlan:
        """A plan of what arrives (the sends are this module's own)."""
        zeros = [0] * self.comm.world_size
        return ExchangePlan(
            torch.empty(0, dtype=torch.int64, device=self.comm.device),
            zeros,
            segment_counts(keep, self.topology.boundary_counts),
        )

    def _first_plan(self, own: Tensor) -> ExchangePlan:
        """The direct plan of the first epoch, without the selections all-to-all: each
        requester's sample is drawn here."""
        wanted = [
            self._sample(r, 0) if r in self.send_nodes else torch.zeros(0, dtype=torch.bool)
            for r in range(self.comm.world_size)
        ]
        index = [self.send_nodes[r][w.to(self.comm.device)] for r, w in enumerate(wanted) if r in self.send_nodes]
        send_index = torch.cat(index) if index else torch.empty(0, dtype=torch.int64, device=self.comm.device)
        return ExchangePlan(
            send_index, [int(w.sum()) for w in wanted], segment_counts(own, self.topology.boundary_counts)
        )

    def figures(self) -> dict[str, float]:
        """This epoch's lag (most epochs behind of any version used) and seconds waited for it."""
        return {"lag": float(self.lag), "time_lag_wait": self.waited}

    def _held(self) -> list[Tensor | None]:
        """What this rank holds of other ranks' rows and gradients, and the averages."""
        with self.cond:
            held = [t for versions in self.rows.values() for t in versions.values()]
            held += [t for versions in self.grads.values() for _, t in versions.values()]
        return held + list(self.row_average.values()) + list(self.row_seen.values()) + list(self.grad_average.values())

    def start(
        self,
        x_inner: Tensor,
        plan: ExchangePlan,
        slot: int,
        category: str = "features",
        zeros_need_no_gradient: bool = False,
    ) -> InFlightRows | _LagFlight:
        """Like :meth:`BoundaryExchange.start`: ``.wait()`` gives this epoch's rows (the
        chosen versions, from the second epoch on) and ``x_inner`` goes out for the next.
        Rows travel whole (``zeros_need_no_gradient`` is not used)."""
        if self.epoch == 0:
            self.slots[slot] = (tuple(x_inner.shape[1:]), x_inner.dtype)
            if x_inner.requires_grad:  # the same on every rank: the same model
                self.grad_slots.add(slot)
            flight = self.synchronous.start(x_inner, plan, slot, category)
            self._send_rows(slot, x_inner.detach())
            return flight
        return _LagFlight(self, slot, plan).start(x_inner)

    def drain(self) -> None:
        """Before a checkpoint after epoch ``t`` (the one just run; every rank there): wait,
        bounded by --timeout, until this rank holds every owner's rows and every requester's
        gradients of epoch ``t``, the state :meth:`state_dict` saves (see the module)."""
        t = self.epoch
        grad_slots = self.grad_slots if t >= 1 else set()  # the first epoch's gradients were exchanged synchronously

        def held() -> bool:
            rows = all(t in self.rows.get((q, slot), {}) for q in self.owners for slot in self.slots)
            return rows and all(t in self.grads.get((r, slot), {}) for r in self.requesters for slot in grad_slots)

        self._wait(
            held, None, f"the rows and gradients of epoch {t} from ranks {sorted(self.peers)} for the checkpoint"
        )

    def close(self) -> None:
        """At the end of training: send the end mark to every peer, then wait (bounded by
        --timeout) until this rank's messages are delivered and every peer's end mark arrived."""
        if self.finished:
            return
        self.finished = True
        for q in self.peers:
            self._queue(q, (torch.tensor([END, 0, self.epoch, 0, 0, 0], dtype=torch.int64),), "control")
        self._wait(
            lambda: all(p.ended and p.unsent == 0 for p in self.peers.values()),
            None,
            f"the last transfers of ranks {sorted(self.peers)}",
        )
        for peer in self.peers.values():
            for thread in peer.threads:
                thread.join(timeout=self.comm.timeout)
        self._count_received()

    def state_dict(self) -> dict:
        """This rank's part of a checkpoint after epoch ``t`` (call :meth:`drain` first): the
        rows of epoch ``t`` per owner and slot and the gradients of epoch ``t`` per requester
        and slot (with the row version they are for; none after the first epoch), encoded as
        they arrived; the smoothing averages; each slot's row shape, dtype and whether it
        gets gradients. Keys are ``"<rank>/<slot>"``."""
        t = self.epoch
        with self.cond:
            rows = {f"{q}/{slot}": self.rows[(q, slot)][t] for q in self.owners for slot in self.slots}
            grads = {
                f"{r}/{slot}": list(self.grads[(r, slot)][t])
                for r in self.requesters
                for slot in self.grad_slots
                if t >= 1
            }
        averages = {
            name: {str(slot): average.cpu() for slot, average in getattr(self, name).items()}
            for name in ("row_average", "row_seen", "grad_average")
        }
        slots = {
            str(slot): {"row": list(row), "dtype": str(dtype).removeprefix("torch."), "grads": slot in self.grad_slots}
            for slot, (row, dtype) in self.slots.items()
        }
        return {"lag": {"epoch": t, "slots": slots, "rows": rows, "grads": grads, **averages}}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a part :meth:`state_dict` wrote: the next epoch uses its rows and gradients."""
        state = state["lag"]
        t, device = state["epoch"], self.comm.device
        self.slots = {
            int(slot): (tuple(entry["row"]), getattr(torch, entry["dtype"])) for slot, entry in state["slots"].items()
        }
        self.grad_slots = {int(slot) for slot, entry in state["slots"].items() if entry["grads"]}
        with self.cond:
            for key, payload in state["rows"].items():
                q, slot = map(int, key.split("/"))
                self.rows.setdefault((q, slot), {})[t] = payload
            for key, (version, payload) in state["grads"].items():
                r, slot = map(int, key.split("/"))
                self.grads.setdefault((r, slot), {})[t] = (int(version), payload)
        for name in ("row_average", "row_seen", "grad_average"):
            setattr(self, name, {int(slot): average.to(device) for slot, average in state[name].items()})

    # sending

    def _queue(self, q: int, message: tuple[Tensor, ...], category: str) -> None:
        peer = self.peers[q]
        with self.cond:
            peer.unsent += 1
        peer.outbox.put(message)
        stats = self.comm.stats
        payload = sum(t.nbytes for t in message[1:])
        stats.sent[category] += payload
        stats.sent["control"] += message[0].nbytes
        (stats.sent_intra if self.comm.nodes.node_of[q] == self.comm.node else stats.sent_inter)[category] += payload

    def _send_rows(self, slot: int, x_inner: Tensor) -> None:
        """Row version ``epoch`` of ``slot`` to every requester, at its sample of the next
        epoch: every requester's rows encoded in one pass (the stale exchange's order)."""
        wanted = [self.send_nodes[r][self._sample(r, self.epoch + 1).to(self.comm.device)] for r in self.requesters]
        if not wanted:
            return
        wire = _encode(self.rows_format, x_inner.index_select(0, torch.cat(wanted)))
        for r, rows in zip(self.requesters, wire.split([w.numel() for w in wanted])):
            self._queue(r, self._message(ROWS, slot, self.epoch, rows), "features")

    def _send_grads(self, slot: int, grad_rows: Tensor) -> None:
        """This epoch's gradients of the rows each owner sent (gradient version ``epoch``),
        every owner's encoded in one pass (column order, the stale exchange's)."""
        counts = [int(self._owner_block(q, self.chosen[q]).sum()) for q in self.owners]
        if not counts:
            return
        wire = _encode(self.grads_format, grad_rows)
        for q, grads in zip(self.owners, wire.split(counts)):
            self._queue(q, self._message(GRADS, slot, self.chosen[q], grads), "gradients")

    def _message(self, kind: int, slot: int, version: int, wire: Tensor) -> tuple[Tensor, ...]:
        """Header and (unless empty) payload of encoded rows ``wire`` [n, *wire row]."""
        header = torch.tensor(
            [kind, slot, self.epoch, version, math.prod(wire.shape[1:]), DTYPES.index(wire.dtype)], dtype=torch.int64
        )
        return (header,) + ((wire.reshape(-1).cpu(),) if wire.numel() else ())

    # receiving

    def _take_rows(self, slot: int, plan: ExchangePlan) -> Tensor:
        """This epoch's rows of ``slot`` [plan.num_received, *row] (smoothed when asked)."""
        row, dtype = self.slots[slot]
        with self.cond:
            parts = [self.rows[(q, slot)][self.chosen[q]] for q in self.owners]
        rows = _decode(
            self.rows_format,
            torch.cat(parts) if parts else torch.zeros(0, dtype=self.rows_format.wire_dtype(dtype)),
            row,
            dtype,
            self.comm.device,
        )
        if rows.shape[0] != plan.num_received:
            raise RuntimeError(f"rows for {rows.shape[0]} boundary columns, but this epoch samples {plan.num_received}")
        if self.smoothing is None:
            return rows
        if slot not in self.row_average:
            self.row_average[slot] = rows.new_zeros((self.n_boundary, *row))
            self.row_seen[slot] = torch.zeros(self.n_boundary, dtype=torch.bool, device=rows.device)
        columns, average = self.columns, self.row_average[slot]
        seen = self.row_seen[slot][columns].view(-1, *[1] * len(row))
        mixed = torch.where(seen, torch.lerp(rows, average[columns], self.smoothing), rows)
        average[columns] = mixed
        self.row_seen[slot][columns] = True
        return mixed

    def _take_grads(self, slot: int) -> Tensor | None:
        """The gradients of this rank's rows that requesters sent back, newest within the
        bound per requester, summed per inner row [n_inner, *row] (smoothed when asked);
        None when there is none."""
        epoch = self.epoch
        low, high = max(1, epoch - self.max_lag), epoch - 1
        required = epoch - self.max_lag >= 1  # gradient versions start at 1 (the first epoch's were exact)

        def newest(r: int) -> int | None:
            usable = [u for u in self.grads.get((r, slot), {}) if low <= u <= high]
            return max(usable) if usable else None

        if required:
            self._wait(
                lambda: all(newest(r) is not None for r in self.requesters),
                "gradients",
                f"gradients of epoch {low} or later from ranks {self.requesters}",
            )
        row, dtype = self.slots[slot]
        dense = None
        with self.cond:
            chosen = {r: newest(r) for r in self.requesters}
            taken = {}
            for r, u in chosen.items():
                if u is None:  # none arrived yet (allowed before epoch S + 1): as old as the first epoch's
                    self.lag = max(self.lag, epoch)
                    continue
                versions = self.grads[(r, slot)]
                for old in [v for v in versions if v < u]:
                    del versions[old]
                taken[r] = versions[u]
                self.lag = max(self.lag, epoch - u)
        for r, (version, grads) in taken.items():
            index = self.send_nodes[r][self._sample(r, version + 1).to(self.comm.device)]
            if dense is None:
                dense = torch.zeros((self.n_inner, *row), dtype=dtype, device=self.comm.device)
            dense.index_add_(0, index, _decode(self.grads_format, grads, row, dtype, self.comm.device))
        if dense is None or self.smoothing is None:
            return dense
        current = dense[self.send_rows]
        self.grad_average[slot] = (
            current if slot not in self.grad_average else torch.lerp(current, self.grad_average[slot], self.smoothing)
        )
        return dense.index_copy_(0, self.send_rows, self.grad_average[slot])

    def _count_received(self) -> None:
        """Move the bytes the threads received into the communicator's counters."""
        with self.cond:
            received, self.received = self.received, dict.fromkeys(self.received, 0)
        for category, nbytes in received.items():
            self.comm.stats.received[category] += nbytes

    def _wait(self, ready, category: str | None, what: str) -> None:
        """Block until ``ready()`` (checked under the lock), for at most --timeout; the
        seconds count as this epoch's lag wait (and as ``category``'s exchange time)."""
        start = time.perf_counter()
        deadline = time.monotonic() + self.comm.timeout
        with self.cond:
            while True:
                if self.error is not None:
                    break
                if ready():
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self.cond.wait(min(remaining, 1.0))
            error, done = self.error, self.error is None and ready()
        waited = time.perf_counter() - start
        self.waited += waited
        if category is not None:
            self.comm.stats.clock.add(category, waited)
        if error is not None:
            q, exc = error
            raise PeerLost(
                peer_lost_message(
                    RuntimeError(
                        f"rank {self.comm.rank}: the transfers with rank {q} failed ({type(exc).__name__}: "
                        f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''})"
                    ),
                    self.comm.who_stopped(),
                )
            ) from exc
        if not done:
            raise PeerLost(
                peer_lost_message(
                    TimeoutError(
                        f"rank {self.comm.rank}: waiting for {what} took longer than --timeout {self.comm.timeout:g} s"
                    ),
                    self.comm.who_stopped(),
                )
            )


def _encode(wire: WireFormat, rows: Tensor) -> Tensor:
    """``rows`` [n, *row] in ``wire``'s format: [n, *wire row] (``rows`` itself when exact)."""
    if wire.exact:
        return rows
    out = rows.new_empty((rows.shape[0], *wire.wire_shape(tuple(rows.shape[1:]))), dtype=wire.wire_dtype(rows.dtype))
    return wire.encode(rows, out)


def _decode(wire: WireFormat, flat: Tensor, row: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Rows [n, *row] of ``dtype`` on ``device`` from the flat encoded values of a message."""
    encoded = flat.to(device).view(-1, *wire.wire_shape(row))
    return wire.decode(encoded, row, dtype)


class _LagFlight(DelayedFlight):
    """One layer's exchange within an epoch (the object :meth:`LagExchange.start` returns)."""

    def __init__(self, exchange: LagExchange, slot: int, plan: ExchangePlan) -> None:
        super().__init__()
        self.exchange, self.slot, self.plan = exchange, slot, plan

    def trade_rows(self, x_inner: Tensor) -> Tensor:
        rows = self.exchange._take_rows(self.slot, self.plan)
        self.exchange._send_rows(self.slot, x_inner)
        return rows

    def trade_grads(self, grad_rows: Tensor) -> Tensor | None:
        grads = self.exchange._take_grads(self.slot)
        self.exchange._send_grads(self.slot, grad_rows.contiguous())
        return grads
