"""The inner columns' product computed in the exchange's autograd node
(:meth:`bnsgcn.exchange.synchronous.BoundaryExchange.start_aggregating`): one rank, the exchange alone,
against a dense float64 reference written here."""

from __future__ import annotations

import pytest
import torch

from bnsgcn.comm.communicator import Comm
from bnsgcn.comm.plan import ExchangePlan
from bnsgcn.exchange.synchronous import BoundaryExchange
from bnsgcn.kernels import Adjacency


@pytest.mark.parametrize("into_given", [False, True])
@pytest.mark.parametrize("nonzero_rows", [False, True])
def test_product_and_one_gradient_for_both_uses(into_given, nonzero_rows):
    """``y = (into +) A x`` and the rows ``x[index]`` sent; ``loss = <y, W> + <rows, V>``.
    The gradient of ``x`` is ``A^T W`` plus each row's ``V`` at its index (repeated indices
    sum), of ``into`` it is ``W``; rows and product equal the dense ones. With
    ``--nonzero-rows`` the rows' gradients reach the nonzero entries alone."""
    g = torch.Generator().manual_seed(11)
    n, d = 14, 6
    dense = (torch.rand(n, n, generator=g, dtype=torch.float64) < 0.3).to(torch.float64) * (
        torch.rand(n, n, generator=g, dtype=torch.float64) + 0.5
    )
    rows_of, cols_of = dense.nonzero(as_tuple=True)
    indptr = torch.zeros(n + 1, dtype=torch.int64)
    indptr[1:] = torch.bincount(rows_of, minlength=n).cumsum(0)
    adj = Adjacency.from_csr(indptr, cols_of, n, dense[rows_of, cols_of])
    x0 = torch.randn(n, d, generator=g, dtype=torch.float64)
    x0[torch.rand(n, d, generator=g) < 0.4] = 0.0  # a ReLU's output, for --nonzero-rows
    index = torch.tensor([3, 0, 9, 3, 13, 3])
    plan = ExchangePlan(index, [len(index)], [len(index)])
    w, v = (
        torch.randn(n, d, generator=g, dtype=torch.float64),
        torch.randn(len(index), d, generator=g, dtype=torch.float64),
    )
    into0 = torch.randn(n, d, generator=g, dtype=torch.float64)

    comm = Comm(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), timeout=5.0)
    x = x0.clone().requires_grad_(True)
    into = into0.clone().requires_grad_(True) if into_given else None
    base = into * 1.0 if into_given else None  # an operation's output, summed into in place
    flight, product = BoundaryExchange(comm, nonzero_rows=nonzero_rows).start_aggregating(
        x, plan, 0, adj, base, zeros_need_no_gradient=True
    )
    rows = flight.wait()
    ((product * w).sum() + (rows * v).sum()).backward()

    torch.testing.assert_close(rows.detach(), x0[index])
    torch.testing.assert_close(product.detach(), dense @ x0 + (into0 if into_given else 0.0))
    if into_given:
        assert product is base  # summed into it, no new tensor
        torch.testing.assert_close(into.grad, w)
    sent = torch.zeros(n, d, dtype=torch.float64)
    for i, target in enumerate(index.tolist()):
        sent[target] += v[i]
    if nonzero_rows:
        sent[x0 == 0] = 0.0  # a zero entry's gradient is not sent back
    torch.testing.assert_close(x.grad, dense.T @ w + sent)


def test_the_product_alone_needs_no_rows_gradient():
    """Backward through the product when the rows were never used: the inner product's
    gradient alone (nothing waits for row gradients that were never sent)."""
    comm = Comm(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), timeout=5.0)
    dense = torch.tensor([[1.0, 1.0], [0.0, 1.0]], dtype=torch.float64)
    adj = Adjacency.from_csr(
        torch.tensor([0, 2, 3]), torch.tensor([0, 1, 1]), 2, torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64)
    )
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 3, dtype=torch.float64)
    _, product = BoundaryExchange(comm).start_aggregating(x * 1.0, ExchangePlan(torch.tensor([1]), [1], [1]), 0, adj)
    (product * w).sum().backward()
    torch.testing.assert_close(x.grad, dense.T @ w)


def test_the_graph_is_freed_after_backward():
    """Nothing the exchange keeps refers back to the epoch's graph: the product and its
    autograd node are gone once backward is done and the caller lets go."""
    import gc
    import weakref

    comm = Comm(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), timeout=5.0)
    adj = Adjacency.from_csr(torch.tensor([0, 1, 2]), torch.tensor([1, 0]), 2)
    x = torch.randn(2, 3, requires_grad=True)
    h = x * 2.0
    flight, product = BoundaryExchange(comm).start_aggregating(h, ExchangePlan(torch.tensor([1]), [1], [1]), 0, adj)
    (product.sum() + flight.wait().sum()).backward()
    alive = weakref.ref(product)
    gc.disable()
    try:
        del flight, product, h
        assert alive() is None  # freed by reference counting alone, not left to the collector
    finally:
        gc.enable()
