"""Which kernel implementation runs: chosen per call from ``BNSGCN_KERNELS`` and the device."""

from __future__ import annotations

import os
from types import ModuleType

import torch

from ..errors import UserError

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


def draw_seed() -> int:
    """A seed for a kernel's own random bits, drawn from torch's generator (so runs repeat
    under ``torch.manual_seed``)."""
    return int(torch.randint(0, 2**62, (1,)))
