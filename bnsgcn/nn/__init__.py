"""The model: the epoch's graph, GNN layers, the model stack, recomputation, the optimizer.

:class:`EpochGraph` is the ``graph`` a model's ``forward(x, graph)`` aggregates with, the
built-in layers and a model class of your own alike (docs/api.md, "Your own model"):
``graph.aggregate(h, reduce)`` with ``reduce`` one of :data:`REDUCES`, ``graph.degree``,
``graph.in_degree``, ``graph.gcn_norm``, ``graph.num_inner``, ``graph.num_sampled``.
"""

from bnsgcn.nn.graph import REDUCES, EpochGraph

__all__ = ["REDUCES", "EpochGraph"]
