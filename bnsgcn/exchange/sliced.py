r"""Evaluation's exchange: exact boundary rows, moved in column slices that fit a byte budget.

A layer aggregates ``A X`` over its inner and every boundary column, so in evaluation every
boundary row crosses the network. Exchanged at once, a layer's rows take buffers of
``n_boundary x d`` (received) and ``n_send x d`` (sent): on large graphs the largest
holders of a rank's memory, larger than training's at p < 1. The sparse product is
column-separable,

.. math:: (A X)[:, c] = A\, X[:, c] = A_{in} X_{in}[:, c] + A_{bd} X_{bd}[:, c],

so the epoch graph's aggregation (:meth:`bnsgcn.nn.graph.EpochGraph.aggregate`) takes a
layer's input ``c`` columns at a time from :meth:`ColumnSlicedExchange.column_slices`: the
slice's rows cross, are aggregated into the output's columns, and the two buffers (one send,
one receive, shared by every slice and layer) take the next slice. Their size is bounded by
``buffer_bytes`` (``--eval-buffer-mib``), at least one column. Each output entry is the same
sum, in the same order, as in the unsliced pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from torch import Tensor

from bnsgcn.comm.communicator import Comm
from bnsgcn.comm.plan import ExchangePlan
from bnsgcn.exchange.base import InFlight
from bnsgcn.exchange.synchronous import BoundaryExchange

SHARED_SLOT = 0  # every slice of every layer lands in this slot's receive buffer


def slice_width(plan: ExchangePlan, row: tuple[int, ...], itemsize: int, buffer_bytes: int) -> int:
    """Columns of the last dimension of ``row`` (rows [n, *row]) that fit one slice: the
    most whose send and receive buffers each take at most ``buffer_bytes``, at least 1,
    at most ``row[-1]``. The send buffer also carries a node-aware plan's relayed rows."""
    rows = max(plan.send_index.numel(), plan.num_received, plan.relay.send_index.numel() if plan.relay else 0, 1)
    column_bytes = rows * math.prod(row[:-1]) * itemsize
    return min(row[-1], max(1, buffer_bytes // column_bytes))


class ColumnSlicedExchange(BoundaryExchange):
    """Exact rows in column slices of at most ``buffer_bytes`` per buffer (see the module).
    ``slices`` counts the exchanges (one per slice and layer) since it was last set to 0."""

    def __init__(self, comm: Comm, buffer_bytes: int) -> None:
        super().__init__(comm)
        self.column_slice_bytes = buffer_bytes
        self.slices = 0

    def column_slices(
        self, x_inner: Tensor, plan: ExchangePlan, category: str
    ) -> Iterator[tuple[slice, Tensor, InFlight]]:
        """For each column slice ``c`` of ``x_inner``'s last dimension ([n_inner, *row]):
        ``c``, the slice's inner rows ``x_inner[..., c]`` (contiguous) and its boundary rows
        in flight (``.wait()``: [plan.num_received, *row[:-1], |c|]). They live in the shared
        receive buffer: use them before asking for the next slice."""
        row = tuple(x_inner.shape[1:])
        width = slice_width(plan, row, x_inner.dtype.itemsize, self.column_slice_bytes)
        for start in range(0, row[-1], width):
            columns = slice(start, min(start + width, row[-1]))
            part = x_inner[..., columns].contiguous()
            self.slices += 1
            yield columns, part, self.start(part, plan, SHARED_SLOT, category)
