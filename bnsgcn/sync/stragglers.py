"""Straggler settings: injected per-rank delays (a testing aid) and the parameter-sync mode.

``--inject-delay R:S[,R:LO-HI...]``: rank R sleeps S seconds every epoch (with ``--work-pool``
every step, one per partition taken), or a time drawn
uniformly from [LO, HI] by a generator seeded with (``--seed``, R), so a run is repeatable.
The sleep is its own phase of the epoch (``injected_delay`` in the records and the report),
never counted as compute. It emulates a slow machine, as the straggler studies did
(REFERENCE.md section 5: slow 0.8-0.85 s, medium 0.4-0.45 s, fast 0).

``--sync MODE`` (see :mod:`bnsgcn.sync.averaging`): ``allreduce`` | ``grouped:G[:N]`` |
``partial:P`` | ``gossip:K``. Parsing and the checks that need the world size live here,
used both by the launcher (before any rank starts) and by every rank (torchrun, tests).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from bnsgcn.errors import UserError

SYNC_KINDS = ("allreduce", "grouped", "partial", "gossip")
DEFAULT_GROUPS = 2  # grouped:G without :N: a fast and a slow group


def parse_delays(spec: str | None) -> dict[int, tuple[float, float]]:
    """``"0:0.8,3:0.4-0.45"`` -> {0: (0.8, 0.8), 3: (0.4, 0.45)} (seconds); None or "" -> {}.
    Raises :class:`UserError` in one line naming the bad entry."""
    if not spec:
        return {}
    delays: dict[int, tuple[float, float]] = {}
    for entry in spec.split(","):
        rank_text, _, seconds = entry.strip().partition(":")
        low_text, dash, high_text = seconds.partition("-")
        try:
            rank, low = int(rank_text), float(low_text)
            high = float(high_text) if dash else low
        except ValueError:
            raise UserError(
                f"--inject-delay entry {entry!r} is not R:S or R:LO-HI; pass e.g. --inject-delay 0:0.8,3:0.4-0.45"
            ) from None
        if rank < 0:
            raise UserError(f"--inject-delay entry {entry!r} names rank {rank}; ranks are 0 or more")
        if not (0.0 <= low <= high < float("inf")):
            raise UserError(
                f"--inject-delay entry {entry!r} needs 0 <= LO <= HI seconds (finite); pass e.g. {rank}:0.4-0.45"
            )
        if rank in delays:
            raise UserError(f"--inject-delay names rank {rank} twice; give each rank one entry")
        delays[rank] = (low, high)
    return delays


@dataclass(frozen=True)
class SyncMode:
    """A parsed ``--sync``: ``kind`` and its numbers. ``every``: G steps between leader
    averages (grouped), P ranks per round (partial), K steps between gossip rounds (gossip);
    ``groups``: the number of speed groups (grouped only)."""

    kind: str = "allreduce"
    every: int = 0
    groups: int = DEFAULT_GROUPS

    @property
    def decoupled(self) -> bool:
        """Ranks do not sum gradients over the whole job every step: they may drift apart
        between the points where every rank meets (evaluation, checkpoint, the end)."""
        return self.kind != "allreduce"


def parse_sync(spec: str) -> SyncMode:
    """``allreduce`` | ``grouped:G[:N]`` | ``partial:P`` | ``gossip:K`` -> :class:`SyncMode`;
    :class:`UserError` in one line otherwise."""
    kind, *numbers = spec.split(":")
    usage = "choose --sync allreduce, grouped:G[:N], partial:P or gossip:K (e.g. --sync partial:2)"
    if kind not in SYNC_KINDS:
        raise UserError(f"unknown --sync {spec!r}; {usage}")
    if kind == "allreduce":
        if numbers:
            raise UserError(f"--sync allreduce takes no number (got {spec!r}); {usage}")
        return SyncMode()
    allowed = 2 if kind == "grouped" else 1
    try:
        values = [int(n) for n in numbers]
    except ValueError:
        values = []
    if not 1 <= len(values) <= allowed or any(v < 1 for v in values) or len(values) != len(numbers):
        raise UserError(
            f"--sync {spec!r} needs positive integers: {kind}:{'G[:N]' if kind == 'grouped' else 'P' if kind == 'partial' else 'K'}; {usage}"
        )
    return SyncMode(kind, values[0], values[1] if len(values) > 1 else DEFAULT_GROUPS)


def check_config(p: float, staleness: int, sync: SyncMode, norm: str) -> None:
    """What a decoupled sync needs, in one line: ranks must not wait on each other every layer."""
    if sync.decoupled and norm == "batch":
        raise UserError(
            f"--sync {sync.kind} lets ranks run apart, but --norm batch sums statistics over every rank in every layer; use --norm layer or none, or --sync allreduce"
        )
    if sync.decoupled and p > 0.0 and staleness == 0:
        raise UserError(
            f"--sync {sync.kind} only helps when ranks do not exchange boundary rows every layer, but --p is {p:g} with "
            "--staleness 0; add --staleness 1 (stale exchange) or pass --p 0, or use --sync allreduce"
        )


def check_work_pool(p: float, staleness: int, norm: str, inductive: bool) -> None:
    """What ``--work-pool`` needs, in one line: partitions trained on their own."""
    if p != 0.0:
        raise UserError(
            f"--work-pool trains each partition on its own subgraph (boundary nodes dropped), but --p is {p:g}; pass --p 0"
        )
    if staleness:
        raise UserError(
            "--work-pool exchanges no boundary rows, so --staleness 1 has nothing to delay; drop --staleness"
        )
    if norm == "batch":
        raise UserError(
            "--work-pool lets ranks take different numbers of steps, but --norm batch sums statistics over every rank in every layer; use --norm layer or none"
        )
    if inductive:
        raise UserError("--work-pool does not support --inductive; drop one of them")


def check_world(delays: dict[int, tuple[float, float]], sync: SyncMode, world_size: int) -> None:
    """The checks that need the number of ranks (the launcher's, and every rank's)."""
    beyond = sorted(r for r in delays if r >= world_size)
    if beyond:
        raise UserError(
            f"--inject-delay names rank {beyond[0]}, but the job has {world_size} ranks (0 to {world_size - 1})"
        )
    if sync.kind == "partial" and sync.every > world_size:
        raise UserError(
            f"--sync partial:{sync.every} averages {sync.every} ranks per round, but the job has {world_size}; pass P <= {world_size}"
        )
    if sync.kind == "grouped" and sync.groups > world_size:
        raise UserError(
            f"--sync grouped:{sync.every}:{sync.groups} asks for {sync.groups} groups of {world_size} ranks; pass N <= {world_size}"
        )


def check_flags(config, world_size: int) -> None:
    """``--inject-delay`` and ``--sync`` of a :class:`bnsgcn.config.TrainConfig` against the
    job's ``world_size`` (the launcher's check before any rank starts; every rank repeats it)."""
    check_world(parse_delays(config.inject_delay), parse_sync(config.sync), world_size)


class InjectedDelay:
    """This rank's per-epoch sleep (none for ranks the flag does not name)."""

    def __init__(self, delays: dict[int, tuple[float, float]], rank: int, seed: int) -> None:
        self.low, self.high = delays.get(rank, (0.0, 0.0))
        # its own generator: drawing delays never moves the sampling or dropout streams
        self.rng = random.Random(f"inject-delay/{seed}/{rank}")

    def __bool__(self) -> bool:
        return self.high > 0.0

    def seconds(self) -> float:
        """The next epoch's delay: fixed, or uniform in [low, high]."""
        return self.low if self.low == self.high else self.rng.uniform(self.low, self.high)

    def sleep(self) -> float:
        """Sleep one epoch's delay; returns it."""
        seconds = self.seconds()
        time.sleep(seconds)
        return seconds
