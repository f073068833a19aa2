"""The adjacency a model aggregates over: static per shard, sampled per epoch; and the
graph object every layer, built-in or a user's own, aggregates with (:class:`EpochGraph`).

Every node's row holds its self-loop (docs/partition-format.md). The normalisation is by
*full-graph* degrees (in-degree + 1, the self-loop counted), so that with sampled boundary
columns scaled by ``1/p`` the aggregation is an unbiased estimate of the full-graph one.
It is stored as per-node scale vectors of one unweighted pattern (``A = diag(r) P
diag(c)``, see :class:`~bnsgcn.kernels.Adjacency`), O(n) instead of a value per edge
forward and transposed, and the ``1/p`` of sampled columns is one more column scale. The
reductions (``reduce``), each the same pattern under its own scales:

* ``sum`` (GIN; GAT's pattern): ``A[v, u] = 1``: no ``r``, no ``c``
* ``mean`` (GraphSAGE): ``A[v, u] = 1 / deg(v)``: ``r = 1/deg``, no ``c``
* ``gcn`` (GCN, APPNP):  ``A[v, u] = 1 / sqrt(deg(u) deg(v))``: ``r = c = deg^{-1/2}``

GAT's attention supplies its own weights over the pattern; sampled boundary columns get
weight ``1/p`` inside the softmax.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from bnsgcn.comm.plan import ExchangePlan
from bnsgcn.data.shard import Topology
from bnsgcn.errors import UserError
from bnsgcn.exchange.base import Exchange, InFlight
from bnsgcn.kernels import Adjacency, gat_aggregate, spmm, spmm_add_
from bnsgcn.kernels.adjacency import kept_entries
from bnsgcn.nn.precision import float32_rows

REDUCES = ("sum", "mean", "gcn")


def degree_scales(topology: Topology, reduce: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Row scale [n_inner] and column scale [n_inner + n_boundary] (None: all ones) of the
    adjacency ``diag(r) P diag(c)`` normalised for ``reduce`` (see the module)."""
    degree = topology.degree
    if reduce == "sum":
        return None, None
    if reduce == "mean":
        return 1.0 / degree[: topology.n_inner], None
    if reduce == "gcn":
        scale = torch.rsqrt(degree)
        return scale[: topology.n_inner], scale
    raise ValueError(f"unknown reduce {reduce!r}; choose from {', '.join(REDUCES)}")


def _split_columns(topology: Topology) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """CSR of the inner columns and of the boundary columns (shifted to start at 0)."""
    n = topology.n_inner
    rows = torch.repeat_interleave(torch.arange(n), topology.indptr.diff())
    is_inner = topology.indices < n

    def csr(mask: torch.Tensor, shift: int) -> tuple[torch.Tensor, torch.Tensor]:
        indptr = torch.zeros(n + 1, dtype=torch.int64)
        torch.cumsum(torch.bincount(rows[mask], minlength=n), 0, out=indptr[1:])
        return indptr, topology.indices[mask] - shift

    return csr(is_inner, 0), csr(~is_inner, n)


@dataclass
class EpochGraph:
    """The graph of one forward pass: what a layer aggregates over, and with what.

    This is the ``graph`` a model's ``forward(x, graph)`` receives (docs/api.md, "Your own
    model"), in training (this epoch's sampled boundary, exchanged) as in evaluation and
    inference (every column). A layer sees its inner nodes' rows ``x`` [num_inner, *row]
    and aggregates over this pass's columns: the inner nodes and the sampled boundary nodes,
    whose rows their owners send through ``exchange`` (:meth:`aggregate`, :meth:`attend`,
    :meth:`boundary_rows`); in backward the rows' gradients go back to the owners. Each call
    is one exchange, in its own ``slot`` (buffers, stale rows): by default the call's
    position in the pass, so every pass must make the same calls in the same order on every
    rank.

    ``inner`` [n_inner, n_inner] and ``boundary`` [n_inner, n_sampled] (columns already
    scaled by ``1/p``), normalised for ``shard.reduce``, are kept apart so the inner product
    runs while boundary rows are in flight; the other reductions share their patterns
    (:meth:`adjacency`). GAT's softmax couples the two, so it uses ``full``
    [n_inner, n_inner + n_sampled] with ``column_weight`` [n_inner + n_sampled] instead
    (and has no ``inner`` and ``boundary``; the other models no ``full``). With an exchange
    that moves column slices (evaluation's, ``exchange.column_slice_bytes`` > 0) the
    primitives aggregate a slice of columns at a time (:mod:`bnsgcn.exchange.sliced`).
    """

    inner: Adjacency | None
    boundary: Adjacency | None
    full: Adjacency | None
    column_weight: torch.Tensor | None
    plan: ExchangePlan
    exchange: Exchange
    traffic: str  # the accounting category of the rows moved: "features" (training) or "evaluation"
    shard: ShardGraph  # the static graph: degrees, the other reductions' scales
    # the sampled boundary columns (bool [n_boundary] on the device; None: every column) and
    # the weight of each, 1/p: what the other reductions' column scales are selected by
    kept_columns: torch.Tensor | None = None
    column_factor: float = 1.0
    # Recomputation in backward (bnsgcn.nn.model): the rows each slot of ``keep_slots``
    # received, kept (detached) in ``kept_rows``, and handed out again instead of exchanged
    # while ``replaying``: a recomputed layer must not move rows a second time.
    kept_rows: dict[int, torch.Tensor] | None = None
    keep_slots: frozenset[int] = field(default=frozenset(), init=False)
    replaying: bool = field(default=False, init=False)
    # Slots whose rows are the output of a ReLU (and dropout): the gradient of an exactly
    # zero entry is discarded there, so the exchange may send the nonzero entries alone
    # (set by bnsgcn.nn.model for a training pass; see BoundaryExchange.start).
    nonzero_only_slots: frozenset[int] = field(default=frozenset(), init=False)
    next_slot: int = field(default=0, init=False)  # the slot of the pass's next call without one
    _normalised: dict[str, tuple[Adjacency, Adjacency]] = field(default_factory=dict, init=False, repr=False)

    @property
    def num_inner(self) -> int:
        """This rank's nodes: the rows of a layer's input and output."""
        return self.shard.topology.n_inner

    @property
    def num_sampled(self) -> int:
        """The boundary nodes (other ranks' neighbours) this pass aggregates over."""
        return self.plan.num_received

    @property
    def degree(self) -> torch.Tensor:
        """float32 [num_inner]: each node's in-degree + 1 (its self-loop), in the whole graph
        (in ``--inductive`` training, the training nodes' subgraph): what ``mean`` and
        ``gcn`` normalise by, whichever boundary nodes this pass samples."""
        return self.shard.degree

    @property
    def in_degree(self) -> torch.Tensor:
        """float32 [num_inner]: each node's neighbours, its self-loop not counted (``degree - 1``)."""
        return self.shard.degree - 1

    @property
    def gcn_norm(self) -> torch.Tensor:
        """float32 [num_inner]: ``degree^(-1/2)``, the factor ``gcn`` applies on each side."""
        return self.shard.scales("gcn")[0]

    def start_pass(self) -> None:
        """Number the calls of a new pass from slot 0 (the engine calls it before each forward)."""
        self.next_slot = 0

    def _slot(self, slot: int | None) -> int:
        """``slot``, or the next one of the pass."""
        if slot is None:
            slot, self.next_slot = self.next_slot, self.next_slot + 1
        return slot

    def adjacency(self, reduce: str) -> tuple[Adjacency, Adjacency]:
        """This pass's inner [n_inner, n_inner] and boundary [n_inner, n_sampled] adjacency,
        normalised for ``reduce`` (see the module): the shard's own reduction as the pass was
        built, another one made from it once per pass (the same patterns under other scales)."""
        if self.inner is None:
            raise UserError(
                "graph.aggregate needs the graph of a model without attention, but the model's class sets attention = "
                "True; use graph.attend, or drop the attribute"
            )
        if reduce == self.shard.reduce:
            return self.inner, self.boundary
        if reduce not in REDUCES:
            raise UserError(f"graph.aggregate got reduce={reduce!r}; choose reduce from {', '.join(REDUCES)}")
        if reduce not in self._normalised:
            if self.kept_columns is None and self.column_factor == 1.0:
                self._normalised[reduce] = self.shard.adjacency(reduce)
            else:
                row, col = self.shard.scales(reduce)
                n, sampled = self.num_inner, self.boundary.n_cols
                if col is not None:
                    col = col[n:] if self.kept_columns is None else kept_entries(col[n:], self.kept_columns, sampled)
                if self.column_factor != 1.0:  # as Adjacency.scale_columns applies it
                    factor = self.column_factor
                    col = torch.full((sampled,), factor, device=self.shard.device) if col is None else col * factor
                self._normalised[reduce] = (self.shard.adjacency(reduce)[0], self.boundary.with_scales(row, col))
        return self._normalised[reduce]

    def aggregate(
        self, x: torch.Tensor, reduce: str = "sum", slot: int | None = None, into: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``A x`` over the inner and sampled boundary columns, ``A`` normalised for
        ``reduce`` (``sum``, ``mean`` or ``gcn``, see the module; self-loops included):
        [num_inner, d] -> [num_inner, d]. The rows of ``x`` this pass's boundary needs cross to
        the ranks that sampled them (one exchange), and in backward their gradients come back
        (``A^T``). With ``into`` (a layer's other term, [num_inner, d], which nothing keeps
        for backward) ``A x`` is added into it in place: ``into + A x`` without a temporary.

        The inner columns' product runs while the boundary rows are in flight (and in
        backward, while their gradients are), in the exchange's node
        (:meth:`Exchange.start_aggregating <bnsgcn.exchange.base.Exchange.start_aggregating>`).

        The sum is float32: a bfloat16 ``x`` or ``into`` (a product under ``--precision bf16``)
        is widened first, and its rows cross as the wire format says.
        """
        x = float32_rows(x)
        into = None if into is None else float32_rows(into)
        inner, boundary = self.adjacency(reduce)
        slot = self._slot(slot)
        if self.exchange.column_slice_bytes:
            return self._aggregate_in_slices(x, inner, boundary, into)
        rows, out = self._start_aggregation(x, slot, inner, into)
        return spmm_add_(out, boundary, rows.wait())

    def attend(
        self,
        z: torch.Tensor,
        source_scores: Callable[[torch.Tensor], torch.Tensor],
        target_scores: Callable[[torch.Tensor], torch.Tensor],
        negative_slope: float,
        slot: int | None = None,
        from_input: tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """Multi-head attention over the epoch's columns (self-loops included): for each head,
        ``sum_u alpha_vu z_u`` with ``alpha_vu`` the softmax over ``u`` of
        ``w_u exp(LeakyReLU(s_u + t_v))`` (``w_u``: the column weight, ``1/p`` for sampled
        boundary nodes). ``z`` [n_inner, H, D] the inner nodes' values; ``source_scores`` and
        ``target_scores`` map values [n, H, D] to ``s`` and ``t`` [n, H]. Returns
        [n_inner, H, D].

        The boundary nodes' ``z`` come from their owners, or, with ``from_input`` (``x``
        [n_inner, d_in] and the projection ``x -> z``, where ``d_in`` < ``H * D``), from
        their ``x`` rows projected here: the narrower rows cross. Moved in column slices,
        ``z`` crosses (its slices of every head's columns, after the owners' scores ``s``).
        Needs the graph of a model whose class sets ``attention = True``. The softmax and the
        sums are float32 (a bfloat16 ``z`` is widened first).
        """
        if self.full is None:
            raise UserError(
                "graph.attend needs the graph of a model whose class sets attention = True; add the attribute, or "
                "aggregate with graph.aggregate"
            )
        slot = self._slot(slot)
        z = float32_rows(z)
        if self.exchange.column_slice_bytes:
            return self._attend_in_slices(z, source_scores(z), target_scores(z), negative_slope)
        if from_input is not None:
            x, project = from_input
            z_boundary = float32_rows(project(self.boundary_rows(x, slot)))
        else:
            z_boundary = self.boundary_rows(z, slot)
        z_all = torch.cat([z, z_boundary])
        # in this order: z's gradients (from the exchange, the concatenation and the target
        # scores) are summed in the reverse order of their uses
        return gat_aggregate(
            self.full, z_all, source_scores(z_all), target_scores(z), self.column_weight, negative_slope
        )

    def boundary_rows(self, x_inner: torch.Tensor, slot: int | None = None) -> torch.Tensor:
        """Rows of the sampled boundary nodes, fetched from their owners (one exchange):
        ``x_inner`` [n_inner, *row] -> [n_sampled, *row], float32 (a bfloat16 ``x_inner`` is
        widened first)."""
        x_inner = float32_rows(x_inner)
        slot = self._slot(slot)
        if self.exchange.column_slice_bytes:
            return self._boundary_rows_in_slices(x_inner)
        return self._start_boundary_rows(x_inner, slot).wait()

    def _start_boundary_rows(self, x_inner: torch.Tensor, slot: int) -> InFlight:
        """Start fetching the rows of the sampled boundary nodes for layer ``slot`` from
        their owners; ``.wait()`` returns them [num_received, *row]. While :meth:`replay`
        is active, the rows this slot received in the forward pass, without any exchange."""
        if self.replaying:
            if self.kept_rows is None or slot not in self.kept_rows:
                raise RuntimeError(
                    f"recomputing layer slot {slot}, but its boundary rows were not kept; "
                    "call keep_rows() before the forward pass"
                )
            return _KeptRows(self.kept_rows, slot, None)
        flight = self.exchange.start(
            x_inner, self.plan, slot, self.traffic, zeros_need_no_gradient=slot in self.nonzero_only_slots
        )
        return self._kept(slot, flight)

    def _kept(self, slot: int, flight: InFlight) -> InFlight:
        """``flight``, its rows kept for a recomputation where ``slot`` needs them."""
        return _KeptRows(self.kept_rows, slot, flight) if slot in self.keep_slots else flight

    def _start_aggregation(
        self, x_inner: torch.Tensor, slot: int, inner: Adjacency, into: torch.Tensor | None = None
    ) -> tuple[InFlight, torch.Tensor]:
        """:meth:`_start_boundary_rows`, and while the rows travel the inner columns' product
        ``inner x_inner`` [n_inner, d] (with ``into``, summed into it in place). Returns
        both. The exchange computes the product (the synchronous one in its own autograd
        node, whose backward adds the rows' returned gradients into the product's gradient);
        a recomputation runs it apart."""
        if self.replaying:
            rows = self._start_boundary_rows(x_inner, slot)
            return rows, spmm(inner, x_inner) if into is None else spmm_add_(into, inner, x_inner)
        flight, product = self.exchange.start_aggregating(
            x_inner, self.plan, slot, inner, into, self.traffic, slot in self.nonzero_only_slots
        )
        return self._kept(slot, flight), product

    def _aggregate_in_slices(
        self, x: torch.Tensor, inner: Adjacency, boundary: Adjacency, into: torch.Tensor | None
    ) -> torch.Tensor:
        """:meth:`aggregate` a column slice at a time, summed in the order the whole rows'
        path sums (``into`` first, then the inner columns, then the boundary ones). The
        inner product of a slice runs while its boundary rows are in flight."""
        out = into
        for columns, part, rows in self.exchange.column_slices(x, self.plan, self.traffic):
            whole = columns.stop - columns.start == x.shape[1]
            if into is None:
                y = spmm(inner, part)
            else:  # one slice sums into ``into`` itself; narrower ones into a copy of its columns
                y = spmm_add_(into if whole else into[:, columns].contiguous(), inner, part)
            y = spmm_add_(y, boundary, rows.wait())
            if whole:
                return y  # one slice: no copy
            if out is None:
                out = x.new_empty(x.shape)
            out[:, columns] = y
        return out

    def _boundary_rows_in_slices(self, x_inner: torch.Tensor) -> torch.Tensor:
        """:meth:`boundary_rows`, gathered a column slice at a time."""
        out = x_inner.new_empty((self.plan.num_received, *x_inner.shape[1:]))
        for columns, _, rows in self.exchange.column_slices(x_inner, self.plan, self.traffic):
            out[..., columns] = rows.wait()
        return out

    def _attend_in_slices(
        self, z: torch.Tensor, score_src: torch.Tensor, score_dst: torch.Tensor, negative_slope: float
    ) -> torch.Tensor:
        """:meth:`attend` with every boundary column (p = 1: no column weights), the owners'
        source scores exchanged first, then ``z`` a slice of every head's columns at a time."""
        score_src = torch.cat([score_src, self._boundary_rows_in_slices(score_src)])
        out = z.new_empty(z.shape)
        for columns, part, rows in self.exchange.column_slices(z, self.plan, self.traffic):
            z_all = torch.cat([part, rows.wait()])
            out[..., columns] = gat_aggregate(self.full, z_all, score_src, score_dst, None, negative_slope)
        return out

    def keep_rows(self, slots: frozenset[int]) -> None:
        """Keep the received rows of layer ``slots`` from now on, for :meth:`replay` (only
        those: a kept tensor that is not a view of an exchange buffer, e.g. decoded int8
        rows, stays alive until backward)."""
        self.keep_slots = frozenset(slots)
        self.kept_rows = {}

    @contextmanager
    def replay(self) -> Iterator[None]:
        """While active, the boundary rows a layer asks for are the ones its slot received
        in the forward pass (the recomputation of a checkpointed layer during backward)."""
        self.replaying = True
        try:
            yield
        finally:
            self.replaying = False


class _KeptRows:
    """A slot's boundary rows: waited for and kept (``flight`` given), or the kept ones."""

    def __init__(self, kept: dict[int, torch.Tensor], slot: int, flight: InFlight | None) -> None:
        self.kept, self.slot, self.flight = kept, slot, flight

    def wait(self) -> torch.Tensor:
        if self.flight is None:
            return self.kept[self.slot]
        rows = self.flight.wait()
        # detached: the recomputation only rebuilds the tensors backward needs; gradients
        # reach the owners through the original pass's exchange
        self.kept[self.slot] = rows.detach()
        return rows


class ShardGraph:
    """The static adjacency of a shard for one model, built once at load: normalised for
    ``reduce`` (the model's own reduction, see :func:`degree_scales`; the others share its
    patterns, :meth:`adjacency`), and ``attention``: the layers aggregate with a softmax over
    inner and boundary columns together, so they need the whole adjacency (``full``)
    instead of its inner and boundary parts. ``degree`` float32 [n_inner] on the device:
    in-degree + 1 (the self-loop)."""

    def __init__(self, topology: Topology, reduce: str, attention: bool, device: torch.device):
        self.topology = topology
        self.device = device
        self.reduce = reduce
        row_scale, col_scale = degree_scales(topology, reduce)
        n, nb = topology.n_inner, topology.n_boundary
        self.degree = topology.degree[:n].to(device)
        self.inner = self.boundary = self.full = None
        if attention:
            full = Adjacency.from_csr(topology.indptr, topology.indices, n + nb)
            # entries per boundary column, on the host: a sample's sizes without reading the device
            self._column_nnz = full.t_indptr.diff()[n:]
            self.full = full.to(device)
        else:
            (inner_ptr, inner_idx), (bnd_ptr, bnd_idx) = _split_columns(topology)
            inner_cols, boundary_cols = (None, None) if col_scale is None else (col_scale[:n], col_scale[n:])
            self.inner = Adjacency.from_csr(inner_ptr, inner_idx, n, row_scale=row_scale, col_scale=inner_cols).to(
                device
            )
            boundary = Adjacency.from_csr(bnd_ptr, bnd_idx, nb, row_scale=row_scale, col_scale=boundary_cols)
            self._column_nnz = boundary.t_indptr.diff()
            self.boundary = boundary.to(device)
        self._inner_nnz = self.full.nnz - int(self._column_nnz.sum()) if self.full is not None else 0
        self._scales: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        self._normalised: dict[str, tuple[Adjacency, Adjacency]] = {}

    def scales(self, reduce: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """:func:`degree_scales` of ``reduce``, on the device (made once)."""
        if reduce not in self._scales:
            self._scales[reduce] = tuple(
                None if t is None else t.to(self.device) for t in degree_scales(self.topology, reduce)
            )
        return self._scales[reduce]

    def adjacency(self, reduce: str) -> tuple[Adjacency, Adjacency]:
        """The inner and boundary adjacency (every boundary column) normalised for ``reduce``:
        ``inner`` and ``boundary`` themselves for the shard's own reduction, otherwise their
        patterns (shared) under ``reduce``'s scales."""
        if reduce == self.reduce:
            return self.inner, self.boundary
        if reduce not in self._normalised:
            row, col = self.scales(reduce)
            n = self.topology.n_inner
            self._normalised[reduce] = (
                self.inner.with_scales(row, None if col is None else col[:n]),
                self.boundary.with_scales(row, None if col is None else col[n:]),
            )
        return self._normalised[reduce]

    def aggregate(self, x_inner: torch.Tensor, x_boundary: torch.Tensor) -> torch.Tensor:
        """The full-graph aggregation ``A [x_inner; x_boundary]`` [n_inner, d] (every
        boundary column; the precomputed first layer)."""
        return spmm_add_(spmm(self.inner, x_inner), self.boundary, x_boundary)

    def tensors(self) -> list[torch.Tensor | None]:
        """Every tensor of the static adjacency (for memory accounting): the patterns and the
        scales of each reduction made so far (``degree`` is the partition's)."""
        adjacency = [t for adj in (self.inner, self.boundary, self.full) if adj is not None for t in adj.tensors()]
        return adjacency + [self._column_nnz, *(t for pair in self._scales.values() for t in pair)]

    def epoch(
        self,
        keep: torch.Tensor,
        p: float,
        plan: ExchangePlan,
        exchange: Exchange,
        traffic: str = "features",
    ) -> EpochGraph:
        """The graph for one pass: boundary columns ``keep`` (bool [n_boundary]), weighted ``1/p``."""
        if p >= 1.0:  # every column: nothing to select or rescale
            weight = torch.ones(self.full.n_cols, device=self.device) if self.full is not None else None
            return EpochGraph(self.inner, self.boundary, self.full, weight, plan, exchange, traffic, self)
        # sizes from the host copy of the sample (``keep`` is on the CPU): no device read
        kept_columns, kept_nnz = int(keep.sum()), int(self._column_nnz[keep].sum())
        keep = keep.to(self.device, non_blocking=True)  # a blocking copy would wait for the device
        scale = 1.0 / p if p > 0 else 1.0
        boundary = full = column_weight = None
        if self.boundary is not None:
            boundary = self.boundary.select_columns(keep, (kept_columns, kept_nnz))
            if scale != 1.0:
                boundary = boundary.scale_columns(scale)
        if self.full is not None:
            keep_full = torch.cat([torch.ones(self.topology.n_inner, dtype=torch.bool, device=self.device), keep])
            full = self.full.select_columns(
                keep_full, (self.topology.n_inner + kept_columns, self._inner_nnz + kept_nnz)
            )
            column_weight = torch.ones(full.n_cols, device=self.device)
            column_weight[self.topology.n_inner :] = scale
        return EpochGraph(self.inner, boundary, full, column_weight, plan, exchange, traffic, self, keep, scale)
