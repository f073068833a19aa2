"""bnsgcn.nn.optim and bnsgcn.nn.schedules: the engine's optimizers, without torch.optim (which
imports torch._dynamo), their schedules and clipping.

* Adam, AdamW and SGD (momentum, Nesterov) give the same bits as torch.optim's default CPU
  path, with and without weight decay, including parameters that get no gradient;
* their state exists before the first step (every rank's parameter average covers the same
  tensors, bnsgcn.sync.averaging) and changes nothing;
* state dicts load across the engine's and torch's, and a resumed optimizer continues exactly;
* clipping gives torch.nn.utils.clip_grad_norm_'s bits, from the norm the engine computed;
* the warm-up, cosine and step rates are torch's schedulers' (LinearLR, CosineAnnealingLR,
  StepLR), the plateau's cuts ReduceLROnPlateau's, and the plateau's state resumes;
* the factory knows exactly the optimizers and schedules the flags name;
* building and stepping any of them does not import torch._dynamo.
"""

from __future__ import annotations

import dataclasses
import io
import math
import subprocess
import sys

import pytest
import torch

from bnsgcn.config import OptimConfig, TrainConfig
from bnsgcn.config.sections import LR_SCHEDULES, OPTIMIZERS
from bnsgcn.errors import UserError
from bnsgcn.nn import optim, schedules
from bnsgcn.nn.optim import SGD, Adam, AdamW, clip_grads, make_optimization, saved_settings, settings_differ

from .helpers.reference import torch_optimizer


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(5, 3)),
        torch.nn.Parameter(torch.randn(3)),
        torch.nn.Parameter(torch.randn(2, 2)),
    ]


def _steps(optimizer, params, seed: int, steps: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=False)
        for p in params[:2]:  # the last never gets a gradient: skipped by both
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()


@pytest.mark.parametrize("weight_decay", (0.0, 5e-4))
def test_same_bits_as_torch_adam(weight_decay):
    ours, theirs = _params(), _params()
    mine, reference = (
        Adam(ours, lr=0.01, weight_decay=weight_decay),
        torch.optim.Adam(theirs, lr=0.01, weight_decay=weight_decay),
    )
    assert sorted(mine.state[ours[0]]) == ["exp_avg", "exp_avg_sq", "step"]  # made before any step
    _steps(mine, ours, 1, 7)
    _steps(reference, theirs, 1, 7)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    for a, b in zip(ours[:2], theirs[:2]):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(mine.state[a][key], reference.state[b][key]), key
    assert float(mine.state[ours[2]]["step"]) == 0  # no gradient, no step


def _through_a_file(state: dict) -> dict:
    """As a checkpoint carries it (a state dict holds the optimizer's own tensors)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_state_dicts_load_across_and_resume_exactly():
    # torch's state into ours, then both go on: the same bits
    ours, theirs = _params(1), _params(1)
    reference = torch.optim.Adam(theirs, lr=0.02, weight_decay=1e-3)
    _steps(reference, theirs, 2, 3)
    with torch.no_grad():
        for a, b in zip(ours, theirs):
            a.copy_(b)
    mine = Adam(ours, lr=0.5)  # the checkpoint's hyperparameters win, as in torch.optim
    mine.load_state_dict(_through_a_file(reference.state_dict()))
    _steps(mine, ours, 3, 4)
    _steps(reference, theirs, 3, 4)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    # ours into torch's
    again = _params(1)
    with torch.no_grad():
        for a, b in zip(again, ours):
            a.copy_(b)
    other = torch.optim.Adam(again, lr=0.5)
    other.load_state_dict(_through_a_file(mine.state_dict()))
    _steps(other, again, 4, 2)
    _steps(mine, ours, 4, 2)
    for a, b in zip(ours, again):
        assert torch.equal(a, b)


def test_a_state_of_other_parameters_is_refused():
    with pytest.raises(ValueError, match="this model has 3"):
        Adam(_params(), lr=0.1).load_state_dict(Adam(_params()[:2], lr=0.1).state_dict())


def test_does_not_import_dynamo():
    code = (
        "import sys, torch\n"
        "from bnsgcn.config import OptimConfig\n"
        "from bnsgcn.nn.optim import make_optimization\n"
        "for name, schedule in (('adam', 'cosine'), ('adamw', 'step'), ('sgd', 'plateau')):\n"
        "    p = torch.nn.Parameter(torch.ones(2)); p.grad = torch.ones(2)\n"
        "    o = make_optimization(OptimConfig(name=name, lr_schedule=schedule, grad_clip=0.5), [p], 10)\n"
        "    o.start_epoch(0); o.step(p.grad.norm()); o.evaluated(1, 0.5)\n"
        "torch.optim.Adam([torch.nn.Parameter(torch.ones(1))]) if len(sys.argv) > 1 else None\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    mine = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    theirs = subprocess.run(
        [sys.executable, "-c", code, "torch"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert (mine, theirs) == ("False", "True")  # the check can fail: torch's own does import it


# --- AdamW and SGD ---------------------------------------------------------------------------

SGD_CASES = [
    dict(momentum=0.0, weight_decay=0.0, nesterov=False),
    dict(momentum=0.9, weight_decay=0.0, nesterov=False),
    dict(momentum=0.9, weight_decay=5e-4, nesterov=True),
]


@pytest.mark.parametrize("weight_decay", (0.0, 0.05))
def test_adamw_same_bits_as_torch_adamw(weight_decay):
    ours, theirs = _params(), _params()
    mine, reference = (
        AdamW(ours, lr=0.01, weight_decay=weight_decay),
        torch.optim.AdamW(theirs, lr=0.01, weight_decay=weight_decay),
    )
    _steps(mine, ours, 1, 7)
    _steps(reference, theirs, 1, 7)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    if weight_decay:  # decoupled: not Adam's L2 (the check can fail)
        adam = _params()
        _steps(Adam(adam, lr=0.01, weight_decay=weight_decay), adam, 1, 7)
        assert not torch.equal(adam[0], ours[0])


@pytest.mark.parametrize("case", SGD_CASES, ids=lambda c: f"m{c['momentum']}-wd{c['weight_decay']}-n{c['nesterov']}")
def test_sgd_same_bits_as_torch_sgd(case):
    ours, theirs = _params(), _params()
    mine, reference = SGD(ours, lr=0.05, **case), torch.optim.SGD(theirs, lr=0.05, **case)
    assert sorted(mine.state[ours[0]]) == (["momentum_buffer"] if case["momentum"] else [])  # made before any step
    _steps(mine, ours, 1, 7)
    _steps(reference, theirs, 1, 7)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    if case["momentum"]:
        for a, b in zip(ours[:2], theirs[:2]):
            assert torch.equal(mine.state[a]["momentum_buffer"], reference.state[b]["momentum_buffer"])


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (lambda p: AdamW(p, lr=0.5), lambda p: torch.optim.AdamW(p, lr=0.02, weight_decay=0.1)),
        (lambda p: SGD(p, lr=0.5, momentum=0.5), lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.8, nesterov=True)),
    ],
    ids=("adamw", "sgd"),
)
def test_adamw_and_sgd_state_dicts_load_across_and_resume_exactly(ours, theirs):
    mine_params, their_params = _params(1), _params(1)
    reference = theirs(their_params)
    _steps(reference, their_params, 2, 3)
    with torch.no_grad():
        for a, b in zip(mine_params, their_params):
            a.copy_(b)
    mine = ours(mine_params)  # the checkpoint's hyperparameters win
    mine.load_state_dict(_through_a_file(reference.state_dict()))
    _steps(mine, mine_params, 3, 4)
    _steps(reference, their_params, 3, 4)
    for a, b in zip(mine_params, their_params):
        assert torch.equal(a, b)
    again = _params(1)
    with torch.no_grad():
        for a, b in zip(again, mine_params):
            a.copy_(b)
    other = theirs(again)
    other.load_state_dict(_through_a_file(mine.state_dict()))
    _steps(other, again, 4, 2)
    _steps(mine, mine_params, 4, 2)
    for a, b in zip(mine_params, again):
        assert torch.equal(a, b)


def test_another_optimizers_state_is_refused():
    with pytest.raises(ValueError, match="has no momentum_buffer: another optimizer's"):
        SGD(_params(), lr=0.1, momentum=0.9).load_state_dict(Adam(_params(), lr=0.1).state_dict())


# --- clipping --------------------------------------------------------------------------------


@pytest.mark.parametrize("max_norm", (0.5, 1e6))
def test_clipping_same_bits_as_torch(max_norm):
    ours, theirs = _params(2), _params(2)
    generator = torch.Generator().manual_seed(5)
    for a, b in zip(ours[:2], theirs[:2]):  # the last has no gradient
        a.grad = torch.randn(a.shape, generator=generator)
        b.grad = a.grad.clone()
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm([p.grad for p in ours[:2]])))  # train._grad_norm's
    clip_grads(ours, norm, max_norm)
    total = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert torch.equal(norm, total)
    for a, b in zip(ours[:2], theirs[:2]):
        assert torch.equal(a.grad, b.grad)
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ours[:2]]))
    assert (clipped < norm) == (max_norm < float(norm))  # it clips exactly when the norm is larger


# --- schedules -------------------------------------------------------------------------------


def _rates(settings: OptimConfig, epochs: int) -> list[float]:
    schedule = schedules.SCHEDULES[settings.lr_schedule](settings, epochs)
    return [schedule.lr(e) for e in range(epochs)]


def _torch_rates(settings: OptimConfig, epochs: int) -> list[float]:
    config = TrainConfig(optim=settings).replace(epochs=epochs)
    opt, scheduler = torch_optimizer(config, [torch.nn.Parameter(torch.zeros(1))])
    rates = []
    for _ in range(epochs):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        if scheduler is not None:
            scheduler.step()
    return rates


@pytest.mark.parametrize(
    "settings",
    [
        OptimConfig(),
        OptimConfig(warmup_epochs=3),
        OptimConfig(lr_schedule="cosine"),
        OptimConfig(lr_schedule="cosine", warmup_epochs=4),
        OptimConfig(lr_schedule="cosine", warmup_epochs=2, cosine_epochs=30),
        OptimConfig(lr_schedule="step", lr_step_epochs=4, lr_gamma=0.5),
        OptimConfig(lr_schedule="step", lr_step_epochs=3, lr_gamma=0.1, warmup_epochs=2),
    ],
    ids=("none", "warmup", "cosine", "warmup-cosine", "cosine-longer", "step", "warmup-step"),
)
def test_rates_are_torch_schedulers(settings):
    ours, theirs = _rates(settings, 20), _torch_rates(settings, 20)
    assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-15)
    if settings == OptimConfig():
        assert ours == [0.01] * 20  # the default: --lr's bits every epoch
    if settings.warmup_epochs:
        w = settings.warmup_epochs
        assert ours[:w] == pytest.approx([0.01 * (i + 1) / (w + 1) for i in range(w)]) and ours[w] == 0.01
    if settings.lr_schedule == "cosine" and settings.cosine_epochs is None:
        assert 0 < ours[-1] < 1e-3  # falls close to 0 at the run's end, never to it


def test_plateau_cuts_as_reduce_lr_on_plateau():
    settings = OptimConfig(lr_schedule="plateau", plateau_patience=2, plateau_factor=0.5, warmup_epochs=2)
    ours = schedules.Plateau(settings, 40)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.01)
    theirs = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=1, threshold=0.0)
    scores = [0.1, 0.3, 0.5, 0.5, 0.4, 0.6, 0.6, 0.6, 0.6, 0.7, 0.2, 0.2, 0.2, 0.2, 0.2]
    rates = []
    for i, score in enumerate(scores):
        epoch = 2 * (i + 1)  # evaluated every 2 epochs
        ours.evaluated(epoch, score)
        if epoch > 2:  # the warm-up's evaluation does not count
            theirs.step(score)
        rates.append(ours.lr(epoch))
        assert rates[-1] == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12), i
    assert ours.cuts == 4 and rates[0] == 0.01  # the check can fail: it cut, and not in the warm-up
    resumed = schedules.Plateau(settings, 40)
    resumed.load_state_dict(_through_a_file(ours.state_dict()))
    for epoch, score in ((32, 0.1), (34, 0.1), (36, 0.9)):
        ours.evaluated(epoch, score)
        resumed.evaluated(epoch, score)
        assert resumed.lr(epoch) == ours.lr(epoch)
    assert ours.cuts == 5


# --- the factory -----------------------------------------------------------------------------


def test_the_factory_builds_what_the_flags_name():
    assert sorted(optim.OPTIMIZERS) == sorted(OPTIMIZERS)
    assert sorted(schedules.SCHEDULES) == sorted(LR_SCHEDULES)
    built = make_optimization(OptimConfig(name="sgd", momentum=0.9, nesterov=True), _params(), 10)
    assert type(built.optimizer) is SGD and built.optimizer.group["nesterov"]
    assert type(make_optimization(OptimConfig(name="adamw"), _params(), 10).optimizer) is AdamW
    default = make_optimization(OptimConfig(), _params(), 10)
    assert type(default.optimizer) is Adam and type(default.schedule) is schedules.Schedule and default.clip is None


def test_a_checkpoint_names_the_optimizer_flags_that_differ():
    written = make_optimization(OptimConfig(lr_schedule="cosine", grad_clip=1.0), _params(), 10)
    ours = make_optimization(OptimConfig(lr=0.02), _params(), 10)
    state = {"optimization": written.state_dict(), "optimizer": written.optimizer.state_dict()}
    assert settings_differ(saved_settings(state), ours.settings_dict()) == (
        "--lr 0.01 (this run: --lr 0.02), --grad-clip 1 (this run: no --grad-clip), "
        "--lr-schedule cosine (this run: --lr-schedule none), --cosine-epochs 10 (this run: no --cosine-epochs)"
    )
    assert settings_differ(saved_settings(state), written.settings_dict()) is None
    # a checkpoint of a bnsgcn before these settings: Adam at its own rate, nothing else
    old = {"optimizer": Adam(_params(), lr=0.03, weight_decay=1e-4).state_dict()}
    same = make_optimization(OptimConfig(lr=0.03, weight_decay=1e-4), _params(), 10)
    assert settings_differ(saved_settings(old), same.settings_dict()) is None
    assert same.resume(old) is None


def _checkpoint_of(optimization) -> dict:
    return _through_a_file(
        {"optimizer": optimization.optimizer.state_dict(), "optimization": optimization.state_dict()}
    )


def test_resume_takes_the_state_with_this_runs_flags():
    plateau = OptimConfig(lr_schedule="plateau", plateau_patience=1)
    written = make_optimization(dataclasses.replace(plateau, weight_decay=0.1), _params(), 10)
    written.start_epoch(0)
    for epoch, score in ((1, 0.5), (2, 0.4)):
        written.evaluated(epoch, score)
    _steps(written.optimizer, written.optimizer.params, 1, 2)
    assert written.schedule.cuts == 1
    # the same schedule: its state continues; the optimizer's state with this run's weight decay
    ours = make_optimization(plateau, _params(), 10)
    assert ours.resume(_checkpoint_of(written)) == "--weight-decay 0.1 (this run: --weight-decay 0)"
    assert ours.schedule.state_dict() == written.schedule.state_dict()
    assert ours.optimizer.group["weight_decay"] == 0.0 and ours.optimizer.steps[ours.optimizer.params[0]] == 2
    mine, theirs = (o.optimizer.state[o.optimizer.params[0]]["exp_avg"] for o in (ours, written))
    assert torch.equal(mine, theirs)
    # another schedule starts afresh; another optimizer is refused
    cosine = make_optimization(OptimConfig(lr_schedule="cosine"), _params(), 10)
    assert "--lr-schedule plateau (this run: --lr-schedule cosine)" in cosine.resume(_checkpoint_of(written))
    refusal = "holds the state of --optimizer adam, which --optimizer sgd cannot continue; resume with --optimizer adam"
    with pytest.raises(UserError, match="^" + refusal + ", or pass a new --out$"):
        make_optimization(OptimConfig(name="sgd"), _params(), 10).resume(_checkpoint_of(written))


def test_cosine_rate_formula():
    settings = OptimConfig(lr_schedule="cosine", warmup_epochs=1, cosine_epochs=4)
    assert _rates(settings, 5) == pytest.approx(
        [0.005, 0.01] + [0.01 * (1 + math.cos(math.pi * t / 4)) / 2 for t in (1, 2, 3)]
    )
