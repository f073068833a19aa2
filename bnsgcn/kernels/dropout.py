"""Dropout with a cheap random mask on CPU.

torch's CPU dropout draws one Bernoulli sample per element and was the largest cost of a
small-graph epoch (about 25 ns per element: 0.1 s for Cora's 2708 x 1433 input). Here the
mask comes from 16 random bits per element, drawn as 64-bit words from torch's seeded
generator, so runs stay reproducible; each element is kept with probability
``1 - round(p * 2^16) / 2^16`` (within 2^-17 of ``1 - p``). On other devices torch's own
dropout is used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

_BITS = 16
_LEVELS = 1 << _BITS


def keep_mask(shape: torch.Size, p: float, device: torch.device) -> Tensor:
    """Bool ``shape`` tensor, each element True with probability about ``1 - p``."""
    n = shape.numel()
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_(-(2**63), None)
    bits = words.view(torch.int16)[:n].view(shape)  # uniform over [-2^15, 2^15)
    return bits >= round(p * _LEVELS) - _LEVELS // 2


class _Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, p: float) -> Tensor:
        keep = keep_mask(x.shape, p, x.device)
        ctx.save_for_backward(keep)
        ctx.scale = 1.0 / (1.0 - p)
        return (x * keep).mul_(ctx.scale)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor) -> tuple[Tensor, None]:
        (keep,) = ctx.saved_tensors
        return (dy * keep).mul_(ctx.scale), None


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    r"""Zero each element of ``x`` with probability ``p`` and scale the rest by
    :math:`1 / (1 - p)`; the identity when not ``training`` or ``p = 0``.

    ``x`` any shape; the result has ``x``'s shape and dtype. The mask is kept for backward
    as one byte per element, as torch's dropout keeps it.
    """
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu":
        return F.dropout(x, p, True)
    return _Dropout.apply(x, p)
