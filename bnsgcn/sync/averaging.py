r"""How ranks keep their parameters together (``--sync``), for jobs where some ranks are slower.

``allreduce`` (default): gradients are summed over every rank every step
(:class:`bnsgcn.sync.reducer.GradientReducer`), so every rank holds the same parameters; nothing
here changes that path.

The other modes are *decoupled*: each rank steps with its own gradient, rescaled to its own
mean loss (the engine divides the loss by the job's training-node count ``N``; a rank or
group with ``n`` training nodes multiplies its summed gradient by ``N / n``), and ranks meet
only as the mode says (gossip pairs as in the thesis that trained Cluster-GCN partitions
with gossip and a work pool; grouped and partial reduction as in the straggler-mitigation
studies g-ARAR and mw-PR). Where ranks meet in a step they take a *sync step*: before the
optimizer step the members average their state (parameters and the optimizer's state per
parameter: Adam's moments, SGD's momentum) *and* their gradients, weighted by training nodes,

.. math::
    s = \frac{\sum_{r} n_r s_r}{\sum_r n_r}, \qquad
    g = \frac{\sum_{r} n_r g_r}{\sum_r n_r},

and every member then takes the same optimizer step from ``s`` with ``g``, the gradient of the
members' mean loss. Averaging after the step instead averages ``m_r / sqrt(v_r)``, Adam's
normalised steps, which is not the step of the averaged gradient: a round of every rank
each step then fell 0.8 points below ``allreduce`` on Cora, where the sync step *is* the
synchronous step (to float rounding; tested). The modes:

* ``grouped:G[:N]`` (g-ARAR): the first step sums gradients over every rank and times each
  rank's own work (its time outside waits); ranks sorted by that time are cut into ``N``
  groups (default 2) of near-equal size, every rank deciding the same from the same gathered
  times. From then on gradients are summed inside the group every step, and every ``G``
  steps the group leaders (each group's first rank) take the sync step for their groups:
  they average state and group gradients weighted by the groups' training nodes and
  broadcast it in their group, so that step is every rank's.
* ``partial:P`` (mw-PR): after its backward a rank takes an arrival number ``a`` (1-based)
  from a counter in the job's store; arrivals ``kP+1 .. kP+P`` form round ``k``, whose
  members take the sync step together (the last round of a step holds the ``world mod P``
  left over). Rounds are per step, so no round waits for a rank that is itself waiting in
  a collective of a later step: deadlock-free.
* ``gossip:K`` (GossipGCN): every ``K`` steps each rank pairs with a random available
  partner and the two take the sync step. Pairing takes locks in the store in a fixed order
  (the lower rank's first, ``compare_set``, never blocking; a failed second lock releases
  the first), so no cycle of waits can form; a rank is left alone only when every other
  rank is already paired (odd world). Once paired, the exchange always completes.

Every sum of a round or pair is taken in rank order in float64, so each member computes
bit-identical values whatever the arrival order. In every decoupled mode all ranks
average parameters and moments exactly once more, weighted by training nodes (an
all-reduce, :meth:`Decoupled.average_all`) before every evaluation, every checkpoint and
at the end, so evaluation and checkpoints see one model; per-epoch figures are
gathered only there too (:class:`EpochTables`), so no other barrier remains in an epoch.
Adam's step count stays each rank's own (equal without a work pool: one step per epoch).
The learning rate of an epoch (``--lr-schedule``) is every rank's alike, and ``--grad-clip``
clips the gradient a rank steps with: after a sync step's average, alike on its members.

Waits on other ranks inside the store or the group collectives time out after
``--timeout`` and end the job naming the rank that stopped (:meth:`Comm.who_stopped`).
"""

from __future__ import annotations

import logging
import random
import struct
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from bnsgcn.comm.communicator import Comm
from bnsgcn.config import SyncMode
from bnsgcn.errors import PeerLost, peer_lost_message
from bnsgcn.metrics.accounting import COLUMNS, INDEX, EpochAccount
from bnsgcn.nn.model import parameters_in_forward_order
from bnsgcn.nn.optim import Optimizer
from bnsgcn.sync.reducer import GradientReducer

POLL_S = 0.002  # between looks at the store while pairing (a round trip is ~0.1 ms)


class ParameterSync:
    """``--sync allreduce``: the bucketed gradient all-reduce, nothing else."""

    decoupled = False

    def __init__(self, reducer: GradientReducer | None = None) -> None:
        self.reducer = reducer

    def finish(self) -> None:
        """After backward: the gradients this rank steps with."""
        self.reducer.finish()

    def before_step(self, step: int) -> None:
        """Before the optimizer step ``step`` (0-based epoch), after :meth:`finish`: the
        mode's averaging."""

    def average_all(self) -> None:
        """Every rank: make all parameters equal (a sync point)."""

    def is_sync_point(self, scheduled: bool) -> bool:
        """Whether every rank meets after this epoch (``scheduled``: an evaluation or a
        checkpoint follows it): always, here."""
        return True


class Decoupled(ParameterSync):
    """What every decoupled mode shares: the flat parameter vector, local gradient scaling,
    the final exact average, and failing with the stopped rank named."""

    decoupled = True

    def __init__(
        self,
        comm: Comm,
        model: nn.Module,
        optimizer: Optimizer,
        mode: SyncMode,
        local_train: int,
        global_train: int,
        seed: int,
        log: logging.Logger,
    ) -> None:
        super().__init__()
        self.comm, self.mode, self.log, self.optimizer = comm, mode, log, optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.local_train, self.global_train, self.seed = local_train, global_train, seed
        self.scale = _scale(global_train, local_train)
        self.timeout = timedelta(seconds=comm.timeout)

    def weight(self) -> float:
        """This rank's weight in every average: its training nodes, as in the job's loss."""
        return float(self.local_train)

    def averaged(self, grads: bool = False) -> list[Tensor]:
        """What an average covers: the parameters, then the optimizer's per-parameter state
        (Adam's moments, SGD's momentum buffer). Averaging the moments too matters: with each rank's own second
        moment, a coordinate that a rank's data never touches (sparse features, partitions
        with few classes) gets weight decay alone, which Adam normalises into a full-size
        step towards 0 on that rank; shared moments scale it by every rank's gradients, as
        the all-reduce would (on Cora, p = 0, 4 ranks: 59% test accuracy without, 81% with).
        ``grads``: then the gradients (a sync step's)."""
        tensors = [p.detach() for p in self.params]
        for p in self.params:
            state = self.optimizer.state.get(p, {})
            tensors += [state[k] for k in sorted(state) if isinstance(state[k], Tensor) and state[k].shape == p.shape]
        return tensors + ([_grad(p) for p in self.params] if grads else [])

    def flat(self, grads: bool = False) -> Tensor:
        return torch.cat([t.reshape(-1) for t in self.averaged(grads)])

    def load(self, flat: Tensor, grads: bool = False) -> None:
        offset = 0
        with torch.no_grad():
            for t in self.averaged(grads):
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def finish(self) -> None:
        _scale_grads(self.params, self.scale)

    def average_all(self) -> None:
        weighted = _with_weight(self.flat(), self.weight())
        self.comm.all_reduce(weighted, "reduction")
        self.load(_weighted_mean(weighted))

    def is_sync_point(self, scheduled: bool) -> bool:
        return scheduled

    def _lost(self, what: str) -> PeerLost:
        """A wait on other ranks ran past --timeout: name the rank that stopped, if known."""
        cause = self.comm.who_stopped()
        return PeerLost(
            peer_lost_message(
                TimeoutError(f"rank {self.comm.rank}: {what} took longer than --timeout {self.comm.timeout:g} s"), cause
            )
        )

    # parameters through the store: [rank: int32][weight: float64][float32 ...]
    def _publish(self, key: str, grads: bool = False) -> None:
        blob = (
            struct.pack("<id", self.comm.rank, self.weight())
            + self.flat(grads).to(torch.float32).cpu().numpy().tobytes()
        )
        self.comm.store.set(key, blob)
        self.comm.stats.sent["reduction"] += len(blob)

    def _average_published(self, keys: list[str], done: str, grads: bool = False) -> None:
        """Wait for ``keys`` (one blob each), then load their weighted mean
        (:meth:`_load_mean`). The last member to read (counter ``done``) frees the keys."""
        try:
            self.comm.store.wait(keys, self.timeout)
        except Exception as exc:  # a dead or hung member
            raise self._lost(f"waiting for the parameters of {len(keys)} ranks ({type(exc).__name__})") from exc
        self._load_mean(keys, grads)
        if self.comm.store.add(done, 1) == len(keys):
            for key in keys:
                self.comm.store.delete_key(key)

    def _load_mean(self, keys: list[str], grads: bool = False) -> None:
        """Load the mean of the blobs at ``keys`` (present) weighted by their ranks'
        :meth:`weight`, summed in rank order in float64."""
        blobs = sorted(
            (*struct.unpack("<id", b[:12]), b[12:]) for b in self.comm.store.multi_get(keys)
        )  # one round trip
        self.comm.stats.received["reduction"] += sum(len(b) + 12 for *_, b in blobs)
        weights = _weights([w for _, w, _ in blobs])
        total = np.zeros(len(blobs[0][2]) // 4, dtype=np.float64)
        for weight, (_, _, data) in zip(weights, blobs):
            total += weight * np.frombuffer(data, dtype=np.float32)
        self.load(torch.from_numpy(total / sum(weights)).to(self.params[0].dtype).to(self.params[0].device), grads)


class Grouped(Decoupled):
    """``grouped:G[:N]`` (see the module)."""

    WARMUP_STEPS = 1  # steps summed over every rank, the last of them timed to form the groups

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.group = self.leaders = None  # None: every rank (the warm-up)
        self.members: list[int] = list(range(self.comm.world_size))
        self.mark = time.perf_counter()
        self.busy = 0.0
        self.steps = 0
        self.scale = 1.0  # the sum over every rank is the job's gradient already

    def finish(self) -> None:
        self.busy = time.perf_counter() - self.mark  # this step's own work: no wait yet
        self._sum_grads()
        _scale_grads(self.params, self.scale)

    def _sum_grads(self, extra: tuple[float, ...] = ()) -> list[float]:
        """Sum the gradients, and ``extra`` numbers, over the group (every rank in the
        warm-up) in one flat all-reduce; returns the summed ``extra``."""
        grads = torch.cat(
            [_grad(p).reshape(-1) for p in self.params]
            + [torch.tensor(extra, dtype=self.params[0].dtype, device=self.params[0].device)]
        )
        if len(self.members) > 1:
            try:
                dist.all_reduce(grads, group=self.group)
            except Exception as exc:
                raise self._lost("the group's gradient all-reduce") from exc
        offset = 0
        for p in self.params:
            _grad(p).copy_(grads[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        return grads[offset:].tolist() if extra else []  # (a read of the device only when asked)

    def before_step(self, step: int) -> None:
        self._count_step(step)

    def _count_step(self, step: int) -> None:
        """Count step ``step``: form the groups after the warm-up, then every ``G`` steps
        the leaders average; the next step's own work starts here."""
        self.steps += 1
        if self.steps == self.WARMUP_STEPS:
            self._form_groups()
        elif self.group is not None and (step + 1) % self.mode.every == 0:
            self._leaders_average()
        self.mark = time.perf_counter()

    def _form_groups(self) -> None:
        """Every rank: gather (busy seconds, training nodes), cut the ranks sorted by busy
        time into N groups, create their process groups (every rank creates every group,
        in the same order) and the leaders' group."""
        gathered = self.comm.all_gather_object((self.busy, self.local_train))
        order = sorted(range(self.comm.world_size), key=lambda r: (gathered[r][0], r))
        groups = [sorted(int(r) for r in chunk) for chunk in np.array_split(order, self.mode.groups)]
        timeout = timedelta(seconds=self.comm.timeout)
        for members in groups:
            handle = dist.new_group(members, timeout=timeout)
            if self.comm.rank in members:
                self.group, self.members = handle, members
        self.leader_ranks = [members[0] for members in groups]
        self.leaders = dist.new_group(self.leader_ranks, timeout=timeout)
        self.group_train = sum(gathered[r][1] for r in self.members)
        self.scale = _scale(self.global_train, self.group_train)
        if self.comm.rank == 0:  # every rank decided the same
            self.log.info(
                "speed groups %s from the warm-up step's busy seconds %s", groups, [round(g[0], 3) for g in gathered]
            )

    def _leaders_average(self) -> None:
        """The leaders' sync step: the group leaders average their state and their groups'
        gradients weighted by the groups' training nodes and broadcast it in their group,
        so the step that follows is every rank's mean loss from one state."""
        if len(self.leader_ranks) == 1:
            return  # one group: its ranks hold the same parameters already
        flat = _with_weight(self.flat(grads=True), float(self.group_train))  # a leader stands for its group
        try:
            if self.comm.rank in self.leader_ranks:
                dist.all_reduce(flat, group=self.leaders)
            if len(self.members) > 1:
                dist.broadcast(flat, src=self.members[0], group=self.group)
        except Exception as exc:
            raise self._lost("the group leaders' parameter average") from exc
        self.load(_weighted_mean(flat), grads=True)


class Partial(Decoupled):
    """``partial:P`` (see the module)."""

    def before_step(self, step: int) -> None:
        self._round(f"sync/partial/{step}/", self.comm.world_size, grads=True)

    def _round(self, prefix: str, arrivals: int, grads: bool = False) -> None:
        """Join the round of this arrival among ``arrivals`` counted under ``prefix``;
        ``grads``: the gradients are averaged with the state (a sync step)."""
        store, size_p = self.comm.store, self.mode.every
        arrival = store.add(prefix + "arrivals", 1) - 1
        round_, position = divmod(arrival, size_p)
        size = min(size_p, arrivals - round_ * size_p)
        keys = [f"{prefix}{round_}/{i}" for i in range(size)]
        self._publish(keys[position], grads)
        self._average_published(keys, f"{prefix}{round_}/read", grads)


class Gossip(Decoupled):
    """``gossip:K`` (see the module)."""

    def before_step(self, step: int) -> None:
        if (step + 1) % self.mode.every:
            return
        partner = self.pair(step)
        if partner is None:
            return
        prefix = f"sync/gossip/{step}/"
        self._publish(f"{prefix}params/{self.comm.rank}", grads=True)
        pair = sorted((self.comm.rank, partner))
        self._average_published([f"{prefix}params/{r}" for r in pair], f"{prefix}read/{pair[0]}:{pair[1]}", grads=True)

    def pair(self, step: int) -> int | None:
        """This rank's partner for the gossip round after ``step`` (:func:`find_partner`)."""
        try:
            return find_partner(
                self.comm.store,
                self.comm.rank,
                self.comm.world_size,
                f"sync/gossip/{step}/",
                random.Random(f"gossip/{self.seed}/{self.comm.rank}/{step}"),
                self.comm.timeout,
            )
        except TimeoutError as exc:
            raise self._lost(f"finding a gossip partner after step {step + 1}") from exc


FREE = "free"


def find_partner(store: dist.Store, me: int, world: int, prefix: str, rng: random.Random, timeout: float) -> int | None:
    """Pair rank ``me`` with a random available rank for one gossip round (keys under
    ``prefix``), or None when every other rank is paired already; every rank of the job
    calls it once per round. Locks ``lock/r`` hold ``free`` or an attempt ``"lo:hi:taker"``;
    a pair is made when both its locks hold the same attempt, and is final. The taker locks
    the lower rank first (``compare_set``, which never blocks) and releases it when the
    higher is taken, so no cycle of waits can form. The taker is in the value because two
    ranks may try the same pair at once: ``compare_set`` answers with the value it finds,
    and with ``"lo:hi"`` alone the second would take the first one's lock for its own and
    release it, after which the first could still take the higher lock and leave with a
    partner that waits forever. :class:`TimeoutError` after ``timeout`` seconds (a rank
    that never arrives)."""
    lock = lambda r: f"{prefix}lock/{r}"  # noqa: E731
    store.set(lock(me), FREE)  # before announcing: nobody locks an absent rank
    store.set(f"{prefix}here/{me}", "1")
    deadline = time.monotonic() + timeout
    others = [r for r in range(world) if r != me]
    while True:
        mine = store.get(lock(me)).decode()
        if mine != FREE:  # someone locked this rank: made, or being made
            lo, hi = _members(mine)
            other = hi if lo == me else lo
            if store.get(lock(other)).decode() == mine:
                return other
        else:
            here = [r for r in others if store.check([f"{prefix}here/{r}"])]
            states = {r: store.get(lock(r)).decode() for r in here}
            free = [r for r in here if states[r] == FREE]
            if free:
                other = rng.choice(free)
                lo, hi = sorted((me, other))
                tag = f"{lo}:{hi}:{me}"
                if store.compare_set(lock(lo), FREE, tag).decode() == tag:  # the lower first: a fixed order
                    if store.compare_set(lock(hi), FREE, tag).decode() == tag:
                        return other
                    store.compare_set(lock(lo), tag, FREE)  # release; try again
            elif len(here) == len(others) and all(_paired(store, lock, states[r], me) for r in here):
                return None  # every other rank is in a made pair without this one: none is left
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {me}: no gossip partner within {timeout:g} s")
        time.sleep(POLL_S * (1 + rng.random()))  # jitter: two ranks do not retry in step


def _paired(store, lock, state: str, me: int) -> bool:
    """Whether a lock's state is a made pair (both locks hold it) without rank ``me``: such
    a pair is final. (A pair with ``me`` may have been made since ``me`` read its own lock.)"""
    if state == FREE:
        return False
    lo, hi = _members(state)
    return me not in (lo, hi) and store.get(lock(lo)).decode() == state and store.get(lock(hi)).decode() == state


def _members(state: str) -> tuple[int, int]:
    """The two ranks of a lock's attempt ``"lo:hi:taker"``."""
    lo, hi, _ = state.split(":")
    return int(lo), int(hi)


def _scale(global_train: int, local_train: int) -> float:
    """Gradient factor N / n that turns the engine's loss (divided by the job's N training
    nodes) into the mean over these n; a rank with none steps with no gradient."""
    return global_train / local_train if local_train else 0.0


def _weights(weights: list[float]) -> list[float]:
    """Weights of an average; equal where every member has weight 0 (no training node)."""
    return weights if sum(weights) > 0 else [1.0] * len(weights)


def _with_weight(flat: Tensor, weight: float) -> Tensor:
    """``[weight * flat, weight]``: summed over ranks, :func:`_weighted_mean` of it is their
    mean weighted by ``weight``."""
    return torch.cat([flat * weight, flat.new_tensor([weight])])


def _weighted_mean(summed: Tensor) -> Tensor:
    return summed[:-1] / summed[-1]


def _grad(p: nn.Parameter) -> Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


def _scale_grads(params: list[nn.Parameter], scale: float) -> None:
    if scale != 1.0:
        for p in params:
            _grad(p).mul_(scale)


def make_sync(
    mode: SyncMode,
    comm: Comm,
    model,
    optimizer: Optimizer,
    bucket_bytes: int,
    local_train: int,
    global_train: int,
    seed: int,
    log: logging.Logger,
) -> ParameterSync:
    """The job's parameter sync. ``allreduce`` builds the gradient reducer exactly as before
    (its hooks are registered only then: decoupled modes must not sum over every rank)."""
    if not mode.decoupled:
        return ParameterSync(GradientReducer(parameters_in_forward_order(model), comm, bucket_bytes))
    cls = {"grouped": Grouped, "partial": Partial, "gossip": Gossip}[mode.kind]
    return cls(comm, model, optimizer, mode, local_train, global_train, seed, log)


class EpochTables:
    """Every rank's figures per epoch (float64 [world, len(COLUMNS)]). With ``allreduce`` one
    gather per epoch (:meth:`EpochAccount.gather`, a barrier). Decoupled modes keep their
    rows and gather them at sync points only, all in one all-reduce; the barrier's wait is
    the idle time of the last epoch before it."""

    def __init__(self, comm: Comm, decoupled: bool) -> None:
        self.comm, self.decoupled = comm, decoupled
        self.pending: list[tuple[int, Tensor]] = []

    def collect(self, epoch: int, account: EpochAccount, sync_point: bool) -> list[tuple[int, Tensor]]:
        """``(epoch, table)`` of every epoch gathered now (none between sync points)."""
        if not self.decoupled:
            return [(epoch, account.gather(self.comm))]
        if not sync_point:
            self.pending.append((epoch, account.row()))
            return []
        row = account.row()  # resolved first: the device's work is done before the barrier
        start = time.perf_counter()
        self.comm.barrier()  # every rank's rows are final: the wait is for the slowest
        row[INDEX["time_idle"]] = time.perf_counter() - start
        self.pending.append((epoch, row))
        epochs = [e for e, _ in self.pending]
        stacked = torch.zeros(len(epochs), self.comm.world_size, len(COLUMNS), dtype=torch.float64)
        stacked[:, self.comm.rank] = torch.stack([row for _, row in self.pending])
        stacked = self.comm.all_reduce(stacked.to(self.comm.device, non_blocking=True)).cpu()
        self.pending = []
        return list(zip(epochs, stacked.unbind(0)))
