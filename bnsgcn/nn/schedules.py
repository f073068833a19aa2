r"""The learning rate of each epoch: ``--warmup-epochs``, then ``--lr-schedule``.

The rate is set once per epoch, before its steps (with ``--work-pool`` an epoch may take
several, all at that rate). For epoch :math:`i = 1, 2, \dots` with :math:`W` warm-up epochs
and :math:`t = i - W - 1` the epochs since the warm-up ended:

* warm-up, :math:`i \le W`: :math:`\eta \cdot i / (W + 1)`, a straight line whose next point
  is :math:`\eta` (``--lr``), where the schedule starts;
* ``none``: :math:`\eta`;
* ``cosine``: :math:`\eta (1 + \cos(\pi t / T)) / 2` over :math:`T` = ``--cosine-epochs``
  (default: the rest of the run), ``CosineAnnealingLR``'s closed form; the run ends before
  the rate reaches 0 (a shorter :math:`T` is refused);
* ``step``: :math:`\eta \gamma^{\lfloor t / S \rfloor}`, ``StepLR`` with ``--lr-gamma`` and
  ``--lr-step-epochs``;
* ``plateau``: :math:`\eta f^c` after :math:`c` cuts, ``ReduceLROnPlateau`` on the
  validation score: a cut when ``--plateau-patience`` evaluations in a row brought no
  validation score above the best so far (the count starts again after each cut). Only the
  evaluations ``--eval-every`` schedules after the warm-up count, not the one a run adds
  after its last epoch: a run stopped early and resumed sees exactly the evaluations of the
  uninterrupted run. Every rank sees the same score (its counts are summed over ranks), so
  every rank cuts alike, whatever ``--sync``.

Every rate but the plateau's is a function of the epoch alone; the plateau keeps its best
score, its count and its cuts, which checkpoints carry (:meth:`Schedule.state_dict`).
"""

from __future__ import annotations

import math

from bnsgcn.config import OptimConfig


class Schedule:
    """``none``: ``--lr`` after the warm-up. Subclasses scale it by :meth:`factor`."""

    def __init__(self, settings: OptimConfig, epochs: int) -> None:
        self.base, self.warmup = settings.lr, settings.warmup_epochs

    def lr(self, epoch: int) -> float:
        """The rate of the steps of ``epoch`` (0-based)."""
        if epoch < self.warmup:
            return self.base * (epoch + 1) / (self.warmup + 1)
        return self.base * self.factor(epoch - self.warmup)  # x * 1.0 is x: none keeps --lr's bits

    def factor(self, t: int) -> float:
        """The rate's factor ``t`` epochs (0-based) after the warm-up."""
        return 1.0

    def evaluated(self, epoch: int, val_score: float) -> None:
        """A scheduled evaluation after ``epoch`` (1-based) gave ``val_score``."""

    def settings(self) -> dict:
        """This schedule's own settings, by flat name (what a resumed run must share)."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Cosine(Schedule):
    def __init__(self, settings: OptimConfig, epochs: int) -> None:
        super().__init__(settings, epochs)
        self.length = settings.cosine_length(epochs)

    def factor(self, t: int) -> float:
        return (1 + math.cos(math.pi * t / self.length)) / 2

    def settings(self) -> dict:
        return {"cosine_epochs": self.length}


class Step(Schedule):
    def __init__(self, settings: OptimConfig, epochs: int) -> None:
        super().__init__(settings, epochs)
        self.every, self.gamma = settings.lr_step_epochs, settings.lr_gamma

    def factor(self, t: int) -> float:
        return self.gamma ** (t // self.every)

    def settings(self) -> dict:
        return {"lr_step_epochs": self.every, "lr_gamma": self.gamma}


class Plateau(Schedule):
    def __init__(self, settings: OptimConfig, epochs: int) -> None:
        super().__init__(settings, epochs)
        self.patience, self.cut = settings.plateau_patience, settings.plateau_factor
        self.best, self.bad, self.cuts = -math.inf, 0, 0

    def factor(self, t: int) -> float:
        return self.cut**self.cuts

    def evaluated(self, epoch: int, val_score: float) -> None:
        if epoch <= self.warmup:
            return  # the rising rate is no plateau
        if val_score > self.best:
            self.best, self.bad = val_score, 0
            return
        self.bad += 1
        if self.bad >= self.patience:
            self.cuts, self.bad = self.cuts + 1, 0

    def settings(self) -> dict:
        return {"plateau_patience": self.patience, "plateau_factor": self.cut}

    def state_dict(self) -> dict:
        return {"best": self.best, "bad": self.bad, "cuts": self.cuts}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.bad, self.cuts = float(state["best"]), int(state["bad"]), int(state["cuts"])


# --lr-schedule NAME -> its schedule (the names are bnsgcn.config.sections.LR_SCHEDULES)
SCHEDULES: dict[str, type[Schedule]] = {"none": Schedule, "cosine": Cosine, "step": Step, "plateau": Plateau}
