"""Aggregation kernels against dense torch references, on both backends."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from bnsgcn.errors import UserError
from bnsgcn.kernels import (
    ENV_VAR,
    Adjacency,
    buffers,
    cross_entropy_rows,
    dropout,
    gat_aggregate,
    kernel_backend,
    layer_norm_relu_dropout,
    numba_backend,
    spmm,
    spmm_add_,
)

# numba's kernels run on one thread for one-thread ranks or small inputs, on several otherwise: both.
BACKENDS = ("numba-one-thread", "numba-parallel", "torch")


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    name = request.param
    monkeypatch.setenv(ENV_VAR, name.split("-")[0])
    if name == "numba-one-thread":
        monkeypatch.setattr(numba_backend, "_ONE_THREAD_WORK", float("inf"))
    elif name == "numba-parallel":
        monkeypatch.setattr(numba_backend, "_ONE_THREAD_WORK", 0)
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        request.addfinalizer(lambda: torch.set_num_threads(threads))
    return name


def random_pattern(n_rows: int, n_cols: int, density: float, seed: int) -> torch.Tensor:
    """Bool ``[n_rows, n_cols]`` with an empty row, an empty column and a self-loop-only row."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(n_rows, n_cols, generator=g) < density
    mask[1] = False  # empty row
    mask[:, n_cols - 1] = False  # isolated column
    mask[2] = False
    mask[2, 2] = True  # self-loop-only row
    mask[0, 0] = True  # at least one entry
    return mask


def csr_of(dense: torch.Tensor, weighted: bool) -> Adjacency:
    mask = dense != 0
    rows, cols = mask.nonzero(as_tuple=True)
    indptr = torch.zeros(dense.shape[0] + 1, dtype=torch.int64)
    indptr[1:] = mask.sum(1).cumsum(0)
    return Adjacency.from_csr(indptr, cols, dense.shape[1], dense[rows, cols] if weighted else None)


def make_case(n_rows: int, n_cols: int, weighted: bool, dtype: torch.dtype, seed: int = 0):
    """``(dense A, Adjacency)``; weighted entries in [0.5, 1.5), unweighted entries 1."""
    mask = random_pattern(n_rows, n_cols, 0.3, seed)
    g = torch.Generator().manual_seed(seed + 1)
    weights = (
        torch.rand(n_rows, n_cols, generator=g, dtype=dtype) + 0.5
        if weighted
        else torch.ones(n_rows, n_cols, dtype=dtype)
    )
    dense = torch.where(mask, weights, torch.zeros((), dtype=dtype))
    return dense, csr_of(dense, weighted)


def dense_of(adj: Adjacency) -> torch.Tensor:
    """Forward CSR to dense (entries 1 where values is None)."""
    dense = torch.zeros(adj.n_rows, adj.n_cols, dtype=torch.float64)
    rows = torch.repeat_interleave(torch.arange(adj.n_rows), adj.indptr.diff())
    values = torch.ones(adj.nnz) if adj.values is None else adj.values
    dense[rows, adj.indices.long()] = values.double()
    return dense


def dense_of_transpose(adj: Adjacency) -> torch.Tensor:
    """Transposed CSR to dense ``[n_cols, n_rows]``, checking t_edge points at the same entries."""
    cols = torch.repeat_interleave(torch.arange(adj.n_cols), adj.t_indptr.diff())
    forward_rows = torch.repeat_interleave(torch.arange(adj.n_rows), adj.indptr.diff())
    assert torch.equal(adj.indices[adj.t_edge.long()].long(), cols)
    assert torch.equal(forward_rows[adj.t_edge.long()], adj.t_indices.long())
    dense = torch.zeros(adj.n_cols, adj.n_rows, dtype=torch.float64)
    values = torch.ones(adj.nnz) if adj.t_values is None else adj.t_values
    dense[cols, adj.t_indices.long()] = values.double()
    return dense


def gat_reference(mask, x, score_src, score_dst, col_weight, slope):
    """Dense GAT: softmax over each row's entries, weights w_u inside the softmax."""
    e = torch.nn.functional.leaky_relu(score_dst[:, None, :] + score_src[None, :, :], slope)  # [v, u, H]
    e = e.masked_fill(~mask[:, :, None], float("-inf"))
    row_max = e.amax(1, keepdim=True).clamp_min(-1e30)  # empty rows: no -inf - -inf
    p = torch.exp(e - row_max)
    if col_weight is not None:
        p = p * col_weight[None, :, None]
    alpha = p / p.sum(1, keepdim=True).clamp_min(1e-300)
    return torch.einsum("vuh,uhd->vhd", alpha, x)


# --- spmm -----------------------------------------------------------------------------------


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("shape", [(40, 40), (30, 70)])
def test_spmm_matches_dense_float32(backend, weighted, shape):
    dense, adj = make_case(*shape, weighted, torch.float32)
    x = torch.randn(shape[1], 19, requires_grad=True)
    y = spmm(adj, x)
    x_ref = x.detach().clone().requires_grad_()
    y_ref = dense @ x_ref
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    assert torch.all(y[1] == 0)  # empty row
    assert torch.all(x.grad[-1] == 0)  # isolated column


@pytest.mark.parametrize("weighted", [True, False])
def test_spmm_gradcheck_float64(backend, weighted):
    _, adj = make_case(9, 13, weighted, torch.float64)
    x = torch.randn(13, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: spmm(adj, x), (x,))


@pytest.mark.parametrize("weighted", [True, False])
def test_spmm_add_matches_dense_in_place(backend, weighted):
    """Inner + boundary columns as the layers aggregate them: ``spmm(A_in, x)`` then
    ``spmm_add_`` of ``A_b``'s product into it; values and both inputs' gradients."""
    dense_in, inner = make_case(40, 40, weighted, torch.float64, seed=3)
    dense_b, boundary = make_case(40, 25, weighted, torch.float64, seed=4)
    x = torch.randn(40, 6, dtype=torch.float64, requires_grad=True)
    rows = torch.randn(25, 6, dtype=torch.float64, requires_grad=True)
    base = spmm(inner, x)
    storage = base.data_ptr()
    y = spmm_add_(base, boundary, rows)
    assert y.data_ptr() == storage  # no temporary for the sum
    torch.testing.assert_close(y, dense_in @ x.detach() + dense_b @ rows.detach())
    dy = torch.randn_like(y)
    dx, drows = torch.autograd.grad(y, (x, rows), dy)
    torch.testing.assert_close(dx, dense_in.T @ dy)
    torch.testing.assert_close(drows, dense_b.T @ dy)
    with torch.no_grad():
        plain = spmm_add_(spmm(inner, x), boundary, rows)
    torch.testing.assert_close(plain, y.detach())
    # gradcheck differentiates numerically input by input: on a case of the same kind (empty
    # row, isolated column, self-loop-only row) with 48 inputs rather than the 390 above
    _, small_inner = make_case(9, 9, weighted, torch.float64, seed=5)
    _, small_boundary = make_case(9, 7, weighted, torch.float64, seed=6)
    x, rows = (torch.randn(n, 3, dtype=torch.float64, requires_grad=True) for n in (9, 7))
    assert torch.autograd.gradcheck(lambda x, rows: spmm_add_(spmm(small_inner, x), small_boundary, rows), (x, rows))


@pytest.mark.parametrize("width", [*numba_backend._CONSTANT_WIDTHS, 17])
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_spmm_at_the_widths_compiled_as_constants(backend, width, weighted, dtype):
    """Widths the numba product is compiled for as constants, and one it is not: the
    product, its transpose (the gradient) and the in-place add, with both degree scales,
    against the dense product."""
    dense, pattern = make_case(30, 45, weighted, dtype, seed=7)
    g = torch.Generator().manual_seed(8)
    r, c = torch.rand(30, generator=g, dtype=dtype) + 0.5, torch.rand(45, generator=g, dtype=dtype) + 0.5
    scaled = r[:, None] * dense * c[None, :]
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    for adj, matrix in (
        (pattern, dense),
        (Adjacency.from_csr(pattern.indptr, pattern.indices, 45, pattern.values, row_scale=r, col_scale=c), scaled),
    ):
        x = torch.randn(45, width, generator=g, dtype=dtype, requires_grad=True)
        y = spmm(adj, x)
        torch.testing.assert_close(y, matrix @ x.detach(), **tolerance)
        dy = torch.randn(30, width, generator=g, dtype=dtype)
        torch.testing.assert_close(torch.autograd.grad(y, x, dy)[0], matrix.T @ dy, **tolerance)
        base = torch.randn(30, width, generator=g, dtype=dtype)
        torch.testing.assert_close(spmm_add_(base.clone(), adj, x.detach()), base + matrix @ x.detach(), **tolerance)


@pytest.mark.parametrize("width", [16, 128])
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.startswith("numba")], indirect=True)
def test_spmm_add_leaves_rows_without_entries_as_they_were(backend, width):
    """The numba product skips rows of ``A`` with no entry (most of the boundary product's
    at p < 1): they keep their bits, -0.0 included (adding 0 would make it +0.0); the other
    rows get their sum. (The torch backend adds the whole product.)"""
    dense, adj = make_case(30, 20, True, torch.float32, seed=11)
    empty = (dense != 0).sum(1) == 0
    assert empty.sum() >= 1
    base = torch.randn(30, width)
    base[empty] = -0.0
    x = torch.randn(20, width)
    out = spmm_add_(base.clone(), adj, x)
    assert torch.equal(out[empty].view(torch.int32), base[empty].view(torch.int32))
    torch.testing.assert_close(out[~empty], (base + dense @ x)[~empty])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cross_entropy_rows_matches_torch_on_the_selected_rows(backend, dtype):
    """The summed loss of some rows (one of them twice) and its gradient, zero in the rows
    not selected, against ``F.cross_entropy`` of the selected rows; large logits too (the
    log-sum-exp subtracts each row's largest)."""
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(30, 7, generator=g, dtype=dtype) * 3).requires_grad_(True)
    with torch.no_grad():
        logits[5] += 400.0
    rows = torch.tensor([0, 5, 3, 29, 3, 11])
    labels = torch.tensor([6, 0, 2, 2, 4, 1])
    tolerance = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {}
    loss = cross_entropy_rows(logits, rows, labels)
    expected = F.cross_entropy(logits.index_select(0, rows), labels, reduction="sum")
    torch.testing.assert_close(loss, expected, **tolerance)
    (grad,) = torch.autograd.grad(loss * 0.5, logits)
    (expected_grad,) = torch.autograd.grad(expected * 0.5, logits)
    torch.testing.assert_close(grad, expected_grad, **tolerance)
    unselected = torch.ones(30, dtype=torch.bool)
    unselected[rows] = False
    assert torch.equal(grad[unselected], torch.zeros_like(grad[unselected]))
    if dtype == torch.float64:
        assert torch.autograd.gradcheck(
            lambda z: cross_entropy_rows(z, rows, labels), (logits.detach().clone().requires_grad_(True),)
        )


def test_spmm_add_rejects_a_base_of_the_wrong_shape():
    _, adj = make_case(10, 8, True, torch.float32)
    with pytest.raises(ValueError, match="base of shape"):
        spmm_add_(torch.zeros(9, 3), adj, torch.randn(8, 3))


def test_spmm_without_grad_builds_no_backward(backend):
    _, adj = make_case(12, 12, True, torch.float32)
    y = spmm(adj, torch.randn(12, 3))
    assert y.grad_fn is None and not y.requires_grad


def test_spmm_casts_constant_values_to_feature_dtype(backend):
    dense, adj = make_case(10, 10, True, torch.float32)
    x = torch.randn(10, 3, dtype=torch.float64)
    torch.testing.assert_close(spmm(adj, x), dense.double() @ x)


def test_results_do_not_depend_on_thread_count(backend):
    _, adj = make_case(300, 200, True, torch.float32)
    x = torch.randn(200, 2, 8, requires_grad=True)
    s_src = torch.randn(200, 2, requires_grad=True)
    s_dst = torch.randn(300, 2, requires_grad=True)
    previous = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            y = spmm(adj, x.flatten(1))
            z = gat_aggregate(adj, x, s_src, s_dst)
            grads = torch.autograd.grad((y.square().sum() + z.square().sum()), (x, s_src, s_dst))
            results.append((y, z, *grads))
    finally:
        torch.set_num_threads(previous)
    for a, b in zip(*results):  # every output row has one writer, in a fixed order: bitwise equal
        assert torch.equal(a, b)


def test_numba_spmm_kernel_accepts_int64_indices():
    from bnsgcn.kernels import numba_backend

    dense, adj = make_case(20, 25, True, torch.float32)
    x = torch.randn(25, 6)
    y = numba_backend._spmm_csr(adj.indptr, adj.indices.long(), adj.values, None, None, x, adj.n_rows)
    torch.testing.assert_close(y, dense @ x)


# --- Adjacency ------------------------------------------------------------------------------


@pytest.mark.parametrize("weighted", [True, False])
def test_transpose_matches_dense_transpose(weighted):
    dense, adj = make_case(25, 40, weighted, torch.float64)
    torch.testing.assert_close(dense_of_transpose(adj), dense.T)
    torch.testing.assert_close(dense_of(adj), dense)
    assert adj.indices.dtype == torch.int32 and adj.t_edge.dtype == torch.int32


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("by_columns", [True, False])
@pytest.mark.parametrize("share", [0.1, 0.5])
def test_select_columns_matches_dense_slicing(backend, weighted, by_columns, share, monkeypatch):
    """Against the CSR rebuilt from the dense slice, entry for entry; the numba backend's two
    ways (the kept columns' entries through the transpose, or a filter over every entry)."""
    monkeypatch.setattr(numba_backend, "_SELECT_BY_COLUMNS_SHARE", 1.0 if by_columns else -1.0)
    dense, adj = make_case(30, 50, weighted, torch.float32)
    keep = torch.rand(50, generator=torch.Generator().manual_seed(3)) < share
    keep[0] = keep[2] = True
    sub = adj.select_columns(keep)
    sliced = dense[:, keep].double()
    assert (sub.n_rows, sub.n_cols, sub.nnz) == (30, int(keep.sum()), int((sliced != 0).sum()))
    torch.testing.assert_close(dense_of(sub), sliced)
    torch.testing.assert_close(dense_of_transpose(sub), sliced.T)
    rebuilt = csr_of(sliced, weighted)
    for name in ("indptr", "indices", "t_indptr", "t_indices", "t_edge", *(("values", "t_values") if weighted else ())):
        assert torch.equal(getattr(sub, name), getattr(rebuilt, name)), name
    x = torch.randn(sub.n_cols, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: spmm(sub, x), (x,))


@pytest.mark.parametrize("by_columns", [True, False])
def test_select_columns_dropping_everything(backend, by_columns, monkeypatch):
    monkeypatch.setattr(numba_backend, "_SELECT_BY_COLUMNS_SHARE", 1.0 if by_columns else -1.0)
    _, adj = make_case(10, 12, True, torch.float32)
    empty = adj.select_columns(torch.zeros(12, dtype=torch.bool))
    assert (empty.n_rows, empty.n_cols, empty.nnz) == (10, 0, 0)
    assert torch.equal(spmm(empty, torch.randn(0, 4)), torch.zeros(10, 4))


def test_with_values_shares_transpose_and_uses_new_values(backend):
    dense, adj = make_case(20, 20, True, torch.float64)
    reweighted = adj.with_values(adj.values * 2)
    assert reweighted.t_indptr is adj.t_indptr and reweighted.t_edge is adj.t_edge
    torch.testing.assert_close(dense_of_transpose(reweighted), 2 * dense.T)
    x = torch.randn(20, 3, dtype=torch.float64)
    torch.testing.assert_close(spmm(reweighted, x), 2 * dense @ x)
    torch.testing.assert_close(spmm(adj.with_values(None), x), (dense != 0).double() @ x)


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("sides", ["row", "column", "both"])
def test_degree_scales_act_as_diagonal_factors(backend, weighted, sides):
    """``A = diag(r) P diag(c)``: products, the transposed product (gradient), the in-place
    add, column selection and extra column scaling all equal the dense product, and nothing
    is stored per entry for the scales."""
    dense, pattern = make_case(30, 45, weighted, torch.float64, seed=5)
    g = torch.Generator().manual_seed(6)
    r = torch.rand(30, generator=g, dtype=torch.float64) + 0.5 if sides in ("row", "both") else None
    c = torch.rand(45, generator=g, dtype=torch.float64) + 0.5 if sides in ("column", "both") else None
    adj = Adjacency.from_csr(pattern.indptr, pattern.indices, 45, pattern.values, row_scale=r, col_scale=c)
    scaled = (dense if r is None else r[:, None] * dense) * (1 if c is None else c[None, :])
    numel = lambda m: sum(t.numel() for t in m.tensors() if t is not None)  # noqa: E731
    assert numel(adj) == numel(pattern) + (0 if r is None else 30) + (0 if c is None else 45)  # O(n), not per entry
    x = torch.randn(45, 5, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(spmm(adj, x), scaled @ x)
    assert torch.autograd.gradcheck(lambda x: spmm(adj, x), (x,))
    base = torch.randn(30, 5, dtype=torch.float64)
    torch.testing.assert_close(spmm_add_(base.clone(), adj, x.detach()), base + scaled @ x.detach())
    keep = torch.rand(45, generator=g) < 0.5
    keep[0] = True
    kept_nnz = int((dense[:, keep] != 0).sum())
    for sizes in (None, (int(keep.sum()), kept_nnz)):
        sub = adj.select_columns(keep, sizes).scale_columns(3.0)
        torch.testing.assert_close(spmm(sub, x.detach()[keep]), 3.0 * scaled[:, keep] @ x.detach()[keep])
        assert sub.row_scale is adj.row_scale and sub.col_scale.shape == (int(keep.sum()),)


@pytest.mark.parametrize(
    "indptr, indices, n_cols, message",
    [
        ([0, 2, 1], [0, 1], 3, "indptr"),
        ([0, 2], [0, 3], 3, "n_cols"),
        ([0, 2], [1, 0], 3, "ascending"),
        ([0, 1, 2], [1.0, 0.0], 3, "integer"),
    ],
)
def test_from_csr_rejects_bad_input(indptr, indices, n_cols, message):
    # the engine's own input (load_shard checked the files): a bug, not a user error
    with pytest.raises(ValueError, match=message):
        Adjacency.from_csr(torch.tensor(indptr), torch.tensor(indices), n_cols)


def test_from_csr_rejects_scales_of_the_wrong_shape():
    with pytest.raises(ValueError, match="row_scale must be a float tensor of shape \\[2\\]"):
        Adjacency.from_csr(torch.tensor([0, 1, 2]), torch.tensor([0, 1]), 3, row_scale=torch.ones(3))
    with pytest.raises(ValueError, match="col_scale must be a float tensor of shape \\[3\\]"):
        Adjacency.from_csr(torch.tensor([0, 1, 2]), torch.tensor([0, 1]), 3, col_scale=torch.ones(2, dtype=torch.int64))


def test_unknown_backend_is_a_user_error(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "cuda-magic")
    with pytest.raises(UserError, match=ENV_VAR):
        kernel_backend(torch.device("cpu"))


# --- gat_aggregate --------------------------------------------------------------------------


def gat_inputs(n_rows, n_cols, heads, dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_cols, heads, dim, generator=g, dtype=dtype).requires_grad_()
    s_src = torch.randn(n_cols, heads, generator=g, dtype=dtype).requires_grad_()
    s_dst = torch.randn(n_rows, heads, generator=g, dtype=dtype).requires_grad_()
    col_weight = torch.rand(n_cols, generator=g, dtype=dtype) * 2 + 0.1
    return x, s_src, s_dst, col_weight


@pytest.mark.parametrize("use_weight", [True, False])
@pytest.mark.parametrize("shape", [(30, 30), (20, 45)])
def test_gat_matches_dense_reference(backend, use_weight, shape):
    dense, adj = make_case(*shape, True, torch.float64)  # values must be ignored
    x, s_src, s_dst, col_weight = gat_inputs(*shape, 3, 5, torch.float64)
    w = col_weight if use_weight else None
    y = gat_aggregate(adj, x, s_src, s_dst, w, negative_slope=0.1)
    inputs = [t.detach().clone().requires_grad_() for t in (x, s_src, s_dst)]
    y_ref = gat_reference(dense != 0, *inputs, w, 0.1)
    torch.testing.assert_close(y, y_ref)
    assert torch.all(y[1] == 0)  # empty row
    torch.testing.assert_close(y[2], x[2].detach())  # self-loop-only row: alpha = 1
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, s_src, s_dst), dy)
    grads_ref = torch.autograd.grad(y_ref, inputs, dy)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want)


def test_gat_float32_matches_float64(backend):
    _, adj = make_case(40, 60, False, torch.float32)
    inputs64 = gat_inputs(40, 60, 4, 8, torch.float64)
    inputs32 = [t.detach().float().requires_grad_() for t in inputs64]
    y64 = gat_aggregate(adj, *inputs64)
    y32 = gat_aggregate(adj, *inputs32)
    torch.testing.assert_close(y32, y64.float(), rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(y64)
    for got, want in zip(
        torch.autograd.grad(y32, inputs32[:3], dy.float()), torch.autograd.grad(y64, inputs64[:3], dy)
    ):
        torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("use_weight", [True, False])
def test_gat_gradcheck_float64(backend, use_weight):
    _, adj = make_case(8, 11, False, torch.float64)
    x, s_src, s_dst, col_weight = gat_inputs(8, 11, 2, 3, torch.float64)
    w = col_weight if use_weight else None
    assert torch.autograd.gradcheck(lambda a, b, c: gat_aggregate(adj, a, b, c, w), (x, s_src, s_dst))


def test_gat_zero_weight_row_gives_zero_not_nan(backend):
    _, adj = make_case(10, 10, False, torch.float32)
    x, s_src, s_dst, _ = gat_inputs(10, 10, 2, 4, torch.float32)
    y = gat_aggregate(adj, x, s_src, s_dst, torch.zeros(10))
    assert torch.equal(y, torch.zeros_like(y))


def test_gat_skips_dx_when_x_needs_no_grad(backend, monkeypatch):
    _, adj = make_case(12, 12, False, torch.float64)
    x, s_src, s_dst, _ = gat_inputs(12, 12, 2, 4, torch.float64)
    module = kernel_backend(torch.device("cpu"))
    seen = []
    original = module.gat_backward

    def spy(*args):
        seen.append(args[-1])
        return original(*args)

    monkeypatch.setattr(module, "gat_backward", spy)
    y = gat_aggregate(adj, x.detach(), s_src, s_dst)
    y.sum().backward()
    assert seen == [False] and s_src.grad is not None and s_dst.grad is not None
    assert gat_aggregate(adj, x.detach(), s_src.detach(), s_dst.detach()).grad_fn is None


def test_gat_rejects_mismatched_shapes():
    _, adj = make_case(10, 12, False, torch.float32)
    x, s_src, s_dst, _ = gat_inputs(10, 12, 2, 4, torch.float32)
    with pytest.raises(ValueError, match="score_src"):
        gat_aggregate(adj, x, s_src[:, :1], s_dst)


def test_torch_backend_never_widens_an_index_to_int64(monkeypatch):
    """The torch backend's products (CUDA's, every layer, forward and backward) gather with
    the int32 ids as stored, and copy no per-entry tensor at all. ``values[index]`` would
    first copy an int32 index to int64, a pass over every entry per gather: on an H200, 16 of
    the 24 copies of 0.33 ms in one GAT layer of the Reddit-sized graph."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setenv(ENV_VAR, "torch")
    _, pattern = make_case(37, 45, True, torch.float32, seed=3)
    r, c = torch.rand(37) + 0.5, torch.rand(45) + 0.5
    adj = Adjacency.from_csr(pattern.indptr, pattern.indices, 45, pattern.values, row_scale=r, col_scale=c)
    assert adj.indices.dtype == torch.int32 and adj.t_edge.dtype == torch.int32
    assert adj.nnz not in (36, 37, 38, 45, 46)  # an [nnz] tensor is told apart by its length
    x, s_src, s_dst, col_weight = gat_inputs(37, 45, 2, 3, torch.float32)
    x.requires_grad_(True), s_src.requires_grad_(True), s_dst.requires_grad_(True)
    h = torch.randn(45, 5, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        (gat_aggregate(adj, x, s_src, s_dst, col_weight).sum() + spmm(adj, h).sum()).backward()
    widened = [
        e for e in prof.events() if e.name == "aten::_to_copy" and e.input_shapes and e.input_shapes[0] == [adj.nnz]
    ]
    assert not widened, (
        f"{len(widened)} copies of an [nnz] tensor, e.g. under "
        f"{widened[0].cpu_parent.name if widened[0].cpu_parent else '?'}"
    )


# --- dropout ------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [0.1, 0.5, 0.6])
def test_dropout_keeps_each_element_with_probability_one_minus_p(backend, p):
    torch.manual_seed(0)
    x = torch.ones(400, 500)
    y = dropout(x, p, training=True)
    kept = y != 0
    # 200,000 draws: the kept fraction is within 5 standard deviations of 1 - p.
    tolerance = 5 * (p * (1 - p) / x.numel()) ** 0.5
    assert abs(kept.float().mean().item() - (1 - p)) < tolerance
    torch.testing.assert_close(y[kept], torch.full((int(kept.sum()),), 1 / (1 - p)))
    # Neighbouring elements are independent (the 16-bit fields of one word are not tied).
    pairs = kept.flatten()[:-1] & kept.flatten()[1:]
    assert abs(pairs.float().mean().item() - (1 - p) ** 2) < 2 * tolerance


def test_dropout_gradient_is_the_mask_scaled(backend):
    torch.manual_seed(1)
    x = torch.randn(50, 30, dtype=torch.float64, requires_grad=True)
    y = dropout(x, 0.5, training=True)
    upstream = torch.randn_like(y)
    (grad,) = torch.autograd.grad(y, x, upstream)
    mask = (y != 0).double() * 2.0
    torch.testing.assert_close(y, x.detach() * mask)
    torch.testing.assert_close(grad, upstream * mask)


def test_dropout_is_seeded_and_off_outside_training(backend):
    x = torch.randn(100, 20)
    torch.manual_seed(3)
    first = dropout(x, 0.5, training=True)
    torch.manual_seed(3)
    assert torch.equal(first, dropout(x, 0.5, training=True))
    assert not torch.equal(first, dropout(x, 0.5, training=True))
    assert dropout(x, 0.5, training=False) is x
    assert dropout(x, 0.0, training=True) is x


def test_recomputed_dropout_keeps_no_activation_and_gives_the_same_gradients(backend):
    """An operation saving a RecomputedDropout output keeps x and a seed instead: the
    output is not kept alive, and the weight gradient is the one the kept output gives
    (the mask redrawn from the seed is the same); on numba the mask is dropout()'s."""
    import weakref

    from bnsgcn.kernels import RecomputedDropout

    x = torch.randn(300, 24)
    lin = torch.nn.Linear(24, 5)
    torch.manual_seed(4)
    recomputed = RecomputedDropout()
    out = recomputed(x, 0.5, True)
    reference = out.clone()
    with recomputed.saving_recipes():
        y = lin(out)
    alive = weakref.ref(out)
    del out
    assert alive() is None, "the dropout output was kept for backward"
    y.square().sum().backward()
    got = lin.weight.grad.clone()
    lin.weight.grad = None
    lin(reference).square().sum().backward()
    torch.testing.assert_close(got, lin.weight.grad)
    if backend != "torch":
        torch.manual_seed(4)
        torch.testing.assert_close(reference, dropout(x, 0.5, True))
    with pytest.raises(ValueError, match="need no gradient"):
        recomputed(x.requires_grad_(), 0.5, True)


def test_numba_kernels_leave_torch_thread_count_alone():
    """numba's OpenMP start-up resets the shared team size to NUMBA_NUM_THREADS: a one-thread
    rank must keep one torch thread (and run its kernels on one) after its first kernel call.
    A fresh process, since numba starts its threads once per process."""
    script = textwrap.dedent(
        """
        import torch
        torch.set_num_threads(1)
        from bnsgcn.kernels import Adjacency, spmm
        n = 4096
        cols = ((torch.arange(n)[:, None] + 97 * torch.arange(8)) % n).sort(dim=1).values.flatten()
        indptr = torch.arange(0, 8 * n + 1, 8)
        spmm(Adjacency.from_csr(indptr, cols, n, None), torch.randn(n, 64))
        import numba
        print(torch.get_num_threads(), numba.get_num_threads())
        """
    )
    env = os.environ | {"NUMBA_NUM_THREADS": "2", ENV_VAR: "numba"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "1"], result.stdout


def test_dropout_mask_does_not_depend_on_thread_count(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "numba")
    monkeypatch.setattr(numba_backend, "_ONE_THREAD_WORK", 0)
    x = torch.randn(301, 77)
    previous, results = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            torch.manual_seed(5)
            results.append(dropout(x, 0.3, training=True))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(*results)


# --- layer norm -> ReLU -> dropout ----------------------------------------------------------


def _norm_case(dtype: torch.dtype, n: int = 60, d: int = 37):
    """Rows of several scales and one constant row (zero variance); width not a multiple of 4."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, d, generator=g, dtype=dtype) * torch.linspace(0.1, 10, n, dtype=dtype)[:, None]
    x[3] = 2.5
    weight = torch.rand(d, generator=g, dtype=dtype) + 0.5
    bias = torch.randn(d, generator=g, dtype=dtype) * 0.3
    return x, weight, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shifted", [False, True])
def test_layer_norm_relu_without_dropout_matches_torch(backend, dtype, shifted):
    """Against torch's layer norm of ``x`` (of ``x + shift`` with a shift, the bias of the
    layer before): output and every gradient; 150 rows, so backward's sums of 64 rows end
    part way through a block."""
    x, weight, bias = _norm_case(dtype, n=150)
    shift = torch.randn(x.shape[1], dtype=dtype, generator=torch.Generator().manual_seed(4)) if shifted else None
    inputs = tuple(t.requires_grad_(True) for t in (x, weight, bias, *([shift] if shifted else [])))
    generator_state = torch.get_rng_state()
    ours = layer_norm_relu_dropout(x, weight, bias, 1e-5, 0.5, training=False, shift=shift)
    assert torch.equal(torch.get_rng_state(), generator_state)  # no dropout: nothing drawn
    reference = torch.relu(
        torch.nn.functional.layer_norm(x + shift if shifted else x, (x.shape[1],), weight, bias, 1e-5)
    )
    upstream = torch.randn_like(ours)
    grads = torch.autograd.grad(ours, inputs, upstream)
    expected = torch.autograd.grad(reference, inputs, upstream)
    tolerance = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {}
    torch.testing.assert_close(ours, reference, **tolerance)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, **tolerance)


def test_layer_norm_relu_dropout_is_the_composite_with_its_mask(backend):
    x, weight, bias = _norm_case(torch.float64, n=200, d=64)
    torch.manual_seed(11)
    ours = layer_norm_relu_dropout(x, weight, bias, 1e-5, 0.4, training=True)
    positive = torch.relu(torch.nn.functional.layer_norm(x, (64,), weight, bias, 1e-5))
    kept = ours != 0
    torch.testing.assert_close(ours[kept], positive[kept] / 0.6)
    # Dropped elements are a fraction p of the positive ones (12,800 elements, ~6,000 positive).
    dropped = ((positive > 0) & ~kept).sum() / (positive > 0).sum()
    assert abs(dropped.item() - 0.4) < 0.05
    torch.manual_seed(11)
    assert torch.equal(ours, layer_norm_relu_dropout(x, weight, bias, 1e-5, 0.4, training=True))


@pytest.mark.parametrize("shifted", [False, True])
def test_layer_norm_relu_dropout_gradcheck_float64(backend, shifted):
    x, weight, bias = _norm_case(torch.float64, n=24, d=9)  # gradcheck's cost grows with the inputs: few rows
    shift = torch.randn(9, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) if shifted else None
    inputs = tuple(t.requires_grad_(True) for t in (x, weight, bias, *([shift] if shifted else [])))

    def fixed_mask(x, weight, bias, shift=None):
        torch.manual_seed(3)  # the same mask on every evaluation
        return layer_norm_relu_dropout(x, weight, bias, 1e-5, 0.3, training=True, shift=shift)

    assert torch.autograd.gradcheck(fixed_mask, inputs)


def test_layer_norm_relu_dropout_mask_does_not_depend_on_thread_count(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "numba")
    monkeypatch.setattr(numba_backend, "_ONE_THREAD_WORK", 0)
    x, weight, bias = _norm_case(torch.float32, n=301, d=77)
    previous, results = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            torch.manual_seed(5)
            x_grad = x.clone().requires_grad_(True)
            out = layer_norm_relu_dropout(x_grad, weight, bias, 1e-5, 0.3, training=True)
            out.backward(torch.ones_like(out))
            results.append((out, x_grad.grad))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])


# --- scatter_rows (the exchange's backward) ---------------------------------------------------


@pytest.mark.parametrize("row", [(5,), (2, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scatter_rows_sums_each_row_where_its_index_says(backend, row, dtype):
    """Against a loop: repeated indices sum, untouched rows are zero (into a pooled buffer
    that held other values before), no rows gives all zeros."""
    g = torch.Generator().manual_seed(9)
    n = 70_000  # over 1 MiB: the result comes from the pool, not from fresh (zeroed) pages
    index = torch.tensor([3, 0, 7, 3, 69_999, 3, 0])
    rows = torch.randn(len(index), *row, generator=g, dtype=dtype)
    expected = torch.zeros(n, *row, dtype=dtype)
    for i, target in enumerate(index.tolist()):
        expected[target] += rows[i]
    module = kernel_backend(torch.device("cpu"))
    pool = buffers.BufferPool()
    with buffers.pooled(pool):
        dirty = buffers.empty((n, *row), dtype).fill_(7.0)  # the block the result reuses
    del dirty
    with buffers.pooled(pool):
        torch.testing.assert_close(
            module.scatter_rows(index, rows, n), expected, rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-6
        )
    assert torch.equal(module.scatter_rows(index[:0], rows[:0], n), torch.zeros(n, *row, dtype=dtype))
    # added into a given tensor, in place (the exchange adds them into the inner product's gradient)
    into = torch.randn(n, *row, generator=g, dtype=dtype)
    summed = module.scatter_rows(index, rows, n, into=into.clone())
    torch.testing.assert_close(summed, into + expected, rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-6)
    target = into.clone()
    assert module.scatter_rows(index, rows, n, into=target) is target


# --- rows as their nonzero entries (the exchange's sparse rows) --------------------------------


def _bits_by_loop(mask: torch.Tensor) -> torch.Tensor:
    """The bitmap layout written out: bit j % 8 of byte j // 8 set where entry j is nonzero."""
    bits = torch.zeros(mask.shape[0], (mask.shape[1] + 7) // 8, dtype=torch.uint8)
    for i, j in mask.nonzero().tolist():
        bits[i, j // 8] |= 1 << (j % 8)
    return bits


@pytest.mark.parametrize("width", [1, 7, 8, 13, 64])
@pytest.mark.parametrize("density", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nonzero_rows_round_trip_and_gradients(backend, width, density, dtype):
    """Pack rows ``x[index]`` (repeated and missing indices, exact zeros of both signs) into a
    bitmap and entries, against a loop; unpack them bit for bit; gather a gradient's entries
    where the bits are set; scatter them back as zero (or into a given tensor) plus each row added at its index, in
    index order (a loop's sums, bit for bit)."""
    g = torch.Generator().manual_seed(width)
    n, m = 40, 30
    x = torch.randn(n, width, generator=g, dtype=dtype)
    x[torch.rand(n, width, generator=g) >= density] = 0.0
    x[0, 0] = -0.0
    index = torch.randint(0, n, (m,), generator=g)
    index[:3] = torch.tensor([5, 5, n - 1])
    module = kernel_backend(torch.device("cpu"))
    rows = x[index]
    mask = rows != 0

    bits = torch.full((m, (width + 7) // 8), 0xAA, dtype=torch.uint8)
    values = torch.full((m * width,), float("nan"), dtype=dtype)
    offsets = module.pack_nonzero_rows(x, index, bits, values)
    assert torch.equal(bits, _bits_by_loop(mask))
    assert offsets.tolist() == [0, *torch.cumsum(mask.sum(1), 0).tolist()]
    nnz = int(offsets[-1])
    assert torch.equal(values[:nnz], rows[mask])

    spare = torch.cat([values[:nnz], torch.tensor([float("nan")], dtype=dtype)])  # the spare slot may hold anything
    out = torch.full((m, width), 3.0, dtype=dtype)
    module.unpack_nonzero_rows(bits, spare, out)
    assert torch.equal(out, torch.where(mask, rows, torch.zeros((), dtype=dtype)))

    grads = torch.randn(m, width, generator=g, dtype=dtype)
    gathered = module.gather_nonzero(grads, bits, torch.full((nnz + 1,), float("nan"), dtype=dtype))
    assert torch.equal(gathered, grads[mask])

    expected = torch.zeros(n, width, dtype=dtype)
    for i, target in enumerate(index.tolist()):
        expected[target] += torch.where(mask[i], grads[i], torch.zeros((), dtype=dtype))
    with_spare = torch.cat([gathered, torch.tensor([float("nan")], dtype=dtype)])
    assert torch.equal(module.scatter_nonzero_rows(index, bits, with_spare, (n, width)), expected)
    into = torch.randn(n, width, generator=g, dtype=dtype)
    torch.testing.assert_close(
        module.scatter_nonzero_rows(index, bits, with_spare, (n, width), into=into.clone()),
        into + expected,
        rtol=0,
        atol=1e-12 if dtype == torch.float64 else 1e-5,
    )
    assert torch.equal(
        module.scatter_nonzero_rows(index[:0], bits[:0], with_spare[:1], (n, width)), torch.zeros(n, width, dtype=dtype)
    )
