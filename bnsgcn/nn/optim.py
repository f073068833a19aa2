r"""The optimizers as the engine uses them, without ``torch.optim``, and the one factory that
builds a run's optimisation (:func:`make_optimization`): ``--optimizer``, ``--lr-schedule``
(:mod:`bnsgcn.nn.schedules`) and ``--grad-clip``.

Why not ``torch.optim``: its base class wraps ``add_param_group`` in
``torch._disable_dynamo``, which imports ``torch._dynamo`` when an optimizer is built, and
that alone adds about 80 MiB to every rank's resident memory (measured with torch 2.13:
219 -> 301 MiB in a bare process), more than the model's parameters, gradients and Adam's
state together on a 200k-node graph. The engine needs three plain optimizers only.

For each parameter :math:`\theta` with gradient :math:`g` (parameters without a gradient
are skipped, as ``torch.optim`` skips them), at its step :math:`t`, with learning rate
:math:`\eta` and weight decay :math:`\lambda`:

* :class:`Adam` (``adam``):

  .. math::
      g \leftarrow g + \lambda \theta, \qquad
      m \leftarrow m + (1 - \beta_1)(g - m), \qquad
      v \leftarrow \beta_2 v + (1 - \beta_2) g^2,

  .. math::
      \theta \leftarrow \theta - \frac{\eta}{1 - \beta_1^t} \cdot
      \frac{m}{\sqrt{v} / \sqrt{1 - \beta_2^t} + \epsilon}

* :class:`AdamW` (``adamw``): Adam with the decay decoupled from the gradient,
  :math:`\theta \leftarrow \theta (1 - \eta \lambda)` first and no :math:`\lambda \theta` in
  :math:`g`;
* :class:`SGD` (``sgd``): :math:`g \leftarrow g + \lambda \theta`; with momentum :math:`\mu`,
  :math:`b \leftarrow \mu b + g` and the step takes :math:`b` (Nesterov: :math:`g + \mu b`);
  :math:`\theta \leftarrow \theta - \eta g`.

Each with the same operations in the same order as ``torch.optim``'s single-tensor path (its
default on CPU), so they give the same bits there (tested). The per-parameter state (Adam's
``step``, ``exp_avg`` = m, ``exp_avg_sq`` = v; SGD's ``momentum_buffer`` = b) is made when
the optimizer is built, as the first step would make it: every rank's state then has the
same tensors from the start (the decoupled ``--sync`` modes average it,
:mod:`bnsgcn.sync.averaging`). SGD's buffer starts at zeros, where ``torch.optim`` copies the
first gradient: :math:`\mu \cdot 0 + g = g`, the same bits but for the sign of a zero. The
state dicts have ``torch.optim``'s layouts, so checkpoints load in either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from bnsgcn.config import OptimConfig
from bnsgcn.errors import UserError
from bnsgcn.nn.schedules import SCHEDULES, Schedule

HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")  # Adam's and AdamW's


class Optimizer:
    """What the engine's optimizers share: their parameters, one group of hyperparameters
    (``group``, ``torch.optim``'s names), the state per parameter (made when built), and the
    state dict in ``torch.optim``'s layout."""

    hyperparameters: tuple[str, ...] = ()
    state_keys: tuple[str, ...] = ()  # the per-parameter tensors of the state
    torch_flags: dict = {}  # what torch.optim's group also holds (a state dict loads there)

    def __init__(self, params: Iterable[nn.Parameter], group: dict) -> None:
        self.params = list(params)
        self.group = group
        self.state: dict[Tensor, dict[str, Tensor]] = {p: self._new_state(p) for p in self.params}

    def _new_state(self, p: nn.Parameter) -> dict[str, Tensor]:
        return {key: torch.zeros_like(p, memory_format=torch.preserve_format) for key in self.state_keys}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def step(self) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        """``torch.optim``'s layout: state by parameter index, one parameter group."""
        group = dict(self.group) | self.torch_flags | {"params": list(range(len(self.params)))}
        return {
            "state": {i: self.state[p] for i, p in enumerate(self.params) if self.state[p]},
            "param_groups": [group],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state of :meth:`state_dict` (or of the ``torch.optim`` optimizer of the same
        kind over the same parameters, in the same order); its hyperparameters win, as in
        ``torch.optim``."""
        groups = state_dict["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(self.params):
            raise ValueError(
                f"optimizer state for {sum(len(g['params']) for g in groups)} parameters in {len(groups)} groups; "
                f"this model has {len(self.params)} in one"
            )
        for index, p in zip(groups[0]["params"], self.params):  # checked before anything changes
            saved = state_dict["state"].get(index) or {}
            for key in self.state_keys:
                if key in saved and saved[key].shape != p.shape:
                    raise ValueError(
                        f"optimizer state {key} of parameter {index} has shape {tuple(saved[key].shape)}, the "
                        f"parameter {tuple(p.shape)}"
                    )
            missing = [key for key in self.state_keys if saved and key not in saved]
            if missing:
                raise ValueError(f"optimizer state of parameter {index} has no {missing[0]}: another optimizer's")
        self.group = {
            k: (tuple(groups[0][k]) if isinstance(groups[0][k], list) else groups[0][k]) for k in self.hyperparameters
        }
        for index, p in zip(groups[0]["params"], self.params):
            saved = state_dict["state"].get(index)
            if saved:  # else never stepped in the saved run: the zeros made above
                self._load_state(p, saved)

    def _load_state(self, p: nn.Parameter, saved: dict) -> None:
        for key in self.state_keys:
            self.state[p][key] = saved[key].detach().to(p.device, p.dtype).clone()


class Adam(Optimizer):
    """Adam with L2 weight decay (see the module)."""

    hyperparameters = HYPERPARAMETERS
    state_keys = ("exp_avg", "exp_avg_sq")
    torch_flags = {
        "amsgrad": False,
        "maximize": False,
        "foreach": None,
        "capturable": False,
        "differentiable": False,
        "fused": None,
    }
    decoupled = False

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        lr: float,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        # the step counts again as numbers: the step reads no tensor (on CUDA the state's
        # "step" stays on the CPU anyway, as in torch.optim, but a read is a read)
        self.steps = {p: 0 for p in self.params}

    def _new_state(self, p: nn.Parameter) -> dict[str, Tensor]:
        return {"step": torch.tensor(0.0)} | super()._new_state(p)

    @torch.no_grad()
    def step(self) -> None:
        lr, (beta1, beta2), eps, weight_decay = (self.group[k] for k in HYPERPARAMETERS)
        for p in self.params:
            if p.grad is None:
                continue
            state = self.state[p]
            grad, exp_avg, exp_avg_sq = p.grad, state["exp_avg"], state["exp_avg_sq"]
            state["step"] += 1
            self.steps[p] += 1
            if weight_decay != 0:
                if self.decoupled:
                    p.mul_(1 - lr * weight_decay)
                else:
                    grad = grad.add(p, alpha=weight_decay)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            step = self.steps[p]
            bias_correction2_sqrt = (1 - beta2**step) ** 0.5
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
            p.addcdiv_(exp_avg, denom, value=-(lr / (1 - beta1**step)))

    def _load_state(self, p: nn.Parameter, saved: dict) -> None:
        super()._load_state(p, saved)
        self.steps[p] = int(saved["step"])
        self.state[p]["step"] = saved["step"].detach().to(torch.float32).cpu().clone()


class AdamW(Adam):
    """Adam with decoupled weight decay (see the module)."""

    torch_flags = Adam.torch_flags | {"decoupled_weight_decay": True}
    decoupled = True


class SGD(Optimizer):
    """SGD with L2 weight decay, momentum and Nesterov momentum (see the module)."""

    hyperparameters = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
    torch_flags = {"maximize": False, "foreach": None, "differentiable": False, "fused": None}

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        # no momentum, no buffer (as in torch.optim): nothing to keep or to average
        self.state_keys = ("momentum_buffer",) if momentum else ()
        group = {"lr": lr, "momentum": momentum, "dampening": 0, "weight_decay": weight_decay, "nesterov": nesterov}
        super().__init__(params, group)

    @torch.no_grad()
    def step(self) -> None:
        lr, momentum, dampening, weight_decay, nesterov = (self.group[k] for k in self.hyperparameters)
        for p in self.params:
            if p.grad is None:
                continue
            grad = p.grad
            if weight_decay != 0:
                grad = grad.add(p, alpha=weight_decay)
            if momentum != 0:
                buf = self.state[p]["momentum_buffer"]
                buf.mul_(momentum).add_(grad, alpha=1 - dampening)
                grad = grad.add(buf, alpha=momentum) if nesterov else buf
            p.add_(grad, alpha=-lr)


def _adam(params: list[nn.Parameter], settings: OptimConfig) -> Optimizer:
    return Adam(params, lr=settings.lr, weight_decay=settings.weight_decay)


def _adamw(params: list[nn.Parameter], settings: OptimConfig) -> Optimizer:
    return AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)


def _sgd(params: list[nn.Parameter], settings: OptimConfig) -> Optimizer:
    return SGD(
        params,
        lr=settings.lr,
        momentum=settings.momentum,
        weight_decay=settings.weight_decay,
        nesterov=settings.nesterov,
    )


# --optimizer NAME -> its builder (the names are bnsgcn.config.sections.OPTIMIZERS)
OPTIMIZERS: dict[str, Callable[[list[nn.Parameter], OptimConfig], Optimizer]] = {
    "adam": _adam,
    "adamw": _adamw,
    "sgd": _sgd,
}


def clip_grads(params: Iterable[nn.Parameter], norm: Tensor, max_norm: float) -> None:
    """Scale the gradients by ``min(1, max_norm / (norm + 1e-6))``, ``norm`` being their L2
    norm over every parameter, computed already: ``torch.nn.utils.clip_grad_norm_``'s
    operations (the same bits), on the device, with no read of the norm on the host."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))


class Optimization:
    """A run's optimisation, as :func:`make_optimization` builds it: the optimizer, the
    learning rate of each epoch (:class:`~bnsgcn.nn.schedules.Schedule`) and clipping.

    Every rank makes the same calls with the same values (the epoch, the all-reduced
    gradient's norm, the job's validation score), so every rank sets the same rate and clips
    alike."""

    def __init__(self, settings: OptimConfig, optimizer: Optimizer, schedule: Schedule) -> None:
        self.settings, self.optimizer, self.schedule = settings, optimizer, schedule
        self.clip = settings.grad_clip
        self.hyperparameters = dict(optimizer.group)  # this run's, from its flags
        self.lrs: dict[int, float] = {}  # epoch (1-based) -> its rate, until its record is written

    def start_epoch(self, epoch: int) -> None:
        """Before the steps of ``epoch`` (0-based): set its learning rate."""
        lr = self.schedule.lr(epoch)
        self.optimizer.group["lr"] = lr
        self.lrs[epoch + 1] = lr

    def step(self, grad_norm: Tensor) -> None:
        """One optimizer step, after the gradients are final (all-reduced, or the sync
        mode's); ``grad_norm``: their norm (the one the non-finite check reads)."""
        if self.clip is not None:
            clip_grads(self.optimizer.params, grad_norm, self.clip)
        self.optimizer.step()

    def evaluated(self, epoch: int, val_score: float) -> None:
        """After the evaluation scheduled by ``--eval-every`` after ``epoch`` (1-based)."""
        self.schedule.evaluated(epoch, val_score)

    def settings_dict(self) -> dict:
        """The settings, by flat name (each schedule's own only with that schedule, the
        cosine's length resolved): what a checkpoint records."""
        s = self.settings
        flat = {
            "optimizer": s.name,
            "lr": s.lr,
            "weight_decay": s.weight_decay,
            "momentum": s.momentum,
            "nesterov": s.nesterov,
            "grad_clip": s.grad_clip,
            "lr_schedule": s.lr_schedule,
            "warmup_epochs": s.warmup_epochs,
        }
        return flat | self.schedule.settings()

    def state_dict(self) -> dict:
        """What a checkpoint keeps besides the optimizer's own state: the settings and the
        schedule's state (the plateau's best score, its count and cuts)."""
        return {"settings": self.settings_dict(), "schedule": self.schedule.state_dict()}

    def resume(self, checkpoint: dict) -> str | None:
        """Continue from a checkpoint (its ``optimizer`` and ``optimization``): the optimizer's
        state, and the schedule's where the checkpoint's schedule is this one, under this
        run's flags (flags outside the checkpoint's signature may change on resume, which is
        how a run is extended). Returns the flags that changed since (:func:`settings_differ`,
        for the log). :class:`UserError` where the checkpoint holds another optimizer's state."""
        saved = saved_settings(checkpoint)
        if saved["optimizer"] != self.settings.name:
            raise UserError(
                f"holds the state of --optimizer {saved['optimizer']}, which --optimizer {self.settings.name} cannot "
                f"continue; resume with --optimizer {saved['optimizer']}, or pass a new --out"
            )
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.optimizer.group = dict(self.hyperparameters)  # torch.optim's load keeps the checkpoint's
        if "optimization" in checkpoint and saved["lr_schedule"] == self.settings.lr_schedule:
            self.schedule.load_state_dict(checkpoint["optimization"]["schedule"])
        return settings_differ(saved, self.settings_dict())


def saved_settings(checkpoint_state: dict) -> dict:
    """The optimisation settings a checkpoint was written with. One written before these
    settings existed holds only Adam's state: Adam, no schedule, no clipping, its own
    learning rate and weight decay."""
    if "optimization" in checkpoint_state:
        return checkpoint_state["optimization"]["settings"]
    group = checkpoint_state["optimizer"]["param_groups"][0]
    defaults = OptimConfig()
    return {
        "optimizer": "adam",
        "lr": group["lr"],
        "weight_decay": group["weight_decay"],
        "momentum": defaults.momentum,
        "nesterov": defaults.nesterov,
        "grad_clip": None,
        "lr_schedule": "none",
        "warmup_epochs": 0,
    }


def settings_differ(saved: dict, ours: dict) -> str | None:
    """``saved`` and ``ours`` (:meth:`Optimization.settings_dict`) as flags where they differ
    (``"--lr-schedule cosine (this run: --lr-schedule none)"``), or None where they agree."""

    def shown(key: str, value) -> str:
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            return f"no {flag}"
        if value is True:
            return flag
        return f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"

    keys = list(ours) + [k for k in saved if k not in ours]
    differ = [k for k in keys if saved.get(k) != ours.get(k)]
    if not differ:
        return None
    return ", ".join(f"{shown(k, saved.get(k))} (this run: {shown(k, ours.get(k))})" for k in differ)


def make_optimization(settings: OptimConfig, params: Iterable[nn.Parameter], epochs: int) -> Optimization:
    """The one place a run's optimizer and schedule are built, from ``--optimizer`` and
    ``--lr-schedule`` (checked already, :func:`bnsgcn.config.validate`) over ``epochs``."""
    optimizer = OPTIMIZERS[settings.name](list(params), settings)
    schedule = SCHEDULES[settings.lr_schedule](settings, epochs)
    return Optimization(settings, optimizer, schedule)
