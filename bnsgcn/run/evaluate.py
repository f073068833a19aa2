r"""Evaluation: the full-graph forward pass (p = 1, no dropout, no autograd), in column slices.

A layer aggregates ``A X`` over its inner and every boundary column, so every boundary row
crosses the network. Exchanged at once, a layer's rows take buffers of
``n_boundary x d`` (received) and ``n_send x d`` (sent): on large graphs the largest
holders of a rank's memory, larger than training's at p < 1. The sparse product is
column-separable,

.. math:: (A X)[:, c] = A\, X[:, c] = A_{in} X_{in}[:, c] + A_{bd} X_{bd}[:, c],

so :class:`Evaluation` exchanges and aggregates a layer's input ``c`` columns at a time:
the slice's rows cross, are aggregated into the output's columns, and the two buffers
(one send, one receive, shared by every slice and layer) take the next slice. Their size
is bounded by ``buffer_bytes`` (``--eval-buffer-mib``), at least one column. Each output
entry is the same sum, in the same order, as in the unsliced pass.

Per model (the layers of :mod:`bnsgcn.nn.layers`, whose choices each layer here follows):

* GraphSAGE and GCN slice the columns of what the layer aggregates: its input, or its
  input's dense product when that is narrower.
* GAT aggregates ``z = W h`` [n, H, D]; its softmax needs whole rows of scores, not of
  ``z``: the source scores ``a_s^T z_u`` [n, H] of boundary nodes are computed by their
  owners and exchanged first (H columns), then ``z`` crosses in slices of D (every head's
  columns ``c``), each aggregated with the full attention. ``z`` crosses even where the
  training layer sends the narrower ``h`` (a slice of ``h`` gives no column of ``z``).

``buffer_bytes`` 0 runs the model's own forward pass instead (every boundary row of a
layer at once, through a :class:`~bnsgcn.exchange.synchronous.BoundaryExchange`): the unsliced path.
Either way the buffers are freed when the pass ends.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from bnsgcn.comm.communicator import Comm
from bnsgcn.comm.plan import ExchangePlan
from bnsgcn.comm.wire import EXACT
from bnsgcn.exchange.synchronous import BoundaryExchange
from bnsgcn.exchange.transfers import Buffer, finish_rows, start_rows
from bnsgcn.kernels import gat_aggregate, spmm, spmm_add_
from bnsgcn.nn.graph import ShardGraph
from bnsgcn.nn.layers import GATConv, GCNConv, SAGEConv
from bnsgcn.nn.model import GNN

CATEGORY = "evaluation"  # the accounting category of the rows evaluation moves (never compressed)


def slice_width(plan: ExchangePlan, row: tuple[int, ...], itemsize: int, buffer_bytes: int) -> int:
    """Columns of the last dimension of ``row`` (rows [n, *row]) that fit one slice: the
    most whose send and receive buffers each take at most ``buffer_bytes``, at least 1,
    at most ``row[-1]``. The send buffer also carries a node-aware plan's relayed rows."""
    rows = max(plan.send_index.numel(), plan.num_received, plan.relay.send_index.numel() if plan.relay else 0, 1)
    column_bytes = rows * math.prod(row[:-1]) * itemsize
    return min(row[-1], max(1, buffer_bytes // column_bytes))


class Evaluation:
    """The evaluation forward pass of one rank, reusing one exchange's buffers.

    ``buffer_bytes`` > 0: sliced (see the module); 0: the model's own forward pass.
    ``slices`` counts the exchanges of the last pass (one per slice and layer).
    """

    def __init__(self, comm: Comm, buffer_bytes: int) -> None:
        self.comm, self.buffer_bytes = comm, buffer_bytes
        self.exchange = BoundaryExchange(comm)  # exact rows; its send buffer and one receive buffer serve the slices
        self.slices = 0

    def largest_bytes(self) -> int:
        """Bytes of the buffers at their largest (what the memory report shows)."""
        return self.exchange.largest_bytes()

    @torch.no_grad()
    def logits(self, model: GNN, graph: ShardGraph, plan: ExchangePlan, x: Tensor, x_agg: Tensor | None) -> Tensor:
        """Logits [n_inner, classes] of ``model`` (in eval mode) over ``graph`` with every
        boundary column (``plan``: the full plan), from features ``x`` [n_inner, F] and the
        precomputed first aggregation ``x_agg`` [n_inner, F] where the model uses one."""
        self.slices = 0
        try:
            if not self.buffer_bytes:
                keep = torch.ones(graph.topology.n_boundary, dtype=torch.bool)
                return model(x, graph.epoch(keep, 1.0, plan, self.exchange, traffic=CATEGORY), x_agg)
            # each bias added where the model's forward adds it (the same sums, the same logits)
            h = self._layer(model.layers[0], x, graph, plan, x_agg, add_bias=not model.bias_in_norm[0])
            for i, (layer, norm) in enumerate(zip(model.layers[1:], model.norms), start=1):
                h = model._between_layers(norm, h, model.bias_before(i))  # frees the layer's output: h is rebound
                h = self._layer(layer, h, graph, plan, add_bias=not model.bias_in_norm[i])
            return h
        finally:
            self.exchange.release()

    def _layer(
        self,
        layer: torch.nn.Module,
        x: Tensor,
        graph: ShardGraph,
        plan: ExchangePlan,
        x_agg: Tensor | None = None,
        add_bias: bool = True,
    ) -> Tensor:
        """One layer, [n_inner, d_in] -> [n_inner, d_out], as the layer computes it (its bias
        left out without ``add_bias``)."""
        if x_agg is not None:  # the precomputed first layer exchanges nothing
            return layer(x, None, x_agg, add_bias=add_bias)
        aggregate = lambda y: self._aggregate(graph, plan, y)  # noqa: E731
        bias = layer.output_bias if add_bias else None
        if isinstance(layer, SAGEConv):
            if layer.multiplies_first:
                own, neighbour = layer.dense_products(x, add_bias)
                return self._aggregate(graph, plan, neighbour, into=own)
            return F.linear(x, layer.lin_self.weight, bias).addmm_(aggregate(x), layer.lin_neigh.weight.t())
        if isinstance(layer, GCNConv):
            if layer.cheap_to_recompute:
                out = aggregate(*layer.dense_products(x))
                return out + bias if add_bias else out
            return F.linear(aggregate(x), layer.lin.weight, bias)
        if isinstance(layer, GATConv):
            return self._attention(layer, x, graph, plan, add_bias)
        raise TypeError(f"no sliced evaluation for {type(layer).__name__}")

    def _slices(self, x_inner: Tensor, plan: ExchangePlan) -> Iterator[tuple[slice, Tensor, Callable[[], Tensor]]]:
        """For each column slice ``c`` of ``x_inner``'s last dimension ([n_inner, *row]):
        ``c``, the slice's inner rows ``x_inner[..., c]`` (contiguous) and a function that
        waits for its boundary rows [plan.num_received, *row[:-1], |c|]. The rows are
        already in flight when it is yielded, and live in the shared receive buffer: use
        them before asking for the next slice."""
        row = tuple(x_inner.shape[1:])
        width = slice_width(plan, row, x_inner.dtype.itemsize, self.buffer_bytes)
        recv_buffer = self.exchange.recv_buffers.setdefault(0, Buffer())
        for start in range(0, row[-1], width):
            columns = slice(start, min(start + width, row[-1]))
            part = x_inner[..., columns].contiguous()
            work, arrived = start_rows(self.comm, part, plan, EXACT, self.exchange.send_buffer, recv_buffer, CATEGORY)
            self.slices += 1
            part_row = tuple(part.shape[1:])
            yield (
                columns,
                part,
                lambda: finish_rows(
                    self.comm, plan, work, arrived, self.exchange.send_buffer, EXACT, part_row, part.dtype, CATEGORY
                ),
            )

    def _aggregate(self, graph: ShardGraph, plan: ExchangePlan, x: Tensor, into: Tensor | None = None) -> Tensor:
        """``A x`` over inner and every boundary column, [n_inner, d] -> [n_inner, d]; with
        ``into`` [n_inner, d], ``into + A x`` summed into it in the order
        :func:`bnsgcn.nn.layers.aggregate` sums (``into`` first). The inner product of a slice
        runs while its boundary rows are in flight."""
        out = into
        for columns, part, boundary_rows in self._slices(x, plan):
            whole = columns.stop - columns.start == x.shape[1]
            if into is None:
                y = spmm(graph.inner, part)
            else:  # one slice sums into ``into`` itself; narrower ones into a copy of its columns
                y = spmm_add_(into if whole else into[:, columns].contiguous(), graph.inner, part)
            y = spmm_add_(y, graph.boundary, boundary_rows())
            if whole:
                return y  # one slice: no copy
            if out is None:
                out = x.new_empty(x.shape)
            out[:, columns] = y
        return out

    def _boundary_rows(self, x_inner: Tensor, plan: ExchangePlan) -> Tensor:
        """Every boundary row of ``x_inner`` [n_inner, *row], gathered slice by slice:
        [plan.num_received, *row] (for narrow rows: the attention scores)."""
        out = x_inner.new_empty((plan.num_received, *x_inner.shape[1:]))
        for columns, _, boundary_rows in self._slices(x_inner, plan):
            out[..., columns] = boundary_rows()
        return out

    def _attention(
        self, layer: GATConv, x: Tensor, graph: ShardGraph, plan: ExchangePlan, add_bias: bool = True
    ) -> Tensor:
        """A GAT layer (:class:`~bnsgcn.nn.layers.GATConv`) with every boundary column, its
        aggregation in slices of each head's columns."""
        z = layer.project(x)
        score_dst = layer.target_scores(z)
        score_src = layer.source_scores(z)
        score_src = torch.cat([score_src, self._boundary_rows(score_src, plan)])
        out = z.new_empty(z.shape)
        for columns, part, boundary_rows in self._slices(z, plan):
            z_all = torch.cat([part, boundary_rows()])
            # p = 1: every column weighs 1 (no column weights)
            out[..., columns] = gat_aggregate(graph.full, z_all, score_src, score_dst, None, layer.negative_slope)
        return layer.combine_heads(out, add_bias)
