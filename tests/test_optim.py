"""bnsgcn.nn.optim.Adam: the engine's Adam, without torch.optim (which imports torch._dynamo).

* the same bits as torch.optim.Adam's default CPU path, with and without weight decay,
  including parameters that get no gradient;
* its state exists before the first step (every rank's parameter average covers the same
  tensors, bnsgcn.sync.averaging) and changes nothing;
* state dicts load across the two, and a resumed optimizer continues exactly;
* building and stepping it does not import torch._dynamo.
"""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
import torch

from bnsgcn.nn.optim import Adam


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
        "from bnsgcn.nn.optim import Adam\n"
        "p = torch.nn.Parameter(torch.ones(2)); o = Adam([p], lr=0.1); p.grad = torch.ones(2); o.step()\n"
        "torch.optim.Adam([torch.nn.Parameter(torch.ones(1))]) if len(sys.argv) > 1 else None\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    mine = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    theirs = subprocess.run(
        [sys.executable, "-c", code, "torch"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert (mine, theirs) == ("False", "True")  # the check can fail: torch's own does import it
