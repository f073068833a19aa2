r"""Parameter sync with a work pool (``--work-pool``, :mod:`bnsgcn.sync.workpool`), where ranks
take different numbers of steps per epoch: no mode may wait for a fixed step of every rank.

A pool step leaves each rank with the gradient of its partition's summed loss. Then:

* ``allreduce``: lockstep *rounds* over every rank. In a round every rank takes at most one
  partition; the gradients and two numbers, the round's training nodes :math:`n` and the
  partitions taken, are summed in one flat all-reduce, and every rank steps with
  :math:`\frac{1}{n}\sum_{\text{ranks}} \nabla \sum_{v \in T_k} \ell_v`, the same on every
  rank. The pool hands indices out in order, so once a rank finds it empty every later
  take does too: a round in which fewer partitions than ranks were taken is the epoch's last.
* ``grouped:G[:N]``: the same rounds inside each speed group (formed in the first round from
  the ranks' busy seconds, as without a pool, less the time of building the partition's
  graph, which a rank does once per partition). Every ``G`` rounds a group's leader publishes
  its parameters in the store, takes the mean of the newest parameters every leader has
  published (its own included) and broadcasts it in its group: g-ARPS, as the
  straggler-mitigation studies of grouped reduction named it. No leader waits for another
  group, which may have run out of partitions.
* ``partial:P``: each step on a partition is one arrival; an epoch has ``K`` of them
  (one per partition), counted in the store, and arrivals ``kP+1 .. kP+P`` form a round (the
  last holds ``K mod P``). With ``P <= W`` ranks no round waits for ever: at most
  ``P - 1`` ranks wait in the one round still filling, so some rank is still working on
  the epoch's partitions, whose steps arrive.
* ``gossip:K``: asynchronous pairs (GossipGCN). Every ``K`` of its own steps a rank picks a
  random *available* partner, one whose lock in the store is ``free``, and locks both
  (lower rank first, ``compare_set``, never blocking; a failed second lock releases the
  first). A rank checks its own lock after every step and at sync points: once both locks
  of a pair hold the pair's tag it publishes its parameters and both take the pair's mean,
  so the initiator waits at most one step of its partner. Before a sync point a rank sets
  its lock to ``away`` (serving any pair made with it first), so no rank waits on one that
  waits in a collective; it is ``free`` again when its next epoch starts.

In every mode but ``allreduce`` all ranks average parameters exactly once more before every
evaluation, every checkpoint and at the end (:meth:`Decoupled.average_all`).
"""

from __future__ import annotations

import random
import time

import torch

from bnsgcn.sync.averaging import (
    POLL_S,
    Decoupled,
    Grouped,
    ParameterSync,
    Partial,
    _grad,
)


class PoolSync:
    """What the pool loop asks of a sync mode (mixed into the classes below)."""

    lockstep = False  # rounds: every member steps together (allreduce, grouped)

    def weight(self) -> float:
        """Equal weights: a rank's steps are on whichever partitions it took."""
        return 1.0

    def start_epoch(self) -> None:
        """Before the epoch's first take."""

    def not_busy(self, seconds: float) -> None:
        """``seconds`` of this step were not the rank's speed (building a partition's graph,
        once): speed groups leave them out."""

    def finish_round(self, num_train: int, took: bool) -> tuple[bool, bool]:
        """Lockstep modes, after backward (gradients of the summed loss, zero when nothing
        was taken): (step with the round's gradient, the epoch goes on)."""
        raise NotImplementedError

    def after_pool_step(self, epoch: int) -> None:
        """After each step (lockstep: each round) of ``epoch``."""


def _mean_over_round(sync: Grouped, num_train: int, took: bool) -> tuple[bool, bool]:
    """Sum gradients, training nodes and partitions taken over the round's members; the
    gradient becomes the mean over the round's training nodes."""
    total_train, total_took = sync._sum_grads((float(num_train), float(took)))
    if total_train > 0:
        for p in sync.params:
            _grad(p).div_(total_train)
    return total_train > 0, total_took == len(sync.members)


class PoolAllReduce(PoolSync, Grouped):
    """``allreduce`` with a pool: lockstep rounds over every rank (one group, for ever)."""

    lockstep = True
    decoupled = False

    def finish_round(self, num_train: int, took: bool) -> tuple[bool, bool]:
        return _mean_over_round(self, num_train, took)

    def after_pool_step(self, epoch: int) -> None:
        """Every rank holds the same parameters already."""

    def is_sync_point(self, scheduled: bool) -> bool:
        return ParameterSync.is_sync_point(self, scheduled)

    def average_all(self) -> None:
        """Every rank holds the same parameters already."""


class PoolGrouped(PoolSync, Grouped):
    """``grouped:G[:N]`` with a pool (see the module)."""

    lockstep = True

    def not_busy(self, seconds: float) -> None:
        self.mark += seconds

    def finish_round(self, num_train: int, took: bool) -> tuple[bool, bool]:
        self.busy = time.perf_counter() - self.mark
        return _mean_over_round(self, num_train, took)

    def after_pool_step(self, epoch: int) -> None:
        self._count_step(self.steps)  # rounds of the group, counted over epochs

    def _leaders_average(self) -> None:
        if len(self.leader_ranks) == 1:
            return
        flat = self.flat()
        if self.comm.rank in self.leader_ranks:
            prefix = "sync/grouped/leader/"
            self._publish(f"{prefix}{self.comm.rank}")  # replaces this leader's previous
            self._load_mean([f"{prefix}{r}" for r in self.leader_ranks if self.comm.store.check([f"{prefix}{r}"])])
            flat = self.flat()
        if len(self.members) > 1:
            try:
                torch.distributed.broadcast(flat, src=self.members[0], group=self.group)
            except Exception as exc:
                raise self._lost("the group leader's parameter broadcast") from exc
            self.load(flat)


class PoolPartial(PoolSync, Partial):
    """``partial:P`` with a pool (see the module)."""

    def __init__(self, *args, num_parts: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_parts = num_parts

    def after_pool_step(self, epoch: int) -> None:
        self._round(f"sync/partial/epoch{epoch}/", self.num_parts)


FREE, AWAY = "free", "away"


class PoolGossip(PoolSync, Decoupled):
    """``gossip:K`` with a pool: asynchronous pairs (see the module)."""

    PREFIX = "sync/pool-gossip/"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.own_steps = 0
        self.wants_partner = False
        self.rng = random.Random(f"gossip/{self.seed}/{self.comm.rank}")
        self.comm.store.set(self._lock(self.comm.rank), AWAY)
        self.comm.barrier()  # every lock exists before any rank reads one

    def _lock(self, rank: int) -> str:
        return f"{self.PREFIX}lock/{rank}"

    def start_epoch(self) -> None:
        self.comm.store.compare_set(self._lock(self.comm.rank), AWAY, FREE)

    def after_pool_step(self, epoch: int) -> None:
        self._serve()
        self.own_steps += 1
        self.wants_partner |= self.own_steps % self.mode.every == 0
        if self.wants_partner and (pair := self._try_pair()) is not None:
            self._exchange(*pair)
            self.wants_partner = False

    def average_all(self) -> None:
        self._withdraw()
        super().average_all()

    def _made(self, tag: str) -> int | None:
        """The partner of a pair ``tag`` holding this rank's lock, once both locks hold it."""
        lo, hi = (int(r) for r in tag.split("/")[0].split(":"))
        other = hi if lo == self.comm.rank else lo
        return other if self.comm.store.get(self._lock(other)).decode() == tag else None

    def _serve(self) -> bool:
        """Complete a pair another rank made with this one, if any; whether one was."""
        mine = self.comm.store.get(self._lock(self.comm.rank)).decode()
        if mine in (FREE, AWAY) or (other := self._made(mine)) is None:
            return False
        self._exchange(mine, other)
        return True

    def _try_pair(self) -> tuple[str, int] | None:
        """Lock this rank and a random free one, lower rank first: (tag, partner) or None."""
        store, me = self.comm.store, self.comm.rank
        if store.get(self._lock(me)).decode() != FREE:
            return None  # chosen by someone, or being: served after the next step
        free = [r for r in range(self.comm.world_size) if r != me and store.get(self._lock(r)).decode() == FREE]
        if not free:
            return None
        other = self.rng.choice(free)
        lo, hi = sorted((me, other))
        tag = f"{lo}:{hi}/{me}.{self.own_steps}"  # unique: the initiator and its step
        if store.compare_set(self._lock(lo), FREE, tag).decode() != tag:
            return None
        if store.compare_set(self._lock(hi), FREE, tag).decode() != tag:
            store.compare_set(self._lock(lo), tag, FREE)  # release: no half-made pair stays
            return None
        return tag, other

    def _exchange(self, tag: str, other: int) -> None:
        """Both members of a made pair: publish, take the pair's mean, free this rank's lock."""
        keys = [f"{self.PREFIX}{tag}/params/{r}" for r in sorted((self.comm.rank, other))]
        self._publish(f"{self.PREFIX}{tag}/params/{self.comm.rank}")
        self._average_published(keys, f"{self.PREFIX}{tag}/read")
        self.comm.store.compare_set(self._lock(self.comm.rank), tag, FREE)

    def _withdraw(self) -> None:
        """Set this rank's lock to ``away``, serving any pair made with it first."""
        store, lock = self.comm.store, self._lock(self.comm.rank)
        deadline = time.monotonic() + self.comm.timeout
        while True:
            state = store.get(lock).decode()
            if state == AWAY or (state == FREE and store.compare_set(lock, FREE, AWAY).decode() == AWAY):
                return
            if state != FREE and not self._serve() and time.monotonic() > deadline:
                raise self._lost("a gossip pair being made with this rank")
            time.sleep(POLL_S)


def make_pool_sync(
    mode, comm, model, optimizer, local_train: int, global_train: int, seed: int, log, num_parts: int
) -> Decoupled:
    """The sync of a pool job, for ``--sync`` ``mode`` (see the module)."""
    args = (comm, model, optimizer, mode, local_train, global_train, seed, log)
    if mode.kind == "allreduce":
        return PoolAllReduce(*args)
    if mode.kind == "partial":
        return PoolPartial(*args, num_parts=num_parts)
    return {"grouped": PoolGrouped, "gossip": PoolGossip}[mode.kind](*args)
