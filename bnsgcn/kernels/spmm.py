"""Sparse-dense product ``Y = A X`` with the backward through A's prebuilt transpose."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .adjacency import Adjacency
from .backend import kernel_backend


class _SpMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, adj: Adjacency) -> Tensor:
        ctx.adj = adj
        return kernel_backend(x.device).spmm(adj, x)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor) -> tuple[Tensor, None]:
        adj = ctx.adj
        return kernel_backend(dy.device).spmm_transposed(adj, dy.contiguous()), None


class _SpMMAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, base: Tensor, x: Tensor, adj: Adjacency) -> Tensor:
        ctx.adj = adj
        ctx.mark_dirty(base)
        return kernel_backend(x.device).spmm_add_(base, adj, x)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor) -> tuple[Tensor, Tensor | None, None]:
        dx = kernel_backend(dy.device).spmm_transposed(ctx.adj, dy.contiguous()) if ctx.needs_input_grad[1] else None
        return dy, dx, None


def _check(adj: Adjacency, x: Tensor) -> Tensor:
    if x.dim() != 2 or x.shape[0] != adj.n_cols:
        raise ValueError(f"spmm needs x of shape [n_cols={adj.n_cols}, d], got {list(x.shape)}; check the feature rows")
    if x.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"spmm supports float32 and float64 features, got {x.dtype}; cast the features")
    return x.contiguous()


def spmm(adj: Adjacency, x: Tensor) -> Tensor:
    r"""Aggregate :math:`Y = A X`, i.e. :math:`Y_v = \sum_{u \in N(v)} a_{vu} X_u`.

    Args:
        adj: sparse ``A [n_rows, n_cols]`` (values ``None`` means every entry is 1).
        x: dense ``[n_cols, d]``, float32 or float64.

    Returns:
        ``[n_rows, d]`` in ``x``'s dtype. Differentiable w.r.t. ``x`` only (A is constant):
        :math:`dX = A^\top dY` through the transposed CSR, and nothing is recorded for the
        backward when ``x`` does not require grad.
    """
    x = _check(adj, x)
    if torch.is_grad_enabled() and x.requires_grad:
        return _SpMM.apply(x, adj)
    return kernel_backend(x.device).spmm(adj, x)


def spmm_add_(base: Tensor, adj: Adjacency, x: Tensor) -> Tensor:
    r""":math:`B \mathrel{+}= A X` in place, without an ``A X`` temporary: :func:`spmm` added
    into ``base`` [n_rows, d] (contiguous, ``x``'s dtype, the output of an operation that
    does not keep it for its backward). Differentiable w.r.t. ``base`` and ``x``.
    """
    x = _check(adj, x)
    if base.shape != (adj.n_rows, x.shape[1]) or base.dtype != x.dtype or not base.is_contiguous():
        raise ValueError(
            f"spmm_add_ needs a contiguous {x.dtype} base of shape [{adj.n_rows}, {x.shape[1]}], got {base.dtype} "
            f"{list(base.shape)}"
        )
    if torch.is_grad_enabled() and (x.requires_grad or base.requires_grad):
        return _SpMMAdd.apply(base, x, adj)
    return kernel_backend(x.device).spmm_add_(base, adj, x)
