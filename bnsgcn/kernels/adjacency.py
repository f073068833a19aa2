"""Sparse adjacency in CSR together with its transpose, built once."""

from __future__ import annotations

import torch
from torch import Tensor

from .backend import kernel_backend

_INT32_MAX = 2**31 - 1


def _compact_index(index: Tensor, bound: int) -> Tensor:
    """Index tensor as int32 when every value < ``bound`` fits (halves the bytes kernels read)."""
    return index.to(torch.int32) if bound <= _INT32_MAX else index.to(torch.int64)


def csr_problem(indptr: Tensor, indices: Tensor, n_cols: int) -> str | None:
    """What makes ``indptr``/``indices`` not a CSR matrix with ``n_cols`` columns and
    ascending column ids in each row (one sentence), or None when they are one."""
    if indptr.dim() != 1 or indptr.numel() < 1 or indptr.is_floating_point():
        return "CSR indptr must be a 1-D integer tensor of length n_rows + 1"
    if indices.dim() != 1 or indices.is_floating_point():
        return "CSR indices must be a 1-D integer tensor"
    indptr = indptr.to(torch.int64)
    nnz = indices.numel()
    if int(indptr[0]) != 0 or int(indptr[-1]) != nnz or bool((indptr[1:] < indptr[:-1]).any()):
        return f"CSR indptr must start at 0, be non-decreasing and end at nnz={nnz}"
    if n_cols < 0 or (nnz and (int(indices.min()) < 0 or int(indices.max()) >= n_cols)):
        return f"CSR column ids must lie in [0, n_cols={n_cols})"
    if nnz > 1:
        row_start = torch.zeros(nnz, dtype=torch.bool, device=indices.device)
        row_start[indptr[:-1][indptr[:-1] < nnz]] = True
        if bool(((indices[1:] < indices[:-1]) & ~row_start[1:]).any()):
            return "CSR column ids must be ascending within each row"
    return None


def kept_entries(values: Tensor, keep: Tensor, count: int | None = None) -> Tensor:
    """``values[keep]`` for a bool ``keep`` of ``values``' length; with ``count`` (how many are
    kept, known on the host) without reading the device."""
    if count is None:
        return values[keep]
    from .torch_backend import _compact

    return _compact(values, keep, torch.cumsum(keep, 0) - 1, count)


# the constructor's arguments (n_rows follows from indptr), and those of them that are tensors
_FIELDS = (
    "indptr",
    "indices",
    "values",
    "t_indptr",
    "t_indices",
    "t_edge",
    "t_values",
    "n_cols",
    "row_scale",
    "col_scale",
)
_TENSOR_FIELDS = tuple(name for name in _FIELDS if name != "n_cols")


class Adjacency:
    r"""Sparse matrix :math:`A \in \mathbb{R}^{n_{rows} \times n_{cols}}` in CSR with its transpose.

    .. math:: A = \operatorname{diag}(r)\, P\, \operatorname{diag}(c)

    Forward CSR of the pattern :math:`P`: ``indptr`` int64 ``[n_rows + 1]``, ``indices``
    ``[nnz]`` (column ids, ascending within a row), ``values`` float ``[nnz]`` or ``None``
    (every stored entry is 1). ``row_scale`` :math:`r` float ``[n_rows]`` and ``col_scale``
    :math:`c` float ``[n_cols]``, each ``None`` for all ones, carry a normalisation by node
    degrees (``1/deg(v)``; ``deg^{-1/2}`` on both sides) in O(n) instead of a value per entry:
    the kernels apply them as they go (:func:`~bnsgcn.kernels.spmm`).

    Transposed CSR (built once by :meth:`from_csr`, never at run time): ``t_indptr`` int64
    ``[n_cols + 1]``, ``t_indices`` ``[nnz]`` (row ids, ascending within a column), ``t_edge``
    ``[nnz]`` (for each transposed entry the id of the same entry in forward order) and
    ``t_values = values[t_edge]`` (or ``None``).

    Index tensors are stored as int32 whenever the ids fit (int64 otherwise): kernels are
    memory-bound, and 4-byte indices cut the bytes they read.
    """

    __slots__ = (
        "indptr",
        "indices",
        "values",
        "t_indptr",
        "t_indices",
        "t_edge",
        "t_values",
        "n_rows",
        "n_cols",
        "row_scale",
        "col_scale",
    )

    def __init__(
        self,
        indptr: Tensor,
        indices: Tensor,
        values: Tensor | None,
        t_indptr: Tensor,
        t_indices: Tensor,
        t_edge: Tensor,
        t_values: Tensor | None,
        n_cols: int,
        row_scale: Tensor | None = None,
        col_scale: Tensor | None = None,
    ) -> None:
        """Wrap already consistent tensors; use :meth:`from_csr` to build from user data."""
        self.indptr = indptr
        self.indices = indices
        self.values = values
        self.t_indptr = t_indptr
        self.t_indices = t_indices
        self.t_edge = t_edge
        self.t_values = t_values
        self.n_rows = indptr.numel() - 1
        self.n_cols = n_cols
        self.row_scale = row_scale
        self.col_scale = col_scale

    @classmethod
    def from_csr(
        cls,
        indptr: Tensor,
        indices: Tensor,
        n_cols: int,
        values: Tensor | None = None,
        row_scale: Tensor | None = None,
        col_scale: Tensor | None = None,
    ) -> Adjacency:
        """Validate a CSR matrix and build its transpose (O(nnz log nnz), once)."""
        indptr = torch.as_tensor(indptr)
        indices = torch.as_tensor(indices)
        # The engine builds these from partition files that load_shard checked with
        # csr_problem: a problem here is a bug, reported with its traceback.
        problem = csr_problem(indptr, indices, n_cols)
        if problem is not None:
            raise ValueError(problem)
        indptr = indptr.to(torch.int64)
        nnz = indices.numel()
        if values is not None:
            values = torch.as_tensor(values)
            if values.shape != (nnz,) or not values.is_floating_point():
                raise ValueError(
                    f"CSR values must be a float tensor of shape [nnz={nnz}] or None; fix the values array"
                )
        for name, scale, size in (("row_scale", row_scale, indptr.numel() - 1), ("col_scale", col_scale, n_cols)):
            if scale is not None and (scale.shape != (size,) or not scale.is_floating_point()):
                raise ValueError(f"{name} must be a float tensor of shape [{size}] or None; fix the scale vector")

        indices = _compact_index(indices, max(n_cols, indptr.numel()))
        # Stable sort keeps the row-major order inside each column: rows stay ascending there.
        t_edge = torch.sort(indices, stable=True).indices
        rows = torch.repeat_interleave(torch.arange(indptr.numel() - 1, device=indptr.device), indptr.diff())
        t_indptr = torch.zeros(n_cols + 1, dtype=torch.int64, device=indptr.device)
        torch.cumsum(torch.bincount(indices, minlength=n_cols), 0, out=t_indptr[1:])
        t_edge = _compact_index(t_edge, nnz)
        t_indices = rows[t_edge].to(indices.dtype)
        t_values = None if values is None else values[t_edge]
        return cls(indptr, indices, values, t_indptr, t_indices, t_edge, t_values, n_cols, row_scale, col_scale)

    @property
    def nnz(self) -> int:
        return self.indices.numel()

    def tensors(self) -> tuple[Tensor | None, ...]:
        """Every tensor this matrix holds (for memory accounting; ``None`` where absent)."""
        return tuple(getattr(self, name) for name in _TENSOR_FIELDS)

    def _replace(self, **changed) -> Adjacency:
        """This matrix with the constructor arguments ``changed``, the others shared."""
        return Adjacency(**({name: getattr(self, name) for name in _FIELDS} | changed))

    @property
    def device(self) -> torch.device:
        return self.indptr.device

    def with_values(self, values: Tensor | None) -> Adjacency:
        """Same sparsity structure (the transpose is shared, not rebuilt), new ``values [nnz]``."""
        if values is not None and (values.shape != (self.nnz,) or not values.is_floating_point()):
            raise ValueError(f"values must be a float tensor of shape [nnz={self.nnz}] or None; fix the values")
        return self._replace(values=values, t_values=None if values is None else values[self.t_edge])

    def scale_columns(self, factor: float) -> Adjacency:
        """``A diag(factor)``: the same matrix with every column scaled (O(n_cols), nothing per entry)."""
        col_scale = (
            torch.full((self.n_cols,), factor, device=self.device)
            if self.col_scale is None
            else self.col_scale * factor
        )
        return self.with_scales(self.row_scale, col_scale)

    def select_columns(self, keep: Tensor, sizes: tuple[int, int] | None = None) -> Adjacency:
        """Keep the columns where ``keep [n_cols]`` (bool) is true, renumbered ``0..k-1`` in order.

        Both CSRs are filtered in O(nnz) (by the kernel backend of A's device); nothing is
        re-sorted: kept entries keep their relative order, so forward rows and transposed
        columns stay sorted. ``sizes`` (kept columns, kept entries), when the caller knows
        them on the host, spares a GPU the synchronisation of reading them from the device.
        """
        if keep.shape != (self.n_cols,) or keep.dtype != torch.bool:
            raise ValueError(f"keep must be a bool tensor of shape [n_cols={self.n_cols}]; build it as a column mask")
        keep = keep.to(self.device, non_blocking=True)
        kept = kernel_backend(self.device).select_columns(self, keep, sizes)
        kept.row_scale = self.row_scale
        if self.col_scale is not None:  # the kept columns' scales, in order (sizes known: no device read)
            kept.col_scale = kept_entries(self.col_scale, keep, None if sizes is None else sizes[0])
        return kept

    def with_scales(self, row_scale: Tensor | None, col_scale: Tensor | None) -> Adjacency:
        """The same pattern and values (shared, not copied) under other scale vectors
        ``row_scale`` [n_rows] and ``col_scale`` [n_cols] (None: all ones): another
        normalisation of the same matrix, O(1)."""
        return self._replace(row_scale=row_scale, col_scale=col_scale)

    def to(self, device: torch.device | str) -> Adjacency:
        """Copy of every tensor on ``device``."""
        return self._replace(
            **{name: None if t is None else t.to(device) for name, t in zip(_TENSOR_FIELDS, self.tensors())}
        )

    def __repr__(self) -> str:
        weighted = "weighted" if self.values is not None else "unweighted"
        weighted += "".join(
            f", {side} scaled" for side, s in (("row", self.row_scale), ("column", self.col_scale)) if s is not None
        )
        return f"Adjacency({self.n_rows} x {self.n_cols}, nnz={self.nnz}, {weighted}, {self.device})"
