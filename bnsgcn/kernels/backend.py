"""Which kernel implementation runs: chosen per call from ``BNSGCN_KERNELS`` and the device."""

from __future__ import annotations

import os
from types import ModuleType

import torch

from bnsgcn.errors import UserError

ENV_VAR = "BNSGCN_KERNELS"
CHOICES = ("auto", "numba", "torch")


def kernel_backend(device: torch.device) -> ModuleType:
    """The backend module for tensors on ``device``.

    ``BNSGCN_KERNELS`` = ``auto`` (default) or ``numba``: numba kernels on CPU; ``torch``: the
    pure-torch kernels on CPU too. CUDA tensors always use the torch kernels (cuSPARSE).
    """
    choice = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise UserError(f"{ENV_VAR}={choice!r} is not a kernel backend; set it to one of {', '.join(CHOICES)}")
    if device.type != "cpu" or choice == "torch":
        from . import torch_backend

        return torch_backend
    from . import numba_backend

    return numba_backend


def seed_step(seed: int, device: torch.device) -> None:
    """Seed the generators a training step draws from (dropout masks, stochastic rounding):
    the CPU one, which :func:`draw_seed` reads, and ``device``'s. Same draws as
    ``torch.manual_seed``, which also seeds every other device type: on a build with CUDA
    but no GPU in use that queues a lazy call and formats a stack trace, about 5% of a small
    work-pool step."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)
    elif device.type != "cpu":
        torch.manual_seed(seed)


def draw_seed() -> int:
    """A seed for a kernel's own random bits, drawn from torch's generator (so runs repeat
    under ``torch.manual_seed``)."""
    return int(torch.randint(0, 2**62, (1,)))
