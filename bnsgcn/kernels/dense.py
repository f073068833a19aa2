"""Dense products whose outputs and input gradients come from the buffer pool.

``torch.nn.functional.linear`` and its backward write into fresh tensors: on CPU each
[n, d] output of 1 MiB or more is a new memory mapping, faulted in and zeroed by the
kernel before the GEMM writes it (:mod:`bnsgcn.kernels.buffers`). Here the same GEMMs
write into :func:`bnsgcn.kernels.buffers.empty`.

A sum of products is one node per product, as ``linear(x, W_s, b).addmm_(n, W_n^T)``
would record it: each node keeps only its own input, so backward frees ``n`` before it
computes the gradient of ``x`` (one node for both would hold both inputs and both
gradients at once: two activations more at backward's peak).

Under :func:`torch.autocast` (``--precision bf16``) the products run in its dtype, as
``torch.nn.functional.linear`` would: the entry functions cast the input, weights and bias
to it outside the autograd Functions (the casts' backward returns parameter gradients in
float32), and run the Functions without autocast, whose ``out=`` GEMMs it would not touch.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import buffers


def _input_gradient(dy: Tensor, x: Tensor, weight: Tensor) -> Tensor:
    """``dY W`` [n, d_in], into a pooled buffer."""
    return torch.mm(dy, weight, out=buffers.empty(x.shape, dy.dtype, dy.device))


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        out = buffers.empty((x.shape[0], weight.shape[0]), x.dtype, x.device)
        if bias is None:
            torch.mm(x, weight.t(), out=out)
        else:
            torch.addmm(bias, x, weight.t(), out=out)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x, weight = ctx.saved_tensors
        dx = _input_gradient(dy, x, weight) if ctx.needs_input_grad[0] else None
        dweight = dy.t().mm(x) if ctx.needs_input_grad[1] else None
        dbias = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dweight, dbias


class _AddLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, base: Tensor, x: Tensor, weight: Tensor) -> Tensor:
        ctx.mark_dirty(base)
        ctx.save_for_backward(x, weight)
        return base.addmm_(x, weight.t())

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        x, weight = ctx.saved_tensors
        dx = _input_gradient(dy, x, weight) if ctx.needs_input_grad[1] else None
        dweight = dy.t().mm(x) if ctx.needs_input_grad[2] else None
        return dy, dx, dweight


class _LinearPair(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight_a: Tensor, weight_b: Tensor, bias_a: Tensor | None) -> tuple[Tensor, Tensor]:
        n, d_a, d_b = x.shape[0], weight_a.shape[0], weight_b.shape[0]
        # narrow outputs: one GEMM reads x once, and copying its halves apart costs less
        # than a second read of x; wide ones: copying [n, d_a + d_b] apart would cost more
        ctx.stacked = d_a + d_b <= x.shape[1] // 2

        def output(width: int) -> Tensor:
            return buffers.empty((n, width), x.dtype, x.device)

        if ctx.stacked:
            both = torch.mm(x, torch.cat([weight_a, weight_b]).t(), out=output(d_a + d_b))
            a, b = output(d_a), output(d_b)
            if bias_a is None:
                a.copy_(both[:, :d_a])
            else:
                torch.add(both[:, :d_a], bias_a, out=a)
            b.copy_(both[:, d_a:])
        else:
            a, b = output(d_a), output(d_b)
            if bias_a is None:
                torch.mm(x, weight_a.t(), out=a)
            else:
                torch.addmm(bias_a, x, weight_a.t(), out=a)
            torch.mm(x, weight_b.t(), out=b)
        ctx.save_for_backward(x, weight_a, weight_b)
        ctx.has_bias = bias_a is not None
        return a, b

    @staticmethod
    @once_differentiable
    def backward(ctx, da: Tensor, db: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
        x, weight_a, weight_b = ctx.saved_tensors
        if ctx.stacked:  # both gradients side by side: one GEMM each for dX and dW
            d_a = weight_a.shape[0]
            both = buffers.empty((x.shape[0], d_a + weight_b.shape[0]), da.dtype, da.device)
            both[:, :d_a].copy_(da)
            both[:, d_a:].copy_(db)
            dx = _input_gradient(both, x, torch.cat([weight_a, weight_b])) if ctx.needs_input_grad[0] else None
            dweight_a, dweight_b = (
                both.t().mm(x).split([d_a, weight_b.shape[0]])
                if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
                else (None, None)
            )
        else:
            dx = _input_gradient(da, x, weight_a).addmm_(db, weight_b) if ctx.needs_input_grad[0] else None
            dweight_a = da.t().mm(x) if ctx.needs_input_grad[1] else None
            dweight_b = db.t().mm(x) if ctx.needs_input_grad[2] else None
        dbias = da.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return dx, dweight_a, dweight_b, dbias


def _autocast(*tensors: Tensor | None) -> tuple[list[Tensor | None], AbstractContextManager]:
    """``tensors`` cast to autocast's dtype where it is on for their device (differentiably),
    and the context to run the product in (autocast off); else ``tensors`` as they are."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return list(tensors), nullcontext()
    dtype = torch.get_autocast_dtype(device_type)
    cast = [None if t is None else t.to(dtype) for t in tensors]
    return cast, torch.autocast(device_type, enabled=False)


def linear_pair(x: Tensor, weight_a: Tensor, weight_b: Tensor, bias_a: Tensor | None = None) -> tuple[Tensor, Tensor]:
    r""":math:`(X W_a^\top + b_a,\ X W_b^\top)`: two products of one input ``x`` [n, d_in],
    ``weight_a`` [d_a, d_in], ``weight_b`` [d_b, d_in], ``bias_a`` [d_a] or None; returns
    [n, d_a] and [n, d_b], each its own contiguous output, from the buffer pool. One node:
    the input's two gradients are summed by GEMMs, not by a pass of autograd's. Wide
    outputs (``d_a + d_b > d_in / 2``): two GEMMs each way, the second of backward adding
    into the first's output (:math:`dX = dA\,W_a`, then :math:`dX \mathrel{+}= dB\,W_b`).
    Narrow ones: the weights stacked, one GEMM into [n, d_a + d_b] split into the two
    outputs, and backward's gradients put side by side for one GEMM. Differentiable w.r.t.
    every input. Under autocast, in its dtype (see the module)."""
    tensors, context = _autocast(x, weight_a, weight_b, bias_a)
    with context:
        return _LinearPair.apply(*tensors)


def linear_sum(bias: Tensor | None, *terms: tuple[Tensor, Tensor]) -> Tensor:
    r""":math:`Y = \sum_k X_k W_k^\top + b`: each term ``(X_k [n, d_k], W_k [d_out, d_k])``,
    ``bias`` [d_out] or None; returns [n, d_out]. The later products are added into the
    first's output by the GEMMs themselves. Differentiable w.r.t. every input, weight and
    the bias. Under autocast, in its dtype (see the module)."""
    (x, weight), *rest = terms
    (x, weight, bias), context = _autocast(x, weight, bias)
    with context:
        out = _Linear.apply(x, weight, bias)
    for x, weight in rest:
        (x, weight), context = _autocast(x, weight)
        with context:
            out = _AddLinear.apply(out, x, weight)
    return out
