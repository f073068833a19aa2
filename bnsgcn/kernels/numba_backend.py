"""Multi-threaded CPU kernels in numba.

Every kernel is parallel over rows of one CSR (forward: A's rows; backward: the rows of the
prebuilt transpose), so each output row has exactly one writer: no atomics, deterministic
results for any thread count. Rows are grouped into blocks of about equal cost
(entries + rows), so skewed degree distributions still balance across threads.

Gathered rows (``x[u]`` for each entry) are random in memory, so the kernels are bound by
memory latency and bandwidth: the row ``_PREFETCH_DISTANCE`` entries ahead is prefetched.
With 4 KiB pages nearly every gathered row also misses the TLB; starting the process with
``THP_MEM_ALLOC_ENABLE=1`` (torch then puts large tensors in transparent huge pages)
roughly halves the time of a gather-bound kernel (see docs/benchmarks.md).

Compiled specialisations are few: float32 / float64 times the index dtype (int32 unless a
graph has more than 2^31 - 1 nodes or entries), and for the sparse product rows of 64 and
128 floats as constants besides any width (:func:`_spmm_kernel`), cached on disk
(``cache=True``). Each kernel is compiled with ``parallel=True`` and runs on one thread or
many (see :class:`_RowParallel`).
"""

from __future__ import annotations

import functools
import math

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic
from torch import Tensor

from . import buffers
from .adjacency import Adjacency
from .backend import draw_seed

# Reassociation etc. let LLVM vectorise the feature loops; no nnan/ninf so NaN/inf propagate.
_FASTMATH = {"reassoc", "contract", "arcp", "nsz", "afn"}
_BLOCKS_PER_THREAD = 16
# Entries ahead whose gathered feature row is prefetched (hides DRAM latency of random rows).
_PREFETCH_DISTANCE = 8
# Row widths the sparse product is compiled for as constants (:func:`_spmm_kernel`).
_CONSTANT_WIDTHS = (64, 128)
# Below this much work (entries x row width) a call runs on one thread: waking threads costs more.
_ONE_THREAD_WORK = 1 << 18


@functools.cache
def _start_numba_threads() -> None:
    """Start numba's threading layer, once per process, keeping torch's thread count.

    numba's OpenMP layer shares libgomp with torch and, when it starts, sets OpenMP's default
    team size to ``NUMBA_NUM_THREADS`` (every core), which torch reads as its own intra-op
    thread count: a one-thread rank would then run its dense products, and size the kernels'
    teams, on every core of the machine.
    """
    threads = torch.get_num_threads()
    numba.get_num_threads()
    torch.set_num_threads(threads)


class _RowParallel:
    """A row-parallel kernel (``prange`` over blocks of rows) and the team it runs on.

    A rank given one thread, or a call too small to share, runs it on a team of one, which
    never wakes numba's OpenMP threads: once woken they spin after each parallel region and
    starve the other ranks of an oversubscribed machine (four ranks on two cores ran Cora
    epochs 4x slower). A team of one is also why there is no serial build: compiled without
    ``parallel=True`` the same kernels measured 10-15% slower on large inputs and up to 3x
    on small ones.
    Results are the same for any team: each output row has one writer.
    The last argument of the kernel is its block count, supplied here.
    """

    def __init__(self, kernel, options: dict):
        self.kernel = njit(parallel=True, cache=True, **options)(kernel)

    def __call__(self, *args, work: int) -> None:
        _start_numba_threads()
        threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
        if work < _ONE_THREAD_WORK:
            threads = 1
        numba.set_num_threads(threads)
        self.kernel(*args, 1 if threads == 1 else threads * _BLOCKS_PER_THREAD)


def _row_parallel(**options):
    return lambda kernel: _RowParallel(kernel, options)


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


@intrinsic
def _prefetch(typingctx, array, flat_index):
    """Hint the CPU to fetch ``array.flat[flat_index]``'s cache line (C-contiguous ``array``)."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        address = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fn_type = ir.FunctionType(ir.VoidType(), [address.type, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fn_type, "llvm.prefetch.p0")
        builder.call(fn, [address, i32(0), i32(3), i32(1)])  # read, keep in all cache levels, data
        return context.get_dummy_value()

    return types.void(array, flat_index), codegen


@njit(cache=True, inline="always")
def _prefetch_row(matrix, row, row_length):
    """Prefetch every cache line of row ``row`` of a C-contiguous matrix viewed as rows of ``row_length``."""
    start = row * row_length
    for k in range(0, row_length, 64 // matrix.itemsize):
        _prefetch(matrix, start + k)


@njit(cache=True, inline="always")
def _prefetch_gathered(x, indices, j, nnz, d):
    """Gathered rows are random: request the one ``_PREFETCH_DISTANCE`` entries after ``j``."""
    if j + _PREFETCH_DISTANCE < nnz:
        _prefetch_row(x, indices[j + _PREFETCH_DISTANCE], d)


@njit(cache=True, inline="always")
def _entry_weight(values, weighted, col_scale, col_scaled, j, u):
    """``values[j] * c_u``: the entry's weight, the row's factor left out (applied once per row)."""
    a = values[j] if weighted else values.dtype.type(1)
    if col_scaled:
        a *= col_scale[u]
    return a


@njit(cache=True, inline="always")
def _add_weighted_entries(target, x, indices, values, weighted, col_scale, col_scaled, factor, start, end, d):
    """``target += factor * sum_j w_j x[indices[j]]`` over entries ``start..end``, two per pass
    over ``target`` (half its loads and stores)."""
    nnz = indices.shape[0]
    for j in range(start, end - 1, 2):
        _prefetch_gathered(x, indices, j, nnz, d)
        _prefetch_gathered(x, indices, j + 1, nnz, d)
        u, u_next = indices[j], indices[j + 1]
        x_row, x_next = x[u], x[u_next]
        a = factor * _entry_weight(values, weighted, col_scale, col_scaled, j, u)
        a_next = factor * _entry_weight(values, weighted, col_scale, col_scaled, j + 1, u_next)
        for k in range(d):
            target[k] += a * x_row[k] + a_next * x_next[k]
    if (end - start) % 2 == 1:
        u = indices[end - 1]
        x_row = x[u]
        a = factor * _entry_weight(values, weighted, col_scale, col_scaled, end - 1, u)
        for k in range(d):
            target[k] += a * x_row[k]


@njit(cache=True, inline="always")
def _add_entries(target, x, indices, start, end, d):
    """``target += sum_j x[indices[j]]`` over entries ``start..end``, two per pass."""
    nnz = indices.shape[0]
    for j in range(start, end - 1, 2):
        _prefetch_gathered(x, indices, j, nnz, d)
        _prefetch_gathered(x, indices, j + 1, nnz, d)
        x_row, x_next = x[indices[j]], x[indices[j + 1]]
        for k in range(d):
            target[k] += x_row[k] + x_next[k]
    if (end - start) % 2 == 1:
        x_row = x[indices[end - 1]]
        for k in range(d):
            target[k] += x_row[k]


@functools.cache
def _spmm_kernel(width: int) -> _RowParallel:
    """The sparse product's kernel for rows of ``width`` floats; 0: any width (read from
    ``x``). A width in :data:`_CONSTANT_WIDTHS` is a constant of the compiled code, whose
    row loops LLVM then unrolls: 10-20% faster at 64 and 128 here, slower at 16."""

    @_row_parallel(fastmath=_FASTMATH)
    def kernel(
        indptr, indices, values, weighted, row_scale, row_scaled, col_scale, col_scaled, x, accumulate, out, n_blocks
    ):
        """``out (+)= diag(row_scale) P diag(col_scale) x``. Unweighted entries, and any row
        added into ``out``, are summed in a row-sized buffer that stays in L1 and written
        once, scaled by the row's factor: no multiplication per entry (forward 128 wide:
        8-14% faster than scaling each entry into ``out``). Weighted entries of a row that
        is overwritten go straight into it, the row's factor in each weight: there the
        buffer's extra pass cost 5-10%."""
        d = width if width else x.shape[1]
        per_entry = weighted or col_scaled
        one = x.dtype.type(1)
        for block in prange(n_blocks):
            total = np.empty(d, dtype=x.dtype)
            for v in range(_block_start(indptr, block, n_blocks), _block_start(indptr, block + 1, n_blocks)):
                start, end = indptr[v], indptr[v + 1]
                if accumulate and start == end:
                    # nothing to add: the row is neither read nor written (at p = 0.1 most
                    # rows of the boundary product; adding zeros was a pass over ``out``)
                    continue
                r = row_scale[v] if row_scaled else one
                out_row = out[v]
                if per_entry and not accumulate:
                    for k in range(d):
                        out_row[k] = 0
                    _add_weighted_entries(
                        out_row, x, indices, values, weighted, col_scale, col_scaled, r, start, end, d
                    )
                    continue
                for k in range(d):
                    total[k] = 0
                if per_entry:
                    _add_weighted_entries(
                        total, x, indices, values, weighted, col_scale, col_scaled, one, start, end, d
                    )
                else:
                    _add_entries(total, x, indices, start, end, d)
                if accumulate:
                    for k in range(d):
                        out_row[k] += r * total[k]
                else:
                    for k in range(d):
                        out_row[k] = r * total[k]

    return kernel


@_row_parallel(fastmath=_FASTMATH)
def _gat_forward_kernel(indptr, indices, x, score_src, score_dst, col_weight, weighted, slope, alpha, out, n_blocks):
    nnz, heads, dim = indices.shape[0], x.shape[1], x.shape[2]
    one, slope = x.dtype.type(1), x.dtype.type(slope)
    for block in prange(n_blocks):
        # Row statistics in x's dtype: float32 exp is about twice as fast as float64 exp.
        row_max = np.empty(heads, x.dtype)
        row_sum = np.empty(heads, x.dtype)
        for v in range(_block_start(indptr, block, n_blocks), _block_start(indptr, block + 1, n_blocks)):
            out[v] = 0
            start, end = indptr[v], indptr[v + 1]
            row_max[:] = -np.inf
            for j in range(start, end):
                _prefetch_gathered(score_src, indices, j, nnz, heads)
                u = indices[j]
                for h in range(heads):
                    e = score_src[u, h] + score_dst[v, h]
                    e = e if e > 0 else slope * e
                    alpha[j, h] = e
                    row_max[h] = max(row_max[h], e)
            row_sum[:] = 0
            for j in range(start, end):
                w = col_weight[indices[j]] if weighted else one
                for h in range(heads):
                    p = w * np.exp(alpha[j, h] - row_max[h])
                    alpha[j, h] = p
                    row_sum[h] += p
            for h in range(heads):  # a row whose weights are all 0 gets alpha = 0, not 0/0
                row_sum[h] = 1 / row_sum[h] if row_sum[h] > 0 else 0
            for j in range(start, end):
                _prefetch_gathered(x, indices, j, nnz, heads * dim)
                x_rows = x[indices[j]]
                for h in range(heads):
                    alpha[j, h] *= row_sum[h]
                    a = alpha[j, h]  # in x's dtype: keeps the feature loop single precision
                    out_row = out[v, h]
                    x_row = x_rows[h]
                    for k in range(dim):
                        out_row[k] += a * x_row[k]


@_row_parallel(fastmath=_FASTMATH)
def _gat_edge_grad_kernel(indptr, indices, x, score_src, score_dst, alpha, dy, slope, d_score, d_dst, n_blocks):
    """Per row v: SDDMM g = <dy[v], x[u]>, softmax and LeakyReLU backward into ``d_score``."""
    nnz, heads, dim = indices.shape[0], x.shape[1], x.shape[2]
    zero, slope = x.dtype.type(0), x.dtype.type(slope)
    for block in prange(n_blocks):
        row_dot = np.empty(heads, np.float64)
        for v in range(_block_start(indptr, block, n_blocks), _block_start(indptr, block + 1, n_blocks)):
            start, end = indptr[v], indptr[v + 1]
            row_dot[:] = 0
            dy_rows = dy[v]
            for j in range(start, end):
                _prefetch_gathered(x, indices, j, nnz, heads * dim)
                x_rows = x[indices[j]]
                for h in range(heads):
                    dy_row = dy_rows[h]
                    x_row = x_rows[h]
                    g = zero
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


@_row_parallel(fastmath=_FASTMATH)
def _gat_column_grad_kernel(t_indptr, t_indices, t_edge, alpha, d_score, dy, need_dx, dx, d_src, n_blocks):
    """Per column u (a row of the transpose): d score_src[u] and dx[u] = sum_v alpha_vu dy[v]."""
    nnz, heads, dim = t_indices.shape[0], dy.shape[1], dy.shape[2]
    for block in prange(n_blocks):
        for u in range(_block_start(t_indptr, block, n_blocks), _block_start(t_indptr, block + 1, n_blocks)):
            d_src[u] = 0
            if need_dx:
                dx[u] = 0
            for t in range(t_indptr[u], t_indptr[u + 1]):
                if t + _PREFETCH_DISTANCE < nnz:  # per-entry rows are read in transposed, i.e. random, order
                    _prefetch_row(d_score, t_edge[t + _PREFETCH_DISTANCE], heads)
                    if need_dx:
                        _prefetch_row(alpha, t_edge[t + _PREFETCH_DISTANCE], heads)
                        _prefetch_row(dy, t_indices[t + _PREFETCH_DISTANCE], heads * dim)
                j = t_edge[t]
                for h in range(heads):
                    d_src[u, h] += d_score[j, h]
                if need_dx:
                    dy_rows = dy[t_indices[t]]
                    for h in range(heads):
                        a = alpha[j, h]
                        dx_row = dx[u, h]
                        dy_row = dy_rows[h]
                        for k in range(dim):
                            dx_row[k] += a * dy_row[k]


@_row_parallel()
def _count_kept_kernel(indptr, indices, keep, counts, n_blocks):
    for block in prange(n_blocks):
        for v in range(_block_start(indptr, block, n_blocks), _block_start(indptr, block + 1, n_blocks)):
            count = 0
            for j in range(indptr[v], indptr[v + 1]):
                count += keep[indices[j]]
            counts[v] = count


@_row_parallel()
def _filter_rows_kernel(
    indptr, indices, values, weighted, keep, new_column, new_indptr, new_indices, new_values, new_entry, n_blocks
):
    """Copy the kept entries of each row; ``new_entry[j]`` = new id of kept entry ``j``."""
    for block in prange(n_blocks):
        for v in range(_block_start(indptr, block, n_blocks), _block_start(indptr, block + 1, n_blocks)):
            position = new_indptr[v]
            for j in range(indptr[v], indptr[v + 1]):
                column = indices[j]
                if keep[column]:
                    new_indices[position] = new_column[column]
                    if weighted:
                        new_values[position] = values[j]
                    new_entry[j] = position
                    position += 1


@_row_parallel()
def _filter_columns_kernel(
    t_indptr,
    t_indices,
    t_edge,
    t_values,
    weighted,
    kept_columns,
    new_entry,
    new_t_indptr,
    new_t_indices,
    new_t_edge,
    new_t_values,
    n_blocks,
):
    """Copy the transposed rows (columns) that are kept, pointing t_edge at the new entry ids."""
    for block in prange(n_blocks):
        for c in range(_block_start(new_t_indptr, block, n_blocks), _block_start(new_t_indptr, block + 1, n_blocks)):
            old = kept_columns[c]
            position = new_t_indptr[c]
            for t in range(t_indptr[old], t_indptr[old + 1]):
                new_t_indices[position] = t_indices[t]
                new_t_edge[position] = new_entry[t_edge[t]]
                if weighted:
                    new_t_values[position] = t_values[t]
                position += 1


def _array(t: Tensor) -> np.ndarray:
    return t.detach().contiguous().numpy()


def _or_empty(t: Tensor | None, dtype: torch.dtype) -> np.ndarray:
    """``t`` as an array of ``dtype``; an empty stand-in when absent keeps one compiled specialisation."""
    if t is None:
        return torch.empty(0, dtype=dtype).numpy()
    return _array(t.to(dtype))


def _offsets(counts: Tensor) -> Tensor:
    """int64 ``[len(counts) + 1]`` exclusive prefix sums: a CSR pointer from per-row counts."""
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=offsets[1:])
    return offsets


@njit(cache=True)
def _select_by_columns_kernel(
    t_indptr,
    t_indices,
    t_edge,
    t_values,
    weighted,
    kept_columns,
    indptr,
    indices,
    values,
    new_t_indptr,
    new_t_indices,
    new_t_edge,
    new_t_values,
):
    """The kept columns' entries, read from the transposed CSR alone: count them per row,
    then place each at its row's next free slot, visiting columns in ascending order (so
    each row's columns come out ascending, as a counting sort)."""
    n_rows = indptr.shape[0] - 1
    indptr[:] = 0
    for c in range(kept_columns.shape[0]):
        old = kept_columns[c]
        for t in range(t_indptr[old], t_indptr[old + 1]):
            indptr[t_indices[t] + 1] += 1
    for v in range(n_rows):
        indptr[v + 1] += indptr[v]
    free = indptr[:-1].copy()
    position = 0
    for c in range(kept_columns.shape[0]):
        old = kept_columns[c]
        new_t_indptr[c] = position
        for t in range(t_indptr[old], t_indptr[old + 1]):
            row = t_indices[t]
            slot = free[row]
            free[row] += 1
            indices[slot] = c
            new_t_indices[position] = row
            new_t_edge[position] = slot
            if weighted:
                values[slot] = t_values[t]
                new_t_values[position] = t_values[t]
            position += 1
    new_t_indptr[kept_columns.shape[0]] = position


# Below this share of the entries kept, selecting reads the kept columns' entries alone
# (serial); above it the row-parallel filter over every entry is cheaper (p = 0.1 on the
# reference graph's boundary columns: 0.6 ms instead of 7.8 ms).
_SELECT_BY_COLUMNS_SHARE = 0.25


def select_columns(adj: Adjacency, keep: Tensor, sizes: tuple[int, int] | None = None) -> Adjacency:
    """:meth:`Adjacency.select_columns` (CPU only: ``sizes`` is not needed). Few kept entries:
    one serial pass over them through the transposed CSR (:func:`_select_by_columns_kernel`);
    else three row-parallel passes over every entry: count, copy rows, copy columns."""
    kept_columns = torch.nonzero(keep).flatten()
    t_indptr = _offsets(adj.t_indptr.diff()[kept_columns])
    nnz = int(t_indptr[-1])
    weighted = adj.values is not None
    value_dtype = adj.values.dtype if weighted else torch.float32
    # Renumbered ids are no larger than the old ones: the index dtypes carry over.
    indices, t_indices = torch.empty(nnz, dtype=adj.indices.dtype), torch.empty(nnz, dtype=adj.t_indices.dtype)
    t_edge = torch.empty(nnz, dtype=adj.t_edge.dtype)
    values = torch.empty(nnz, dtype=value_dtype) if weighted else None
    t_values = torch.empty(nnz, dtype=value_dtype) if weighted else None
    if nnz <= _SELECT_BY_COLUMNS_SHARE * adj.nnz:
        indptr = torch.empty(adj.n_rows + 1, dtype=torch.int64)
        _select_by_columns_kernel(
            _array(adj.t_indptr), _array(adj.t_indices), _array(adj.t_edge), _or_empty(adj.t_values, value_dtype),
            weighted, _array(kept_columns), indptr.numpy(), indices.numpy(), _or_empty(values, value_dtype),
            t_indptr.numpy(), t_indices.numpy(), t_edge.numpy(), _or_empty(t_values, value_dtype),
        )  # fmt: skip
        return Adjacency(indptr, indices, values, t_indptr, t_indices, t_edge, t_values, kept_columns.numel())
    work = adj.nnz + adj.n_rows
    keep_array = _array(keep)
    counts = torch.empty(adj.n_rows, dtype=torch.int64)
    _count_kept_kernel(_array(adj.indptr), _array(adj.indices), keep_array, counts.numpy(), work=work)
    indptr = _offsets(counts)
    new_column = torch.cumsum(keep, 0).sub_(1).to(adj.indices.dtype)
    new_entry = torch.empty(adj.nnz, dtype=adj.t_edge.dtype)
    _filter_rows_kernel(
        _array(adj.indptr), _array(adj.indices), _or_empty(adj.values, value_dtype), weighted, keep_array,
        _array(new_column), _array(indptr), indices.numpy(), _or_empty(values, value_dtype), new_entry.numpy(),
        work=work,
    )  # fmt: skip
    _filter_columns_kernel(
        _array(adj.t_indptr), _array(adj.t_indices), _array(adj.t_edge), _or_empty(adj.t_values, value_dtype),
        weighted, _array(kept_columns), new_entry.numpy(), _array(t_indptr), t_indices.numpy(), t_edge.numpy(),
        _or_empty(t_values, value_dtype), work=work,
    )  # fmt: skip
    return Adjacency(indptr, indices, values, t_indptr, t_indices, t_edge, t_values, kept_columns.numel())


def _spmm_csr(
    indptr: Tensor,
    indices: Tensor,
    values: Tensor | None,
    row_scale: Tensor | None,
    col_scale: Tensor | None,
    x: Tensor,
    n_rows: int,
    out: Tensor | None = None,
) -> Tensor:
    """``diag(row_scale) P diag(col_scale) x`` into a new tensor, or added into ``out``
    (C-contiguous, [n_rows, d]) when given."""
    accumulate = out is not None
    if out is None:
        out = buffers.empty((n_rows, x.shape[1]), x.dtype)
    _spmm_kernel(x.shape[1] if x.shape[1] in _CONSTANT_WIDTHS else 0)(
        _array(indptr), _array(indices), _or_empty(values, x.dtype), values is not None,
        _or_empty(row_scale, x.dtype), row_scale is not None, _or_empty(col_scale, x.dtype), col_scale is not None,
        _array(x), accumulate, out.numpy(), work=indices.numel() * x.shape[1],
    )  # fmt: skip
    return out


def spmm(adj: Adjacency, x: Tensor) -> Tensor:
    """``A x``: ``x [n_cols, d] -> [n_rows, d]``."""
    return _spmm_csr(adj.indptr, adj.indices, adj.values, adj.row_scale, adj.col_scale, x, adj.n_rows)


def spmm_add_(base: Tensor, adj: Adjacency, x: Tensor) -> Tensor:
    """``base += A x`` in place, without an ``A x`` temporary; returns ``base``."""
    return _spmm_csr(adj.indptr, adj.indices, adj.values, adj.row_scale, adj.col_scale, x, adj.n_rows, out=base)


def spmm_transposed(adj: Adjacency, y: Tensor) -> Tensor:
    """``A^T y = diag(c) P^T diag(r) y`` over the prebuilt transposed CSR: ``y [n_rows, d] -> [n_cols, d]``."""
    return _spmm_csr(adj.t_indptr, adj.t_indices, adj.t_values, adj.col_scale, adj.row_scale, y, adj.n_cols)


def gat_forward(
    adj: Adjacency, x: Tensor, score_src: Tensor, score_dst: Tensor, col_weight: Tensor | None, negative_slope: float
) -> tuple[Tensor, Tensor]:
    """Attention aggregation; returns ``(Y [n_rows, H, D], alpha [nnz, H])``."""
    heads = x.shape[1]
    out = x.new_empty(adj.n_rows, heads, x.shape[2])
    alpha = x.new_empty(adj.nnz, heads)
    _gat_forward_kernel(
        _array(adj.indptr),
        _array(adj.indices),
        _array(x),
        _array(score_src),
        _array(score_dst),
        _or_empty(col_weight, x.dtype),
        col_weight is not None,
        float(negative_slope),
        alpha.numpy(),
        out.numpy(),
        work=adj.nnz * x.shape[1] * x.shape[2],
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
    work = adj.nnz * heads * dim
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
        work=work,
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
        work=work,
    )
    return (dx if need_dx else None), d_src, d_dst


@njit(cache=True)
def _scatter_rows_kernel(index, rows, zero_first, out):
    if zero_first:
        out[:, :] = 0
    # in index order, one row at a time: a row sent to several ranks sums their gradients
    # in the same order for any data
    for i in range(index.shape[0]):
        target, source = out[index[i]], rows[i]
        for k in range(rows.shape[1]):
            target[k] += source[k]


def scatter_rows(index: Tensor, rows: Tensor, n: int, into: Tensor | None = None) -> Tensor:
    """``out`` [n, *row]: zero, plus ``rows[i]`` [m, *row] added at row ``index[i]`` (int64
    [m]; an index may repeat): the gradient of gathering rows ``index`` of an [n, *row]
    tensor. With ``into`` (C-contiguous [n, *row]) the rows are added into it instead, in
    place. One pass over ``out`` and one over ``rows``: torch's ``index_add_`` took
    1.1 ns per element here, after a fill of its own."""
    out = buffers.empty((n, *rows.shape[1:]), rows.dtype) if into is None else into
    width = math.prod(rows.shape[1:])
    _scatter_rows_kernel(
        _array(index), _array(rows).reshape(rows.shape[0], width), into is None, out.numpy().reshape(n, width)
    )
    return out


@njit(cache=True, fastmath=_FASTMATH)
def _cross_entropy_rows_kernel(logits, rows, labels, probabilities, losses):
    classes = logits.shape[1]
    for k in range(rows.shape[0]):
        row, p = logits[rows[k]], probabilities[k]
        top = row[0]
        for j in range(1, classes):
            top = max(top, row[j])
        total = logits.dtype.type(0)
        for j in range(classes):  # each exp once (numba's are scalar calls): kept for backward
            p[j] = np.exp(row[j] - top)
            total += p[j]
        inverse = logits.dtype.type(1) / total
        for j in range(classes):
            p[j] *= inverse
        losses[k] = top + np.log(total) - row[labels[k]]


@njit(cache=True)
def _cross_entropy_rows_grad_kernel(probabilities, rows, labels, scale, out):
    scale = out.dtype.type(scale)
    out[:, :] = 0
    for k in range(rows.shape[0]):  # in order: a repeated row sums its terms the same way for any data
        target, p = out[rows[k]], probabilities[k]
        for j in range(out.shape[1]):
            target[j] += scale * p[j]
        target[labels[k]] -= scale


def cross_entropy_rows(logits: Tensor, rows: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """``(probabilities, losses)``: the softmax of rows ``rows`` of ``logits`` [t, C] (from
    the buffer pool) and ``losses[k] = log sum_j exp(logits[r_k, j]) - logits[r_k, labels[k]]``
    [t]; one serial pass over the rows, read in place."""
    probabilities = buffers.empty((rows.shape[0], logits.shape[1]), logits.dtype)
    losses = torch.empty(rows.shape[0], dtype=logits.dtype)
    _cross_entropy_rows_kernel(_array(logits), _array(rows), _array(labels), probabilities.numpy(), losses.numpy())
    return probabilities, losses


def cross_entropy_rows_backward(probabilities: Tensor, rows: Tensor, labels: Tensor, n: int, scale: Tensor) -> Tensor:
    """The gradient of ``scale * sum(losses)`` (``scale`` a scalar tensor) w.r.t. the logits
    [n, C]: zero in rows not in ``rows``, ``scale * (softmax - onehot)`` in those (summed
    where a row repeats); one pass writes it all."""
    out = buffers.empty((n, probabilities.shape[1]), probabilities.dtype)
    _cross_entropy_rows_grad_kernel(_array(probabilities), _array(rows), _array(labels), float(scale), out.numpy())
    return out


# Rows as their nonzero entries (the exchange's --nonzero-rows): a bitmap per row, bit j % 8 of
# byte j // 8 set where entry j is nonzero, and the nonzero entries in row-major order. Each
# kernel is one serial pass. No branch depends on the data: an entry is read or written at
# the current position whatever its bit, and the position moves on by the bit (a branch per
# entry mispredicts about half the time); a clear bit's write is replaced by the next entry's
# and its read discarded, so ``values`` has one spare slot at its end where a kernel reads it
# or writes it with fewer entries than the rows. Bytes of eight entries take a loop of
# constant length (compiled unrolled: 2-3x faster than a loop to min(8, d - 8 b)).


@njit(cache=True, inline="always")
def _pack_byte(row, base, width, values, position):
    byte = 0
    for k in range(width):
        nonzero = np.int64(row[base + k] != 0)
        values[position] = row[base + k]
        position += nonzero
        byte |= nonzero << k
    return byte, position


@njit(cache=True, inline="always")
def _unpack_byte(byte, values, position, out, base, width, zero):
    for k in range(width):
        bit = (byte >> k) & 1
        value = values[position]  # read whatever the bit (inside the condition, it was a branch: 2.5x slower)
        out[base + k] = value if bit else zero
        position += bit
    return position


@njit(cache=True, inline="always")
def _gather_byte(byte, row, base, width, values, position):
    for k in range(width):
        values[position] = row[base + k]
        position += (byte >> k) & 1
    return position


@njit(cache=True, inline="always")
def _unpack_row(bits, values, position, out, zero):
    """Row ``out`` [d] from its bitmap ``bits`` and the entries from ``values[position]`` on;
    returns the position after them. (``zero`` of ``out``'s type comes from the caller: made
    here, it made the kernels 3x slower.)"""
    full, d = out.shape[0] // 8, out.shape[0]
    for b in range(full):
        position = _unpack_byte(np.int64(bits[b]), values, position, out, 8 * b, 8, zero)
    if 8 * full < d:
        position = _unpack_byte(np.int64(bits[full]), values, position, out, 8 * full, d - 8 * full, zero)
    return position


@njit(cache=True)
def _pack_nonzero_kernel(x, index, bits, values, offsets):
    d, position = x.shape[1], 0
    full = d // 8
    for i in range(index.shape[0]):
        row = x[index[i]]
        for b in range(full):
            bits[i, b], position = _pack_byte(row, 8 * b, 8, values, position)
        if 8 * full < d:
            bits[i, full], position = _pack_byte(row, 8 * full, d - 8 * full, values, position)
        offsets[i + 1] = position


@njit(cache=True)
def _unpack_nonzero_kernel(bits, values, out):
    zero, position = out.dtype.type(0), 0
    for i in range(out.shape[0]):
        position = _unpack_row(bits[i], values, position, out[i], zero)


@njit(cache=True)
def _gather_nonzero_kernel(rows, bits, values):
    d, position = rows.shape[1], 0
    full = d // 8
    for i in range(rows.shape[0]):
        for b in range(full):
            position = _gather_byte(np.int64(bits[i, b]), rows[i], 8 * b, 8, values, position)
        if 8 * full < d:
            position = _gather_byte(np.int64(bits[i, full]), rows[i], 8 * full, d - 8 * full, values, position)


@njit(cache=True)
def _scatter_nonzero_rows_kernel(index, bits, values, zero_first, out):
    zero, position = out.dtype.type(0), 0
    if zero_first:
        out[:, :] = zero
    row = np.empty(out.shape[1], dtype=out.dtype)  # one row unpacked, then added whole (vectorised)
    # in index order, as _scatter_rows_kernel: the same sums in the same order
    for i in range(index.shape[0]):
        position = _unpack_row(bits[i], values, position, row, zero)
        target = out[index[i]]
        for k in range(row.shape[0]):
            target[k] += row[k]


def pack_nonzero_rows(x: Tensor, index: Tensor, bits: Tensor, values: Tensor) -> Tensor:
    """Rows ``x[index]`` ([n, d] -> m rows) as their nonzero entries: writes ``bits`` uint8
    [m, ceil(d / 8)] and the entries into ``values`` (1-D, m * d long at least); returns
    int64 offsets [m + 1], row i's entries being ``values[offsets[i]:offsets[i + 1]]``."""
    offsets = torch.zeros(index.numel() + 1, dtype=torch.int64)
    _pack_nonzero_kernel(_array(x), _array(index), bits.numpy(), values.numpy(), offsets.numpy())
    return offsets


def unpack_nonzero_rows(bits: Tensor, values: Tensor, out: Tensor) -> Tensor:
    """The rows :func:`pack_nonzero_rows` packed, written whole into ``out`` [m, d];
    ``values`` holds their entries and a spare slot."""
    _unpack_nonzero_kernel(_array(bits), _array(values), out.numpy())
    return out


def gather_nonzero(rows: Tensor, bits: Tensor, values: Tensor) -> Tensor:
    """The entries of ``rows`` [m, d] where ``bits`` (as packed) are set, in row-major order,
    written into ``values`` (1-D, one longer than the set bits: a spare slot); returns
    ``values[:-1]``."""
    _gather_nonzero_kernel(_array(rows), _array(bits), values.numpy())
    return values[:-1]


def scatter_nonzero_rows(
    index: Tensor, bits: Tensor, values: Tensor, shape: tuple[int, int], into: Tensor | None = None
) -> Tensor:
    """:func:`scatter_rows` of the rows that ``bits`` and ``values`` pack (zero where a bit is
    clear): ``out`` of ``shape`` [n, d], zero plus row i added at row ``index[i]`` (with
    ``into``, added into it in place); ``values`` holds the entries and one spare slot."""
    out = buffers.empty(shape, values.dtype) if into is None else into
    _scatter_nonzero_rows_kernel(_array(index), _array(bits), _array(values), into is None, out.numpy())
    return out


# SplitMix64 (Steele, Lea & Flood 2014) of a counter: 64 random bits per word of four
# elements, the same for any thread count or block split.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


@njit(cache=True, inline="always")
def _splitmix64(seed, counter):
    z = seed + (counter + np.uint64(1)) * _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


# Random words drawn per pass of a dropout block: a buffer that stays in L1.
_DROPOUT_CHUNK_WORDS = 256


# Loops over whole arrays with no branch on the element: numba vectorises these, not loops
# with computed bounds, so each block passes its slices.
@njit(cache=True)
def _dropout_block(x, seed, first_word, threshold, scale, out, keep, with_mask):
    n = x.shape[0]
    # The chunk's words, and the same bytes as 16-bit fields: field t of word w is field
    # 4 w + t (little-endian), element i's is field i.
    words = np.empty(_DROPOUT_CHUNK_WORDS, np.uint64)
    fields = words.view(np.uint16)
    threshold = np.int32(threshold)
    for start in range(0, n, 4 * _DROPOUT_CHUNK_WORDS):
        count = min(4 * _DROPOUT_CHUNK_WORDS, n - start)
        first = np.uint64(first_word + start // 4)
        for w in range((count + 3) // 4):
            words[w] = _splitmix64(seed, first + np.uint64(w))
        x_chunk, out_chunk = x[start : start + count], out[start : start + count]
        for i in range(count):
            out_chunk[i] = x_chunk[i] * scale * (np.int32(fields[i]) >= threshold)
        if with_mask:
            keep_chunk = keep[start : start + count]
            for i in range(count):
                keep_chunk[i] = np.int32(fields[i]) >= threshold


@_row_parallel()
def _dropout_kernel(x, seed, threshold, scale, out, keep, with_mask, n_blocks):
    n = x.shape[0]
    words = (n + 3) // 4
    scale = x.dtype.type(scale)
    for block in prange(n_blocks):
        first, last = words * block // n_blocks, words * (block + 1) // n_blocks
        start, stop = 4 * first, min(4 * last, n)
        _dropout_block(
            x[start:stop],
            seed,
            first,
            threshold,
            scale,
            out[start:stop],
            keep[start:stop] if with_mask else keep[0:0],
            with_mask,
        )


@njit(cache=True)
def _masked_scale_block(dy, keep, scale, dx):
    for i in range(dy.shape[0]):
        dx[i] = dy[i] * scale * keep[i]


@_row_parallel()
def _masked_scale_kernel(dy, keep, scale, dx, n_blocks):
    n = dy.shape[0]
    scale = dy.dtype.type(scale)
    for block in prange(n_blocks):
        start, stop = n * block // n_blocks, n * (block + 1) // n_blocks
        _masked_scale_block(dy[start:stop], keep[start:stop], scale, dx[start:stop])


@njit(cache=True)
def _quantize_block(x, lo, inv_step, levels, seed, first_word, codes):
    n, d = x.shape
    words_per_row = (d + 1) // 2
    low24 = np.uint64(0xFFFFFF)
    unit = np.float32(2.0**-24)
    top = np.float32(levels)
    for i in range(n):
        word = np.uint64(first_word + i * words_per_row)
        for pair in range(words_per_row):  # two 24-bit uniforms from one draw
            bits = _splitmix64(seed, word + np.uint64(pair))
            for half in range(2):
                j = 2 * pair + half
                if j < d:
                    u = np.float32((bits >> np.uint64(32 * half)) & low24) * unit
                    t = np.floor((x[i, j] - lo[i]) * inv_step[i] + u)
                    codes[i, j] = np.uint8(min(max(t, np.float32(0.0)), top))


@_row_parallel()
def _quantize_kernel(x, lo, inv_step, levels, seed, codes, n_blocks):
    n, d = x.shape
    words_per_row = (d + 1) // 2
    for block in prange(n_blocks):
        start, stop = n * block // n_blocks, n * (block + 1) // n_blocks
        _quantize_block(
            x[start:stop], lo[start:stop], inv_step[start:stop], levels, seed, start * words_per_row, codes[start:stop]
        )


def quantize_codes(
    x: Tensor, lo: Tensor, inv_step: Tensor, levels: int, generator: torch.Generator | None = None
) -> Tensor:
    """uint8 codes ``floor((x - lo) * inv_step + u)`` clamped to ``[0, levels]``, ``u``
    uniform in [0, 1) (24 bits) from a counter-based generator seeded from torch's: one pass."""
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    codes = torch.empty(x.shape, dtype=torch.uint8)
    _quantize_kernel(
        _array(x.float().contiguous()),
        _array(lo),
        _array(inv_step),
        levels,
        np.uint64(seed),
        codes.numpy(),
        work=x.numel(),
    )
    return codes


def dropout(
    x: Tensor, threshold: int, scale: float, seed: int | None = None, with_mask: bool = True
) -> tuple[Tensor, Tensor | None]:
    """``(x * keep * scale, keep)`` with ``keep`` = 16 random bits >= ``threshold``, one
    fused pass; the bits come from ``seed`` (the same mask for the same seed and shape), by
    default one drawn from torch's generator (reproducible). Without ``with_mask`` the mask
    is neither written nor returned (None)."""
    if seed is None:
        seed = draw_seed()
    out = buffers.empty(x.shape, x.dtype)
    keep = buffers.empty(x.shape if with_mask else (0,), torch.bool)
    _dropout_kernel(
        _array(x).reshape(-1), np.uint64(seed), np.uint64(threshold), float(scale), out.numpy().reshape(-1),
        keep.numpy().reshape(-1), with_mask, work=x.numel(),
    )  # fmt: skip
    return out, keep if with_mask else None


def masked_scale(dy: Tensor, keep: Tensor, scale: float) -> Tensor:
    """``dy * keep * scale`` in one pass."""
    dx = buffers.empty(dy.shape, dy.dtype)
    _masked_scale_kernel(
        _array(dy).reshape(-1), _array(keep).reshape(-1), scale, dx.numpy().reshape(-1), work=dy.numel()
    )
    return dx


# Layer norm -> ReLU -> dropout, one pass each way. Each row's random words are numbered
# from the row (``words_per_row`` per row), so the mask is the same for any block split.
# A row's mask is packed 8 bytes (each 0 or 1, little-endian in a uint64) at a time: the
# multiply moves byte t's low bit to bit 56 + t, the bytes' other terms miss the top byte.
_PACK_BYTES = np.uint64(0x0102040810204080)
# ... and unpacked by table: byte -> its 8 bits as 8 bytes of 0 or 1 (one uint64 each).
_UNPACK_BITS = np.array([sum(((b >> t) & 1) << (8 * t) for t in range(8)) for b in range(256)], np.uint64)


@njit(cache=True, fastmath=_FASTMATH)
def _norm_relu_dropout_rows(x, shift, weight, bias, eps, seed, first_word, threshold, scale, out, keep, mean, rstd):
    n, d = x.shape
    shifted = np.empty(d, dtype=x.dtype)  # the row plus ``shift``, read twice more from L1
    words_per_row = (d + 3) // 4
    # A row's random words, and the same bytes as 16-bit fields: field t of word w is field
    # 4 w + t (little-endian), element j's is field j. Without dropout (threshold 0)
    # the words stay 0 and nothing is drawn: every field is kept.
    words = np.zeros(words_per_row, np.uint64)
    fields = words.view(np.uint16)
    kept = np.zeros(8 * keep.shape[1], np.uint8)  # the row's mask, a byte per element, then packed
    kept_words = kept.view(np.uint64)
    threshold = np.int32(threshold)
    zero = x.dtype.type(0)
    # In x's type: ``total / d`` (an int) would be float64, and so every loop after it
    # (float32 rows converted, half as many lanes: 1.3x slower).
    inv_d = x.dtype.type(1) / x.dtype.type(d)
    # Loops over whole rows with no branch on the element, each of one element type: LLVM
    # vectorises them (the mask as a third condition in the output loop measured 1.3x slower).
    for i in range(n):
        row = x[i]
        total = zero
        for j in range(d):
            v = row[j] + shift[j]
            shifted[j] = v
            total += v
        mu = total * inv_d
        squares = zero
        for j in range(d):
            squares += (shifted[j] - mu) * (shifted[j] - mu)
        r = x.dtype.type(1) / np.sqrt(squares * inv_d + eps)
        mean[i], rstd[i] = mu, r
        if threshold:
            word = np.uint64(first_word + i * words_per_row)
            for w in range(words_per_row):
                words[w] = _splitmix64(seed, word + np.uint64(w))
        out_row = out[i]
        for j in range(d):
            y = (shifted[j] - mu) * r * weight[j] + bias[j]
            out_row[j] = max(y * scale if np.int32(fields[j]) >= threshold else zero, zero)
        for j in range(d):  # kept: drawn and positive, which is what a positive output is
            kept[j] = out_row[j] > zero
        keep_row = keep[i]
        for b in range(keep.shape[1]):
            keep_row[b] = np.uint8((kept_words[b] * _PACK_BYTES) >> np.uint64(56))


@_row_parallel(fastmath=_FASTMATH)
def _norm_relu_dropout_kernel(x, shift, weight, bias, eps, seed, threshold, scale, out, keep, mean, rstd, n_blocks):
    n, d = x.shape
    words_per_row = (d + 3) // 4
    eps, scale = x.dtype.type(eps), x.dtype.type(scale)
    for block in prange(n_blocks):
        start, stop = n * block // n_blocks, n * (block + 1) // n_blocks
        _norm_relu_dropout_rows(
            x[start:stop],
            shift,
            weight,
            bias,
            eps,
            seed,
            start * words_per_row,
            threshold,
            scale,
            out[start:stop],
            keep[start:stop],
            mean[start:stop],
            rstd[start:stop],
        )


# Rows whose parameter-gradient terms are summed in x's type before joining the float64 sums.
_PARAM_GRAD_ROWS = 64


@njit(cache=True, fastmath=_FASTMATH)
def _norm_relu_dropout_grad_rows(dout, x, shift, weight, mean, rstd, keep, scale, dx, dshift, dweight, dbias):
    n, d = x.shape
    dy = np.empty(d, dtype=x.dtype)
    xhat = np.empty(d, dtype=x.dtype)
    # dweight, dbias are float64 (sums over every row); adding each row's terms to them
    # directly converted every element to float64 (1.5x slower): a few rows are summed here first
    dweight_rows = np.zeros(d, dtype=x.dtype)
    dbias_rows = np.zeros(d, dtype=x.dtype)
    dshift_rows = np.zeros(d, dtype=x.dtype)
    mask = np.empty(8 * keep.shape[1], np.uint8)  # the row's mask, a byte (0 or 1) per element
    mask_words = mask.view(np.uint64)
    inv_d = x.dtype.type(1) / x.dtype.type(d)  # not ``/ d``: that is float64 (see the forward)
    for i in range(n):
        mu, r = mean[i], rstd[i]
        mean_dxhat = x.dtype.type(0)
        mean_dxhat_xhat = x.dtype.type(0)
        keep_row = keep[i]
        for b in range(keep.shape[1]):
            mask_words[b] = _UNPACK_BITS[keep_row[b]]
        for j in range(d):
            g = dout[i, j] * scale * mask[j]
            h = (x[i, j] + shift[j] - mu) * r
            dy[j], xhat[j] = g, h
            dweight_rows[j] += g * h
            dbias_rows[j] += g
            mean_dxhat += g * weight[j]
            mean_dxhat_xhat += g * weight[j] * h
        mean_dxhat *= inv_d
        mean_dxhat_xhat *= inv_d
        for j in range(d):
            v = r * (dy[j] * weight[j] - mean_dxhat - xhat[j] * mean_dxhat_xhat)
            dx[i, j] = v
            dshift_rows[j] += v
        if i % _PARAM_GRAD_ROWS == _PARAM_GRAD_ROWS - 1 or i == n - 1:
            for j in range(d):
                dweight[j] += dweight_rows[j]
                dbias[j] += dbias_rows[j]
                dshift[j] += dshift_rows[j]
                dweight_rows[j] = 0
                dbias_rows[j] = 0
                dshift_rows[j] = 0


@_row_parallel(fastmath=_FASTMATH)
def _norm_relu_dropout_grad_kernel(
    dout, x, shift, weight, mean, rstd, keep, scale, dx, dshift, dweight, dbias, n_blocks
):
    n, d = x.shape
    scale = x.dtype.type(scale)
    # Per-block partial sums of the parameter gradients (float64), added up at the end.
    dshift_blocks = np.zeros((n_blocks, d))
    dweight_blocks = np.zeros((n_blocks, d))
    dbias_blocks = np.zeros((n_blocks, d))
    for block in prange(n_blocks):
        start, stop = n * block // n_blocks, n * (block + 1) // n_blocks
        _norm_relu_dropout_grad_rows(
            dout[start:stop],
            x[start:stop],
            shift,
            weight,
            mean[start:stop],
            rstd[start:stop],
            keep[start:stop],
            scale,
            dx[start:stop],
            dshift_blocks[block],
            dweight_blocks[block],
            dbias_blocks[block],
        )
    for j in range(x.shape[1]):
        dshift[j] = dshift_blocks[:, j].sum()
        dweight[j] = dweight_blocks[:, j].sum()
        dbias[j] = dbias_blocks[:, j].sum()


def layer_norm_relu_dropout(
    x: Tensor, shift: Tensor, weight: Tensor, bias: Tensor, eps: float, threshold: int, scale: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(out, keep, mean, rstd)``: ``out = relu(layer_norm(x + shift)) * keep * scale`` with
    ``keep`` already zero where the ReLU is; the random bits as in :func:`dropout` (none
    drawn without dropout, ``threshold`` 0). ``shift`` [d] is added to every row (the bias
    of the layer before). ``keep`` holds one bit per element, uint8 [n, ceil(d / 8)] (bit
    ``j mod 8`` of byte ``j // 8``): backward keeps it, an eighth of a byte mask. ``mean``
    and ``rstd`` are those of ``x + shift``."""
    seed = int(torch.randint(0, 2**62, (1,))) if threshold else 0
    n, d = x.shape
    out, keep = buffers.empty(x.shape, x.dtype), buffers.empty((n, (d + 7) // 8), torch.uint8)  # every byte written
    mean, rstd = torch.empty(n, dtype=x.dtype), torch.empty(n, dtype=x.dtype)
    _norm_relu_dropout_kernel(
        _array(x),
        _array(shift.to(x.dtype)),
        _array(weight.to(x.dtype)),
        _array(bias.to(x.dtype)),
        float(eps),
        np.uint64(seed),
        np.uint64(threshold),
        float(scale),
        out.numpy(),
        keep.numpy(),
        mean.numpy(),
        rstd.numpy(),
        work=x.numel(),
    )
    return out, keep, mean, rstd


def layer_norm_relu_dropout_backward(
    dout: Tensor, x: Tensor, shift: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor, keep: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dshift, dweight, dbias)`` of :func:`layer_norm_relu_dropout` (``dshift`` is the
    column sum of ``dx``, summed in the same pass)."""
    dx = buffers.empty(x.shape, x.dtype)
    dshift, dweight, dbias = (torch.empty(x.shape[1], dtype=torch.float64) for _ in range(3))
    _norm_relu_dropout_grad_kernel(
        _array(dout),
        _array(x),
        _array(shift.to(x.dtype)),
        _array(weight.to(x.dtype)),
        _array(mean),
        _array(rstd),
        _array(keep),
        float(scale),
        dx.numpy(),
        dshift.numpy(),
        dweight.numpy(),
        dbias.numpy(),
        work=x.numel(),
    )
    return dx, dshift.to(shift.dtype), dweight.to(weight.dtype), dbias.to(weight.dtype)
