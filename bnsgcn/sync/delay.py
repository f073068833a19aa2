"""Injected per-rank delays (``--inject-delay``), a testing aid: an emulated slow machine.

``--inject-delay R:S[,R:LO-HI...]``: rank R sleeps S seconds every epoch (with ``--work-pool``
every step, one per partition taken), or a time drawn uniformly from [LO, HI] by a
generator seeded with (``--seed``, R), so a run is repeatable. The sleep is its own phase of
the epoch (``injected_delay`` in the records and the report), never counted as compute. It
emulates a slow machine, as the straggler studies of decentralised training did (slow
ranks 0.8-0.85 s, medium 0.4-0.45 s, fast 0 per step). The flag's parsing is
:func:`bnsgcn.config.parse_delays`.
"""

from __future__ import annotations

import random
import time


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
