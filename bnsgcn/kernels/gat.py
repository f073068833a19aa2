"""Multi-head attention aggregation (GAT) over an adjacency's sparsity pattern."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .adjacency import Adjacency
from .backend import kernel_backend


class _GATAggregate(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x: Tensor,
        score_src: Tensor,
        score_dst: Tensor,
        adj: Adjacency,
        col_weight: Tensor | None,
        negative_slope: float,
    ) -> Tensor:
        y, alpha = kernel_backend(x.device).gat_forward(adj, x, score_src, score_dst, col_weight, negative_slope)
        ctx.adj = adj
        ctx.negative_slope = negative_slope
        ctx.save_for_backward(x, score_src, score_dst, alpha)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, Tensor, Tensor, None, None, None]:
        x, score_src, score_dst, alpha = ctx.saved_tensors
        dx, d_src, d_dst = kernel_backend(dy.device).gat_backward(
            ctx.adj, x, score_src, score_dst, alpha, dy.contiguous(), ctx.negative_slope, ctx.needs_input_grad[0]
        )
        return dx, d_src, d_dst, None, None, None


def gat_aggregate(
    adj: Adjacency,
    x: Tensor,
    score_src: Tensor,
    score_dst: Tensor,
    col_weight: Tensor | None = None,
    negative_slope: float = 0.2,
) -> Tensor:
    r"""Attention-weighted neighbour aggregation over A's pattern (A's values are ignored).

    .. math::
        e_{vuh} = \mathrm{LeakyReLU}(s^{src}_{uh} + s^{dst}_{vh}), \qquad
        \alpha_{vuh} = \frac{w_u \exp(e_{vuh})}{\sum_{u' \in N(v)} w_{u'} \exp(e_{vu'h})}, \qquad
        Y_{vh} = \sum_{u \in N(v)} \alpha_{vuh} X_{uh}

    computed stably (the row maximum is subtracted before ``exp``). Rows without entries give 0.
    ``w`` (``col_weight``, e.g. ``1/p`` for sampled boundary columns) makes the denominator an
    unbiased estimate when columns are sampled.

    Args:
        adj: sparsity pattern ``[n_rows, n_cols]``.
        x: ``[n_cols, H, D]`` source features per head.
        score_src: ``[n_cols, H]`` source attention scores.
        score_dst: ``[n_rows, H]`` destination attention scores.
        col_weight: ``[n_cols]`` non-negative column weights, or ``None`` for all ones.
        negative_slope: LeakyReLU slope.

    Returns:
        ``[n_rows, H, D]``, differentiable w.r.t. ``x``, ``score_src`` and ``score_dst``.
        Memory is O(nnz * H): alpha is kept for the backward, no O(nnz * D) temporaries.
    """
    if x.dim() != 3 or x.shape[0] != adj.n_cols:
        raise ValueError(f"gat_aggregate needs x of shape [n_cols={adj.n_cols}, H, D], got {list(x.shape)}")
    heads = x.shape[1]
    if score_src.shape != (adj.n_cols, heads) or score_dst.shape != (adj.n_rows, heads):
        raise ValueError(
            f"gat_aggregate needs score_src [{adj.n_cols}, {heads}] and score_dst [{adj.n_rows}, {heads}], "
            f"got {list(score_src.shape)} and {list(score_dst.shape)}"
        )
    if col_weight is not None and col_weight.shape != (adj.n_cols,):
        raise ValueError(f"col_weight must have shape [n_cols={adj.n_cols}], got {list(col_weight.shape)}")
    if x.dtype not in (torch.float32, torch.float64) or score_src.dtype != x.dtype or score_dst.dtype != x.dtype:
        raise ValueError("gat_aggregate needs x, score_src and score_dst of one dtype, float32 or float64; cast them")
    x, score_src, score_dst = x.contiguous(), score_src.contiguous(), score_dst.contiguous()
    if col_weight is not None:
        col_weight = col_weight.to(x.dtype).contiguous()
    if torch.is_grad_enabled() and (x.requires_grad or score_src.requires_grad or score_dst.requires_grad):
        return _GATAggregate.apply(x, score_src, score_dst, adj, col_weight, negative_slope)
    return kernel_backend(x.device).gat_forward(adj, x, score_src, score_dst, col_weight, negative_slope)[0]
