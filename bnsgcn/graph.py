"""The adjacency a model aggregates over: static per shard, sampled per epoch.

Edge values carry the normalisation by *full-graph* degrees, so that with sampled
boundary columns scaled by ``1/p`` the aggregation is an unbiased estimate of the
full-graph one:

* ``mean`` (GraphSAGE): ``A[v, u] = 1 / deg(v)``
* ``symmetric`` (GCN):  ``A[v, u] = 1 / sqrt(deg(u) deg(v))``
* ``None`` (GAT): pattern only; attention supplies the weights, sampled boundary
  columns get weight ``1/p`` inside the softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .exchange import BoundaryExchange, ExchangePlan, InFlightRows
from .kernels import Adjacency
from .shard import Topology
from .stale import StaleExchange

NORMALIZATION = {"graphsage": "mean", "gcn": "symmetric", "gat": None}


def edge_values(topology: Topology, normalization: str | None) -> torch.Tensor | None:
    """Per-edge values [nnz] of the normalised adjacency (None: unweighted pattern)."""
    if normalization is None:
        return None
    rows = torch.repeat_interleave(torch.arange(topology.n_inner), topology.indptr.diff())
    degree = topology.degree
    if normalization == "mean":
        return 1.0 / degree[rows]
    if normalization == "symmetric":
        return torch.rsqrt(degree[rows] * degree[topology.indices])
    raise ValueError(f"unknown normalization {normalization!r}")


def _split_columns(topology: Topology) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """CSR of the inner columns and of the boundary columns (shifted to start at 0),
    and the mask telling which edges are inner."""
    n = topology.n_inner
    rows = torch.repeat_interleave(torch.arange(n), topology.indptr.diff())
    is_inner = topology.indices < n

    def csr(mask: torch.Tensor, shift: int) -> tuple[torch.Tensor, torch.Tensor]:
        indptr = torch.zeros(n + 1, dtype=torch.int64)
        torch.cumsum(torch.bincount(rows[mask], minlength=n), 0, out=indptr[1:])
        return indptr, topology.indices[mask] - shift

    return csr(is_inner, 0), csr(~is_inner, n), is_inner


@dataclass
class EpochGraph:
    """What one forward pass aggregates over.

    ``inner`` [n_inner, n_inner] and ``boundary`` [n_inner, n_sampled] (values already
    scaled by ``1/p``) are kept apart so the inner product runs while boundary rows are
    in flight. GAT's softmax couples the two, so it uses ``full``
    [n_inner, n_inner + n_sampled] with ``column_weight`` [n_inner + n_sampled] instead
    (and has no ``inner`` and ``boundary``; the other models no ``full``).
    """

    inner: Adjacency | None
    boundary: Adjacency | None
    full: Adjacency | None
    column_weight: torch.Tensor | None
    plan: ExchangePlan
    exchange: BoundaryExchange | StaleExchange
    traffic: str  # the accounting category of the rows moved: "features" (training) or "evaluation"

    def start_boundary_rows(self, x_inner: torch.Tensor, slot: int) -> InFlightRows:
        """Start fetching the rows of the sampled boundary nodes for layer ``slot`` from
        their owners; ``.wait()`` returns them."""
        return self.exchange.start(x_inner, self.plan, slot, self.traffic)

    def boundary_rows(self, x_inner: torch.Tensor, slot: int) -> torch.Tensor:
        """Rows of the sampled boundary nodes for layer ``slot``, fetched from their owners."""
        return self.start_boundary_rows(x_inner, slot).wait()


class ShardGraph:
    """The static, normalised adjacency of a shard for one model, built once at load."""

    def __init__(self, topology: Topology, model: str, device: torch.device):
        self.topology = topology
        self.device = device
        values = edge_values(topology, NORMALIZATION[model])
        n, nb = topology.n_inner, topology.n_boundary
        self.inner = self.boundary = self.full = None
        if model == "gat":
            self.full = Adjacency.from_csr(topology.indptr, topology.indices, n + nb, values).to(device)
        else:
            (inner_ptr, inner_idx), (bnd_ptr, bnd_idx), is_inner = _split_columns(topology)
            self.inner = Adjacency.from_csr(inner_ptr, inner_idx, n, values[is_inner]).to(device)
            self.boundary = Adjacency.from_csr(bnd_ptr, bnd_idx, nb, values[~is_inner]).to(device)

    def epoch(self, keep: torch.Tensor, p: float, plan: ExchangePlan, exchange: BoundaryExchange | StaleExchange, traffic: str = "features") -> EpochGraph:
        """The graph for one pass: boundary columns ``keep`` (bool [n_boundary]), weighted ``1/p``."""
        if p >= 1.0:  # every column: nothing to select or rescale
            weight = torch.ones(self.full.n_cols, device=self.device) if self.full is not None else None
            return EpochGraph(self.inner, self.boundary, self.full, weight, plan, exchange, traffic)
        keep = keep.to(self.device)
        scale = 1.0 / p if p > 0 else 1.0
        boundary = full = column_weight = None
        if self.boundary is not None:
            boundary = self.boundary.select_columns(keep)
            if scale != 1.0:
                boundary = boundary.with_values(boundary.values * scale)
        if self.full is not None:
            keep_full = torch.cat([torch.ones(self.topology.n_inner, dtype=torch.bool, device=self.device), keep])
            full = self.full.select_columns(keep_full)
            column_weight = torch.ones(full.n_cols, device=self.device)
            column_weight[self.topology.n_inner :] = scale
        return EpochGraph(self.inner, boundary, full, column_weight, plan, exchange, traffic)
