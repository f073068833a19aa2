"""Pure-torch kernels: cuSPARSE/MKL through ``torch.sparse`` plus segment reductions.

Used on CUDA and as the CPU fallback (``BNSGCN_KERNELS=torch``). Every temporary is
O(nnz * H) or O(n * d); nothing is O(nnz * d).
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from . import buffers
from .adjacency import Adjacency

_INT32_MAX = 2**31 - 1


def _csr_tensor(indptr: Tensor, indices: Tensor, values: Tensor, shape: tuple[int, int]) -> Tensor:
    """Wrap CSR arrays as a torch sparse CSR tensor without copying the big arrays."""
    # torch requires crow and col indices of one dtype: int32 when nnz fits, else int64.
    index_dtype = torch.int32 if indices.dtype == torch.int32 and indices.numel() <= _INT32_MAX else torch.int64
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        # the arrays come from Adjacency, valid by construction; torch 2.11 warns they go unchecked
        warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
        return torch.sparse_csr_tensor(
            indptr.to(index_dtype), indices.to(index_dtype), values, size=shape, check_invariants=False
        )


def _values_or_ones(values: Tensor | None, nnz: int, like: Tensor) -> Tensor:
    if values is None:
        return torch.ones(nnz, dtype=like.dtype, device=like.device)
    return values.to(like.dtype)


def _gather(values: Tensor, index: Tensor) -> Tensor:
    """``values[index]`` along the first dimension, for an int32 or int64 ``index``.

    ``torch.index_select``, not ``values[index]``: advanced indexing first copies an int32
    index to int64, a pass over the whole index (12 bytes per entry) before the gather.
    """
    return torch.index_select(values, 0, index)


def _entry_rows(indptr: Tensor, nnz: int) -> Tensor:
    """``[nnz]``: the row id of each stored entry of a CSR matrix, int32 when the ids fit."""
    n_rows = indptr.numel() - 1
    dtype = torch.int32 if n_rows <= _INT32_MAX else torch.int64
    # output_size: the length (nnz) is known on the host, so CUDA need not read it back
    return torch.repeat_interleave(
        torch.arange(n_rows, dtype=dtype, device=indptr.device), indptr.diff(), output_size=nnz
    )


def _compact(x: Tensor, keep: Tensor, slot: Tensor, size: int) -> Tensor:
    """``x[keep]`` of known length ``size`` without a device synchronisation: each kept entry
    goes to its ``slot`` (its rank among the kept), the others to one spare slot dropped after."""
    out = x.new_empty((size + 1, *x.shape[1:]))
    out.index_copy_(0, torch.where(keep, slot, size), x)
    return out[:size]


def select_columns(adj: Adjacency, keep: Tensor, sizes: tuple[int, int] | None = None) -> Adjacency:
    """:meth:`Adjacency.select_columns` with vectorised torch ops. ``sizes``: (kept columns,
    kept entries) when the caller knows them (from the host); then nothing here waits for
    the device (boolean-mask indexing would: its length is data)."""
    new_column = torch.cumsum(keep, 0) - 1
    edge_kept = _gather(keep, adj.indices)
    # kept_before[e] = number of kept entries before forward entry e = its new entry id.
    kept_before = torch.zeros(adj.nnz + 1, dtype=torch.int64, device=adj.device)
    torch.cumsum(edge_kept, 0, out=kept_before[1:])
    if sizes is None:
        sizes = (int(keep.sum()), int(kept_before[-1]))
    n_cols, nnz = sizes
    indptr = kept_before[adj.indptr]
    slot = kept_before[:-1]
    # Renumbered ids are no larger than the old ones: the index dtypes carry over.
    indices = _compact(_gather(new_column, adj.indices).to(adj.indices.dtype), edge_kept, slot, nnz)
    values = None if adj.values is None else _compact(adj.values, edge_kept, slot, nnz)

    # Transposed rows are whole columns: each segment is kept or dropped.
    t_kept = _gather(edge_kept, adj.t_edge)
    t_slot = torch.cumsum(t_kept, 0) - 1
    column_nnz = _compact(adj.t_indptr.diff(), keep, new_column, n_cols)
    t_indptr = torch.zeros(n_cols + 1, dtype=torch.int64, device=adj.device)
    torch.cumsum(column_nnz, 0, out=t_indptr[1:])
    t_indices = _compact(adj.t_indices, t_kept, t_slot, nnz)
    t_edge = _compact(_gather(kept_before, adj.t_edge).to(adj.t_edge.dtype), t_kept, t_slot, nnz)
    t_values = None if adj.t_values is None else _compact(adj.t_values, t_kept, t_slot, nnz)
    return Adjacency(indptr, indices, values, t_indptr, t_indices, t_edge, t_values, n_cols)


def _scaled_values(
    values: Tensor | None,
    indptr: Tensor,
    indices: Tensor,
    row_scale: Tensor | None,
    col_scale: Tensor | None,
    like: Tensor,
) -> Tensor:
    """Per entry ``r_v * values[e] * c_u`` [nnz] (a temporary: cuSPARSE takes values per entry)."""
    values = _values_or_ones(values, indices.numel(), like)
    if row_scale is not None:
        values = values * _gather(row_scale.to(like.dtype), _entry_rows(indptr, indices.numel()))
    if col_scale is not None:
        values = values * _gather(col_scale.to(like.dtype), indices)
    return values


def spmm(adj: Adjacency, x: Tensor) -> Tensor:
    """``A x``: ``x [n_cols, d] -> [n_rows, d]``."""
    values = _scaled_values(adj.values, adj.indptr, adj.indices, adj.row_scale, adj.col_scale, x)
    a = _csr_tensor(adj.indptr, adj.indices, values, (adj.n_rows, adj.n_cols))
    return torch.sparse.mm(a, x)


def spmm_add_(base: Tensor, adj: Adjacency, x: Tensor) -> Tensor:
    """``base += A x`` in place; returns ``base``."""
    return base.add_(spmm(adj, x))


def spmm_transposed(adj: Adjacency, y: Tensor) -> Tensor:
    """``A^T y`` through the prebuilt transposed CSR: ``y [n_rows, d] -> [n_cols, d]``."""
    values = _scaled_values(adj.t_values, adj.t_indptr, adj.t_indices, adj.col_scale, adj.row_scale, y)
    a_t = _csr_tensor(adj.t_indptr, adj.t_indices, values, (adj.n_cols, adj.n_rows))
    return torch.sparse.mm(a_t, y)


def _row_reduce(values: Tensor, reduce: str, offsets: Tensor) -> Tensor:
    """Per-row ``reduce`` ("sum" or "max") of one head's entry values: ``[nnz]`` -> ``[n_rows]``.

    Through a ``[nnz, 1]`` view. Why: torch reduces a 1-D tensor with cub's segmented
    reduction, a thread block per row, which on short rows costs several times torch's own
    segment kernel that a 2-D tensor takes (4 heads, sum: 0.87 against 0.12 ms on the
    200k-node reference graph, degree 26, H200; the GAT epoch there 0.041 against 0.029 s).
    """
    return torch.segment_reduce(values.unsqueeze(1), reduce, offsets=offsets).squeeze(1)


def gat_forward(
    adj: Adjacency, x: Tensor, score_src: Tensor, score_dst: Tensor, col_weight: Tensor | None, negative_slope: float
) -> tuple[Tensor, Tensor]:
    """Attention aggregation; returns ``(Y [n_rows, H, D], alpha [nnz, H])``.

    A head at a time, each head's per-entry values one contiguous ``[nnz]`` vector (``alpha``
    is stored head-major, ``[H, nnz]``, and returned as its transposed view). Why: gathering
    all heads' values at once (``values[index]`` of ``[n, H]``) takes torch's row gather, one
    thread block per index (69 ms per 114M entries on an H100; a head at a time, 7 ms on an
    H200), and a head's column of an ``[nnz, H]`` tensor is a strided copy each time it is
    taken or written (93 of them per layer, 41 of 136 ms on the H200). Temporaries: a few
    ``[nnz]`` vectors.
    """
    rows, cols = _entry_rows(adj.indptr, adj.nnz), adj.indices
    src, dst = score_src.t().contiguous(), score_dst.t().contiguous()  # [H, n_cols], [H, n_rows]
    heads = src.shape[0]
    weight = None if col_weight is None else _gather(col_weight.to(src.dtype), cols)
    tiny = torch.finfo(src.dtype).tiny
    alpha = src.new_empty(heads, adj.nnz)
    y = x.new_empty(adj.n_rows, heads, x.shape[2])
    for h in range(heads):
        e = torch.nn.functional.leaky_relu(_gather(src[h], cols) + _gather(dst[h], rows), negative_slope)
        row_max = _row_reduce(e, "max", adj.indptr)
        p = torch.exp(e - _gather(row_max, rows))
        if weight is not None:
            p *= weight
        # A row whose weights are all 0 gets alpha = 0 instead of 0/0.
        denominator = _row_reduce(p, "sum", adj.indptr).clamp_min(tiny)
        torch.div(p, _gather(denominator, rows), out=alpha[h])
        w_h = _csr_tensor(adj.indptr, adj.indices, alpha[h], (adj.n_rows, adj.n_cols))
        y[:, h] = torch.sparse.mm(w_h, x[:, h].contiguous())
    return y, alpha.t()


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
    """Gradients ``(dx or None, d score_src, d score_dst)`` of :func:`gat_forward`, a head
    at a time (``alpha``: the head-major view :func:`gat_forward` returned)."""
    rows, cols = _entry_rows(adj.indptr, adj.nnz), adj.indices
    alpha = alpha.t().contiguous()  # [H, nnz]: no copy for gat_forward's own result
    src, dst = score_src.t().contiguous(), score_dst.t().contiguous()
    heads = alpha.shape[0]
    d_src, d_dst = score_src.new_empty(heads, adj.n_cols), score_dst.new_empty(heads, adj.n_rows)
    dx = x.new_empty(adj.n_cols, heads, x.shape[2]) if need_dx else None
    pattern = _csr_tensor(adj.indptr, adj.indices, x.new_zeros(adj.nnz), (adj.n_rows, adj.n_cols))
    for h in range(heads):
        a = alpha[h]
        # SDDMM: g[e] = <dy[v, h], x[u, h]> for every stored entry e = (v, u)
        g = torch.sparse.sampled_addmm(pattern, dy[:, h], x[:, h].transpose(0, 1), beta=0.0).values()
        # Softmax backward per row: de = alpha * (g - sum_u alpha g).
        row_dot = _row_reduce(a * g, "sum", adj.indptr)
        de = a * (g - _gather(row_dot, rows))
        ds = torch.where(_gather(src[h], cols) + _gather(dst[h], rows) > 0, de, de * negative_slope)
        d_dst[h] = _row_reduce(ds, "sum", adj.indptr)
        d_src[h] = _row_reduce(_gather(ds, adj.t_edge), "sum", adj.t_indptr)
        if need_dx:
            w_t = _csr_tensor(adj.t_indptr, adj.t_indices, _gather(a, adj.t_edge), (adj.n_cols, adj.n_rows))
            dx[:, h] = torch.sparse.mm(w_t, dy[:, h].contiguous())
    return dx, d_src.t().contiguous(), d_dst.t().contiguous()


def scatter_rows(index: Tensor, rows: Tensor, n: int, into: Tensor | None = None) -> Tensor:
    """``out`` [n, *row]: zero (or ``into``, in place), plus ``rows[i]`` added at row
    ``index[i]`` (see the numba backend's)."""
    out = buffers.empty((n, *rows.shape[1:]), rows.dtype, rows.device).zero_() if into is None else into
    return out.index_add_(0, index, rows)


def cross_entropy_rows(logits: Tensor, rows: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """``(probabilities, losses)`` of the rows ``rows`` of ``logits`` (see the numba backend's)."""
    log_probabilities = torch.log_softmax(logits.index_select(0, rows), 1)
    return log_probabilities.exp(), -log_probabilities.gather(1, labels[:, None]).squeeze(1)


def cross_entropy_rows_backward(probabilities: Tensor, rows: Tensor, labels: Tensor, n: int, scale: Tensor) -> Tensor:
    """The gradient of ``scale * sum(losses)`` w.r.t. the logits (see the numba backend's);
    ``scale`` a scalar tensor (read on the device, not the host)."""
    grad = probabilities * scale
    grad[torch.arange(rows.shape[0], device=rows.device), labels] -= scale
    return scatter_rows(rows, grad, n)


def _pack_bits(mask: Tensor) -> Tensor:
    """bool [m, d] -> uint8 [m, ceil(d / 8)], bit j % 8 of byte j // 8 = ``mask[:, j]``."""
    padded = torch.nn.functional.pad(mask.to(torch.uint8), (0, -mask.shape[1] % 8))
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    return (padded.view(mask.shape[0], padded.shape[1] // 8, 8) << shifts).sum(-1, dtype=torch.uint8)


def _unpack_bits(bits: Tensor, d: int) -> Tensor:
    """uint8 [m, ceil(d / 8)] -> bool [m, d] (see :func:`_pack_bits`)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return ((bits.unsqueeze(-1) >> shifts) & 1).view(bits.shape[0], bits.shape[1] * 8)[:, :d].bool()


def _copy_nonzero(rows: Tensor, mask: Tensor, values: Tensor) -> None:
    """``rows[mask]`` into the front of ``values``, without reading the count on the host:
    each entry goes to its rank among the set entries, a clear one to ``values``' last slot
    (a spare, or past the set entries: at least one is clear)."""
    flat = mask.reshape(-1)
    position = torch.cumsum(flat, 0).sub_(1)
    values.index_copy_(0, torch.where(flat, position, values.numel() - 1), rows.reshape(-1))


def pack_nonzero_rows(x: Tensor, index: Tensor, bits: Tensor, values: Tensor) -> Tensor:
    """Rows ``x[index]`` as a bitmap and their nonzero entries (see the numba backend's)."""
    rows = x.index_select(0, index)
    mask = rows != 0
    bits.copy_(_pack_bits(mask))
    offsets = torch.zeros(index.numel() + 1, dtype=torch.int64, device=x.device)
    torch.cumsum(mask.sum(1), 0, out=offsets[1:])
    if rows.numel():
        _copy_nonzero(rows, mask, values[: rows.numel()])
    return offsets


def unpack_nonzero_rows(bits: Tensor, values: Tensor, out: Tensor) -> Tensor:
    """The rows :func:`pack_nonzero_rows` packed, written whole into ``out`` [m, d]."""
    return out.zero_().masked_scatter_(_unpack_bits(bits, out.shape[1]), values)  # a spare slot, unread


def gather_nonzero(rows: Tensor, bits: Tensor, values: Tensor) -> Tensor:
    """The entries of ``rows`` where ``bits`` are set, into ``values[:-1]`` (see the numba backend's)."""
    _copy_nonzero(rows, _unpack_bits(bits, rows.shape[1]), values)
    return values[:-1]


def scatter_nonzero_rows(
    index: Tensor, bits: Tensor, values: Tensor, shape: tuple[int, int], into: Tensor | None = None
) -> Tensor:
    """:func:`scatter_rows` of packed rows (see the numba backend's)."""
    rows = torch.zeros((bits.shape[0], shape[1]), dtype=values.dtype, device=values.device)
    return scatter_rows(index, rows.masked_scatter_(_unpack_bits(bits, shape[1]), values), shape[0], into)


def quantize_codes(
    x: Tensor, lo: Tensor, inv_step: Tensor, levels: int, generator: torch.Generator | None = None
) -> Tensor:
    """uint8 codes ``floor((x - lo) * inv_step + u)`` clamped to ``[0, levels]``, ``u``
    uniform in [0, 1) from torch's generator."""
    scaled = (x - lo[:, None]).mul_(inv_step[:, None])
    scaled += torch.rand(x.shape, generator=generator, device=x.device)
    return scaled.floor_().clamp_(0, levels).to(torch.uint8)


def dropout(
    x: Tensor, threshold: int, scale: float, seed: int | None = None, with_mask: bool = True
) -> tuple[Tensor, Tensor | None]:
    """``(x * keep * scale, keep)`` with ``keep`` = 16 random bits >= ``threshold``, the bits
    drawn as 64-bit words from torch's generator, or from a generator seeded with ``seed``
    (the same mask for the same seed and shape); ``keep`` None without ``with_mask``."""
    n = x.numel()
    generator = None if seed is None else torch.Generator(device=x.device).manual_seed(seed)
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=x.device).random_(-(2**63), None, generator=generator)
    bits = words.view(torch.int16)[:n].view(x.shape)  # uniform over [-2^15, 2^15)
    keep = bits >= threshold - 2**15
    return (x * keep).mul_(scale), keep if with_mask else None


def masked_scale(dy: Tensor, keep: Tensor, scale: float) -> Tensor:
    return (dy * keep).mul_(scale)


def layer_norm_relu_dropout(
    x: Tensor, shift: Tensor, weight: Tensor, bias: Tensor, eps: float, threshold: int, scale: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    x = x + shift
    var, mean = torch.var_mean(x, dim=1, unbiased=False)
    rstd = torch.rsqrt(var + eps)
    y = torch.addcmul(bias, (x - mean[:, None]) * rstd[:, None], weight)
    keep = y > 0
    if threshold:  # without dropout no random bits are drawn
        keep &= dropout(y, threshold, scale)[1]
    return (y * keep).mul_(scale), keep, mean, rstd


def layer_norm_relu_dropout_backward(
    dout: Tensor, x: Tensor, shift: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor, keep: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dy = masked_scale(dout, keep, scale)
    xhat = (x + shift - mean[:, None]) * rstd[:, None]
    dxhat = dy * weight
    dx = (dxhat - dxhat.mean(1, keepdim=True) - xhat * (dxhat * xhat).mean(1, keepdim=True)) * rstd[:, None]
    return dx, dx.sum(0), (dy * xhat).sum(0), dy.sum(0)
