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

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from .backend import draw_seed, kernel_backend

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


class RecomputedDropout:
    r"""Dropout of tensors that need no gradient, whose outputs autograd does not keep.

    A layer's weight gradient needs its input, here :math:`x \odot m / (1 - p)`
    [n, d]; keeping it costs an activation. Inside :meth:`saving_recipes`, an operation that
    saves an output of :meth:`__call__` for backward keeps its recipe instead: ``x``, which
    the caller holds anyway, and the seed of the mask's random bits (both backends draw the
    same mask again from the same seed); backward redraws the mask and recomputes the
    product when it unpacks it, one elementwise pass. Nothing of size [n, d] is kept.
    On the numba backend the masks are those of :func:`dropout` (the seed is drawn from
    torch's generator alike). ``x`` must not require grad (the input features, the
    precomputed aggregation).
    """

    def __init__(self) -> None:
        # data_ptr of an output -> (output, recipe); the output is held here only while the
        # context is open, so no other tensor can take its address meanwhile
        self._recipes: dict[int, tuple[Tensor, tuple[Tensor, int, float, int]]] = {}

    def __call__(self, x: Tensor, p: float, training: bool) -> Tensor:
        """:func:`dropout` of ``x`` [n, d]."""
        if not training or p == 0.0:
            return x
        if x.requires_grad:
            raise ValueError("RecomputedDropout is for inputs that need no gradient; use dropout()")
        recipe = (x.contiguous(), round(p * LEVELS), 1.0 / (1.0 - p), draw_seed())
        out = _redraw(recipe)
        self._recipes[out.data_ptr()] = (out, recipe)
        return out

    @contextmanager
    def saving_recipes(self) -> Iterator[None]:
        """Operations run here that save an output of this dropout keep its recipe."""

        def pack(t: Tensor) -> Tensor | tuple[Tensor, int, float, int]:
            entry = self._recipes.get(t.data_ptr())
            if entry is not None and entry[0].shape == t.shape and entry[0].stride() == t.stride():
                return entry[1]
            return t

        def unpack(saved: Tensor | tuple[Tensor, int, float, int]) -> Tensor:
            return saved if isinstance(saved, Tensor) else _redraw(saved)

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                yield
        finally:
            self._recipes = {}  # releases the outputs: packed recipes hold only x and a seed


def _redraw(recipe: tuple[Tensor, int, float, int]) -> Tensor:
    """``x * keep * scale`` with the mask of ``seed``."""
    x, threshold, scale, seed = recipe
    return kernel_backend(x.device).dropout(x, threshold, scale, seed, with_mask=False)[0]
