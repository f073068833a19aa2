"""Multi-threaded CPU kernels in numba.

Every kernel is parallel over rows of one CSR (forward: A's rows; backward: the rows of the
prebuilt transpose), so each output row has exactly one writer: no atomics, deterministic
results for any thread count. Rows are grouped into blocks of about equal cost
(entries + rows), so skewed degree distributions still balance across threads.

Compiled specialisations are few: float32 / float64 times the index dtype (int32 unless a
graph has more than 2^31 - 1 nodes or entries), cached on disk (``cache=True``).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import njit, prange
from torch import Tensor

from .adjacency import Adjacency

# Reassociation etc. let LLVM vectorise the feature loops; no nnan/ninf so NaN/inf propagate.
_FASTMATH = {"reassoc", "contract", "arcp", "nsz", "afn"}
_BLOCKS_PER_THREAD = 16


@njit(cache=True, inline="always")
def _block_start(indptr: np.ndarray, block: int, n_blocks: int) -> int:
    """First row of ``block`` when rows are split into ``n_blocks`` of equal ``entries + rows``."""
    n_rows = indptr.shape[0] - 1
    target = (indptr[n_rows] + n_rows) * block // n_blocks
    lo, hi = 0, n_rows
    while lo < hi:  # first row i with indptr[i] + i >= target
        mid = (lo + hi) // 2
        if indptr[mid] + mid < target:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(parallel=True, cache=True, fastmath=_FASTMATH)
def _spmm_kernel(indptr, indices, values, weighted, x, out, n_blocks):
    d = x.shape[1]
    for block in prange(n_blocks):
        for v in range(_block_start(indptr, block, n_blocks), _block_start(indptr, block + 1, n_blocks)):
            out_row = out[v]
            out_row[:] = 0
            for j in range(indptr[v], indptr[v + 1]):
                x_row = x[indices[j]]
                a = values[j] if weighted else 1
                for k in range(d):
                    out_row[k] += a * x_row[k]


@njit(parallel=True, cache=True, fastmath=_FASTMATH)
def _gat_forward_kernel(indptr, indices, x, score_src, score_dst, col_weight, weighted, slope, alpha, out, n_blocks):
    heads, dim = x.shape[1], x.shape[2]
    for block in prange(n_blocks):
        row_max = np.empty(heads, np.float64)
        row_sum = np.empty(heads, np.float64)
        for v in range(_block_start(indptr, block, n_blocks), _block_start(indptr, block + 1, n_blocks)):
            out[v] = 0
            start, end = indptr[v], indptr[v + 1]
            row_max[:] = -np.inf
            for j in range(start, end):
                u = indices[j]
                for h in range(heads):
                    e = score_src[u, h] + score_dst[v, h]
                    e = e if e > 0 else slope * e
                    alpha[j, h] = e
                    row_max[h] = max(row_max[h], e)
            row_sum[:] = 0
            for j in range(start, end):
                w = col_weight[indices[j]] if weighted else 1
                for h in range(heads):
                    p = w * np.exp(alpha[j, h] - row_max[h])
                    alpha[j, h] = p
                    row_sum[h] += p
            for h in range(heads):  # a row whose weights are all 0 gets alpha = 0, not 0/0
                row_sum[h] = 1 / row_sum[h] if row_sum[h] > 0 else 0
            for j in range(start, end):
                u = indices[j]
                for h in range(heads):
                    a = alpha[j, h] * row_sum[h]
                    alpha[j, h] = a
                    out_row = out[v, h]
                    x_row = x[u, h]
                    for k in range(dim):
                        out_row[k] += a * x_row[k]


@njit(parallel=True, cache=True, fastmath=_FASTMATH)
def _gat_edge_grad_kernel(indptr, indices, x, score_src, score_dst, alpha, dy, slope, d_score, d_dst, n_blocks):
    """Per row v: SDDMM g = <dy[v], x[u]>, softmax and LeakyReLU backward into ``d_score``."""
    heads, dim = x.shape[1], x.shape[2]
    for block in prange(n_blocks):
        row_dot = np.empty(heads, np.float64)
        for v in range(_block_start(indptr, block, n_blocks), _block_start(indptr, block + 1, n_blocks)):
            start, end = indptr[v], indptr[v + 1]
            row_dot[:] = 0
            for j in range(start, end):
                u = indices[j]
                for h in range(heads):
                    dy_row = dy[v, h]
                    x_row = x[u, h]
                    g = 0.0
                    for k in range(dim):
                        g += dy_row[k] * x_row[k]
                    d_score[j, h] = g
                    row_dot[h] += alpha[j, h] * g
            for h in range(heads):
                d_dst[v, h] = 0
            for j in range(start, end):
                u = indices[j]
                for h in range(heads):
                    de = alpha[j, h] * (d_score[j, h] - row_dot[h])
                    if score_src[u, h] + score_dst[v, h] <= 0:
                        de *= slope
                    d_score[j, h] = de
                    d_dst[v, h] += de


@njit(parallel=True, cache=True, fastmath=_FASTMATH)
def _gat_column_grad_kernel(t_indptr, t_indices, t_edge, alpha, d_score, dy, need_dx, dx, d_src, n_blocks):
    """Per column u (a row of the transpose): d score_src[u] and dx[u] = sum_v alpha_vu dy[v]."""
    heads, dim = dy.shape[1], dy.shape[2]
    for block in prange(n_blocks):
        for u in range(_block_start(t_indptr, block, n_blocks), _block_start(t_indptr, block + 1, n_blocks)):
            d_src[u] = 0
            if need_dx:
                dx[u] = 0
            for t in range(t_indptr[u], t_indptr[u + 1]):
                j = t_edge[t]
                for h in range(heads):
                    d_src[u, h] += d_score[j, h]
                if need_dx:
                    v = t_indices[t]
                    for h in range(heads):
                        a = alpha[j, h]
                        dx_row = dx[u, h]
                        dy_row = dy[v, h]
                        for k in range(dim):
                            dx_row[k] += a * dy_row[k]


def _n_blocks() -> int:
    """Match numba's thread count to torch's (a rank given 1 thread uses 1) and size the blocks."""
    threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(threads)
    return threads * _BLOCKS_PER_THREAD


def _array(t: Tensor) -> np.ndarray:
    return t.detach().contiguous().numpy()


def _optional(t: Tensor | None, dtype: torch.dtype) -> tuple[np.ndarray, bool]:
    """``(array, present)``; an empty stand-in when absent keeps one compiled specialisation."""
    if t is None:
        return np.empty(0, dtype=torch.empty(0, dtype=dtype).numpy().dtype), False
    return _array(t.to(dtype)), True


def _spmm_csr(indptr: Tensor, indices: Tensor, values: Tensor | None, x: Tensor, n_rows: int) -> Tensor:
    out = x.new_empty(n_rows, x.shape[1])
    values_array, weighted = _optional(values, x.dtype)
    _spmm_kernel(_array(indptr), _array(indices), values_array, weighted, _array(x), out.numpy(), _n_blocks())
    return out


def spmm(adj: Adjacency, x: Tensor) -> Tensor:
    """``A x``: ``x [n_cols, d] -> [n_rows, d]``."""
    return _spmm_csr(adj.indptr, adj.indices, adj.values, x, adj.n_rows)


def spmm_transposed(adj: Adjacency, y: Tensor) -> Tensor:
    """``A^T y`` over the prebuilt transposed CSR: ``y [n_rows, d] -> [n_cols, d]``."""
    return _spmm_csr(adj.t_indptr, adj.t_indices, adj.t_values, y, adj.n_cols)


def gat_forward(
    adj: Adjacency, x: Tensor, score_src: Tensor, score_dst: Tensor, col_weight: Tensor | None, negative_slope: float
) -> tuple[Tensor, Tensor]:
    """Attention aggregation; returns ``(Y [n_rows, H, D], alpha [nnz, H])``."""
    heads = x.shape[1]
    out = x.new_empty(adj.n_rows, heads, x.shape[2])
    alpha = x.new_empty(adj.nnz, heads)
    weight_array, weighted = _optional(col_weight, x.dtype)
    _gat_forward_kernel(
        _array(adj.indptr),
        _array(adj.indices),
        _array(x),
        _array(score_src),
        _array(score_dst),
        weight_array,
        weighted,
        float(negative_slope),
        alpha.numpy(),
        out.numpy(),
        _n_blocks(),
    )
    return out, alpha


def gat_backward(
    adj: Adjacency,
    x: Tensor,
    score_src: Tensor,
    score_dst: Tensor,
    alpha: Tensor,
    dy: Tensor,
    negative_slope: float,
    need_dx: bool,
) -> tuple[Tensor | None, Tensor, Tensor]:
    """Gradients ``(dx or None, d score_src, d score_dst)`` of :func:`gat_forward`."""
    heads, dim = x.shape[1], x.shape[2]
    n_blocks = _n_blocks()
    d_score = alpha.new_empty(adj.nnz, heads)
    d_dst = x.new_empty(adj.n_rows, heads)
    dy_array = _array(dy)
    _gat_edge_grad_kernel(
        _array(adj.indptr),
        _array(adj.indices),
        _array(x),
        _array(score_src),
        _array(score_dst),
        _array(alpha),
        dy_array,
        float(negative_slope),
        d_score.numpy(),
        d_dst.numpy(),
        n_blocks,
    )
    d_src = x.new_empty(adj.n_cols, heads)
    dx = x.new_empty(adj.n_cols if need_dx else 0, heads, dim)
    _gat_column_grad_kernel(
        _array(adj.t_indptr),
        _array(adj.t_indices),
        _array(adj.t_edge),
        _array(alpha),
        d_score.numpy(),
        dy_array,
        need_dx,
        dx.numpy(),
        d_src.numpy(),
        n_blocks,
    )
    return (dx if need_dx else None), d_src, d_dst
