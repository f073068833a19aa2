"""Evaluation: the full-graph forward pass (p = 1, no dropout, no autograd).

The model's own forward pass runs over an epoch graph with every boundary column. With
``buffer_bytes`` > 0 (``--eval-buffer-mib``) its exchange moves each layer's boundary rows
in column slices whose buffers take at most that many bytes, and the graph's primitives
aggregate a slice at a time (:mod:`bnsgcn.exchange.sliced`); with 0 every row of a layer
crosses at once. Either way each output entry is the same sum, in the same order, and the
buffers are freed when the pass ends.
"""

from __future__ import annotations

import torch
from torch import Tensor

from bnsgcn.comm.communicator import Comm
from bnsgcn.comm.plan import ExchangePlan
from bnsgcn.exchange.sliced import ColumnSlicedExchange
from bnsgcn.exchange.synchronous import BoundaryExchange
from bnsgcn.nn.graph import ShardGraph
from bnsgcn.nn.model import run_model

CATEGORY = "evaluation"  # the accounting category of the rows evaluation moves (never compressed)


class Evaluation:
    """The evaluation forward pass of one rank, reusing one exchange's buffers.

    ``buffer_bytes`` > 0: in column slices (see the module); 0: every row of a layer at once.
    ``slices`` counts the exchanges of the last pass (one per slice and layer; 0 unsliced).
    ``precision``: the products' (``--precision``, :mod:`bnsgcn.nn.precision`), as in training.
    """

    def __init__(self, comm: Comm, buffer_bytes: int, precision: str = "fp32") -> None:
        self.comm, self.sliced, self.precision = comm, buffer_bytes > 0, precision
        self.exchange = ColumnSlicedExchange(comm, buffer_bytes) if self.sliced else BoundaryExchange(comm)
        self.slices = 0

    def largest_bytes(self) -> int:
        """Bytes of the buffers at their largest (what the memory report shows)."""
        return self.exchange.largest_bytes()

    @torch.no_grad()
    def logits(
        self, model: torch.nn.Module, graph: ShardGraph, plan: ExchangePlan, x: Tensor, x_agg: Tensor | None
    ) -> Tensor:
        """Logits [n_inner, classes] of ``model`` (in eval mode) over ``graph`` with every
        boundary column (``plan``: the full plan), from features ``x`` [n_inner, F] and the
        precomputed first aggregation ``x_agg`` [n_inner, F] where the model uses one."""
        keep = torch.ones(graph.topology.n_boundary, dtype=torch.bool)
        if self.sliced:
            self.exchange.slices = 0
        try:
            epoch = graph.epoch(keep, 1.0, plan, self.exchange, traffic=CATEGORY)
            return run_model(model, x, epoch, x_agg, self.precision)
        finally:
            self.slices = self.exchange.slices if self.sliced else 0
            self.exchange.release()
