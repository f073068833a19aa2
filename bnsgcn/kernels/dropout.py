"""Dropout with a cheap random mask on CPU.

torch's CPU dropout draws one Bernoulli sample per element (about 25 ns each: 0.1 s for
Cora's 2708 x 1433 input, 0.3 s per layer of a 100,000 x 128 activation). Here each element
takes 16 random bits and is kept when they are at least ``round(p * 2^16)``: probability
``1 - round(p * 2^16) / 2^16``, within 2^-17 of ``1 - p``. The numba backend draws the bits
from a counter-based generator (SplitMix64) seeded from torch's generator and masks in the
same pass; the torch backend draws them with ``random_``. Both are reproducible under
``torch.manual_seed``. On other devices torch's own dropout is used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from .backend import kernel_backend

LEVELS = 1 << 16  # distinct 16-bit draws: keep when bits >= round(p * LEVELS)


class _Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, p: float) -> Tensor:
        ctx.scale = 1.0 / (1.0 - p)
        out, keep = kernel_backend(x.device).dropout(x.contiguous(), round(p * LEVELS), ctx.scale)
        ctx.save_for_backward(keep)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor) -> tuple[Tensor, None]:
        (keep,) = ctx.saved_tensors
        return kernel_backend(dy.device).masked_scale(dy.contiguous(), keep, ctx.scale), None


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    r"""Zero each element of ``x`` with probability ``p`` and scale the rest by
    :math:`1 / (1 - p)`; the identity when not ``training`` or ``p = 0``.

    ``x`` any shape, float32 or float64; the result has ``x``'s shape and dtype. The mask
    is kept for backward as one byte per element, as torch's dropout keeps it.
    """
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu":
        return F.dropout(x, p, True)
    return _Dropout.apply(x, p)
