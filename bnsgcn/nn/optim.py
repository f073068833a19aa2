r"""Adam as the engine uses it, without ``torch.optim``.

Why not ``torch.optim.Adam``: its base class wraps ``add_param_group`` in
``torch._disable_dynamo``, which imports ``torch._dynamo`` when the optimizer is built, and
that alone adds about 80 MiB to every rank's resident memory (measured with torch 2.13:
219 -> 301 MiB in a bare process), more than the model's parameters, gradients and Adam's
state together on a 200k-node graph. The engine needs plain Adam only.

For each parameter :math:`\theta` with gradient :math:`g` (parameters without a gradient
are skipped, as ``torch.optim.Adam`` skips them), at its step :math:`t`:

.. math::
    g \leftarrow g + \lambda \theta, \qquad
    m \leftarrow m + (1 - \beta_1)(g - m), \qquad
    v \leftarrow \beta_2 v + (1 - \beta_2) g^2,

.. math::
    \theta \leftarrow \theta - \frac{\eta}{1 - \beta_1^t} \cdot
    \frac{m}{\sqrt{v} / \sqrt{1 - \beta_2^t} + \epsilon}

with the same operations in the same order as ``torch.optim.Adam``'s single-tensor path
(its default on CPU), so the two give the same bits there (tested). The state
(``step``, ``exp_avg`` = m, ``exp_avg_sq`` = v per parameter) is made when the optimizer
is built, as the first step would make it: every rank's state then has the same tensors
from the start (the decoupled ``--sync`` modes average it, :mod:`bnsgcn.sync.averaging`).
:meth:`Adam.state_dict` has ``torch.optim.Adam``'s layout, so checkpoints load in either.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")


class Adam:
    """Adam with L2 weight decay (see the module)."""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        lr: float,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        self.params = list(params)
        self.group = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        self.state: dict[Tensor, dict[str, Tensor]] = {
            p: {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
            for p in self.params
        }
        # the step counts again as numbers: the step reads no tensor (on CUDA the state's
        # "step" stays on the CPU anyway, as in torch.optim, but a read is a read)
        self.steps = {p: 0 for p in self.params}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

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
                grad = grad.add(p, alpha=weight_decay)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            step = self.steps[p]
            bias_correction2_sqrt = (1 - beta2**step) ** 0.5
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
            p.addcdiv_(exp_avg, denom, value=-(lr / (1 - beta1**step)))

    def state_dict(self) -> dict:
        """``torch.optim.Adam``'s layout: state by parameter index, one parameter group."""
        group = dict(self.group) | {
            "amsgrad": False,
            "maximize": False,
            "foreach": None,
            "capturable": False,
            "differentiable": False,
            "fused": None,
            "params": list(range(len(self.params))),
        }
        return {"state": {i: self.state[p] for i, p in enumerate(self.params)}, "param_groups": [group]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state of :meth:`state_dict` (or of ``torch.optim.Adam`` over the same
        parameters, in the same order); its hyperparameters win, as in ``torch.optim``."""
        groups = state_dict["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(self.params):
            raise ValueError(
                f"optimizer state for {sum(len(g['params']) for g in groups)} parameters in {len(groups)} groups; "
                f"this model has {len(self.params)} in one"
            )
        for index, p in zip(groups[0]["params"], self.params):  # checked before anything changes
            saved = state_dict["state"].get(index)
            for key in ("exp_avg", "exp_avg_sq") if saved is not None else ():
                if saved[key].shape != p.shape:
                    raise ValueError(
                        f"optimizer state {key} of parameter {index} has shape {tuple(saved[key].shape)}, the "
                        f"parameter {tuple(p.shape)}"
                    )
        self.group = {k: (tuple(groups[0][k]) if k == "betas" else groups[0][k]) for k in HYPERPARAMETERS}
        for index, p in zip(groups[0]["params"], self.params):
            saved = state_dict["state"].get(index)
            if saved is None:
                continue  # never stepped in the saved run: the zeros made above
            self.steps[p] = int(saved["step"])
            self.state[p] = {
                "step": saved["step"].detach().to(torch.float32).cpu().clone(),
                "exp_avg": saved["exp_avg"].detach().to(p.device, p.dtype).clone(),
                "exp_avg_sq": saved["exp_avg_sq"].detach().to(p.device, p.dtype).clone(),
            }
