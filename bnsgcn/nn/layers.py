"""Distributed GNN layers: each aggregates over an :class:`~bnsgcn.nn.graph.EpochGraph`.

Every layer takes the rows of this rank's inner nodes, ``x`` [n_inner, d_in], fetches the
rows of sampled boundary nodes through the graph's exchange, and returns
[n_inner, d_out]. Where the result is the same either way (GraphSAGE, GCN), a layer
aggregates before or after its dense product, whichever moves fewer columns: aggregate
first when ``d_in < d_out``, multiply first when ``d_in > d_out``; this also shrinks what
is sent. At equal widths GCN aggregates first and GraphSAGE multiplies first (see
:class:`SAGEConv`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bnsgcn.config import TrainConfig
from bnsgcn.data.shard import Topology
from bnsgcn.kernels.dense import linear_pair, linear_sum
from bnsgcn.nn.graph import EpochGraph, ShardGraph
from bnsgcn.nn.user_model import load_model_class


def narrow_aggregation(lin: nn.Linear) -> bool:
    """The layer multiplies first and aggregates ``d_out`` < ``d_in`` columns: recomputing
    it in backward costs its dense products, little next to the activations
    [n_inner, d_in] it would otherwise keep (:class:`bnsgcn.nn.model.GNN`). Its aggregation
    keeps nothing for backward, so when nothing keeps the layer's output either (the output
    layer) the recomputation runs the products alone (``dense_products``)."""
    return lin.in_features > lin.out_features


class SAGEConv(nn.Module):
    r"""GraphSAGE with mean aggregation (self-loop included in the neighbourhood).

    .. math:: h'_v = W_s h_v + W_n \frac{1}{\deg(v)} \sum_{u \in N(v) \cup \{v\}} h_u + b

    With a precomputed ``x_agg`` (the first layer's full-graph mean) nothing is exchanged.

    At equal widths the layer multiplies first too (``multiplies_first``), as
    :math:`W_s h_v + \frac{1}{\deg(v)} \sum_u (W_n h_u) + b`: backward then keeps only
    ``h`` [n, d] (aggregating first also keeps the aggregation, [n, d] more), and the two
    gradients of ``h`` are summed inside a GEMM (:func:`~bnsgcn.kernels.dense.linear_pair`),
    not by autograd's pass of its own. With ``exchange_input`` it aggregates first instead:
    the first layer (its input rows, the features, need no gradient back; a product's rows
    would), and any layer under ``--nonzero-rows on`` (its input rows, ReLU outputs, may
    then cross as their nonzero entries, which a product's rows may not).
    """

    reduce = "mean"  # A[v, u] = 1 / deg(v) (bnsgcn.nn.graph.degree_scales)
    attention = False
    activation = staticmethod(F.relu)
    reads_x_with_x_agg = True  # W_s h_v still needs the node's own input

    @classmethod
    def build(cls, d_in: int, d_out: int, slot: int, last: bool, config: TrainConfig) -> SAGEConv:
        """Layer ``slot`` of a model of ``config``."""
        # the first layer's input rows (features) need no gradient back, products' rows would
        return cls(d_in, d_out, slot, exchange_input=slot == 0 or config.exchange.nonzero_rows == "on")

    @property
    def out_features(self) -> int:
        return self.lin_self.out_features

    @property
    def cheap_to_recompute(self) -> bool:
        return narrow_aggregation(self.lin_neigh)

    @property
    def exchanges_input(self) -> bool:
        """Without ``x_agg``, the boundary rows it fetches are rows of its input ``x`` (it
        aggregates first), not of a product."""
        return not self.multiplies_first

    def __init__(self, d_in: int, d_out: int, slot: int, exchange_input: bool = False):
        super().__init__()
        self.slot = slot
        self.lin_self = nn.Linear(d_in, d_out)
        self.lin_neigh = nn.Linear(d_in, d_out, bias=False)
        self.multiplies_first = d_in > d_out or (d_in == d_out and not exchange_input)

    @property
    def output_bias(self) -> nn.Parameter:
        """``b``: what ``add_bias=False`` leaves to the caller."""
        return self.lin_self.bias

    def dense_products(self, x: Tensor, add_bias: bool = True) -> tuple[Tensor, Tensor]:
        """``(W_s x + b, W_n x)`` [n, d_out] each (``W_s x`` without ``add_bias``), as the
        multiply-first forward computes them; a recomputation for backward runs only this
        (see :func:`narrow_aggregation`).

        One autograd node (:func:`~bnsgcn.kernels.dense.linear_pair`): backward sums the
        input's two gradients inside its GEMMs."""
        return linear_pair(x, self.lin_self.weight, self.lin_neigh.weight, self.lin_self.bias if add_bias else None)

    def forward(self, x: Tensor, g: EpochGraph, x_agg: Tensor | None = None, add_bias: bool = True) -> Tensor:
        """``add_bias=False``: without ``+ b``, for a caller that adds it in its next pass
        (the fused layer norm after a hidden layer)."""
        if x_agg is None and self.multiplies_first:
            # the neighbour term summed into the self term's output (which linear does not
            # keep): no second output [n, d_out] to allocate, fault in and add
            own, neighbour = self.dense_products(x, add_bias)
            return g.aggregate(neighbour, self.reduce, self.slot, into=own)
        neighbours = x_agg if x_agg is not None else g.aggregate(x, self.reduce, self.slot)
        # the neighbour product is added inside the GEMM, into the self term's output: no pass of its own
        return linear_sum(
            self.lin_self.bias if add_bias else None, (x, self.lin_self.weight), (neighbours, self.lin_neigh.weight)
        )


class GCNConv(nn.Module):
    r"""GCN with symmetric normalisation by full-graph degrees (self-loop included).

    .. math:: h'_v = \sum_{u \in N(v) \cup \{v\}} \frac{W h_u}{\sqrt{\deg(u)\deg(v)}} + b
    """

    reduce = "gcn"  # A[v, u] = 1 / sqrt(deg(u) deg(v))
    attention = False
    activation = staticmethod(F.relu)
    reads_x_with_x_agg = False  # with a precomputed aggregation the layer is W x_agg + b

    @classmethod
    def build(cls, d_in: int, d_out: int, slot: int, last: bool, config: TrainConfig) -> GCNConv:
        """Layer ``slot`` of a model of ``config``."""
        return cls(d_in, d_out, slot)

    @property
    def out_features(self) -> int:
        return self.lin.out_features

    @property
    def cheap_to_recompute(self) -> bool:
        return narrow_aggregation(self.lin)

    @property
    def exchanges_input(self) -> bool:
        """See :attr:`SAGEConv.exchanges_input`."""
        return not self.cheap_to_recompute

    def __init__(self, d_in: int, d_out: int, slot: int):
        super().__init__()
        self.slot = slot
        self.lin = nn.Linear(d_in, d_out, bias=False)
        self.bias = nn.Parameter(torch.zeros(d_out))

    @property
    def output_bias(self) -> nn.Parameter:
        """``b``: what ``add_bias=False`` leaves to the caller."""
        return self.bias

    def dense_products(self, x: Tensor) -> tuple[Tensor]:
        """``(W x,)`` [n, d_out]: what a multiply-first forward computes before aggregating;
        a recomputation for backward runs only this (see :func:`narrow_aggregation`)."""
        return (linear_sum(None, (x, self.lin.weight)),)

    def forward(self, x: Tensor, g: EpochGraph, x_agg: Tensor | None = None, add_bias: bool = True) -> Tensor:
        """``add_bias=False``: without ``+ b`` (see :meth:`SAGEConv.forward`)."""
        if x_agg is None and self.cheap_to_recompute:
            out = g.aggregate(*self.dense_products(x), self.reduce, self.slot)
            return out + self.bias if add_bias else out
        return linear_sum(
            self.bias if add_bias else None,
            (x_agg if x_agg is not None else g.aggregate(x, self.reduce, self.slot), self.lin.weight),
        )


class GATConv(nn.Module):
    r"""Multi-head graph attention over the sampled graph (self-loop included).

    .. math::
        z_u = W h_u,\quad e_{vu} = \mathrm{LeakyReLU}(a_s^\top z_u + a_d^\top z_v),\quad
        \alpha_{vu} = \frac{w_u e^{e_{vu}}}{\sum_{u'} w_{u'} e^{e_{vu'}}},\quad
        h'_v = \Vert_{k=1}^{H} \sum_u \alpha^k_{vu} z^k_u + b

    ``w_u = 1/p`` for sampled boundary nodes (1 otherwise) keeps the softmax denominator
    unbiased. Heads are concatenated, or averaged when ``concat=False`` (output layer).
    Whichever of ``h`` [d_in] and ``z`` [H*D] is narrower is what crosses the network.
    """

    reduce = "sum"  # the pattern only: attention supplies the weights
    attention = True
    activation = staticmethod(F.elu)
    reads_x_with_x_agg = True  # never given x_agg: attention is not precomputable
    cheap_to_recompute = False  # attention costs as much again: only with --remat
    exchanges_input = False  # it fetches projections of its input

    def __init__(self, d_in: int, d_out: int, heads: int, slot: int, concat: bool = True, negative_slope: float = 0.2):
        super().__init__()
        self.slot, self.heads, self.d_out, self.concat, self.negative_slope = slot, heads, d_out, concat, negative_slope
        self.lin = nn.Linear(d_in, heads * d_out, bias=False)
        self.att_src = nn.Parameter(torch.empty(heads, d_out))
        self.att_dst = nn.Parameter(torch.empty(heads, d_out))
        self.bias = nn.Parameter(torch.zeros(heads * d_out if concat else d_out))
        bound = math.sqrt(6.0 / (heads + d_out))
        nn.init.uniform_(self.att_src, -bound, bound)
        nn.init.uniform_(self.att_dst, -bound, bound)

    @classmethod
    def build(cls, d_in: int, d_out: int, slot: int, last: bool, config: TrainConfig) -> GATConv:
        """Layer ``slot`` of a model of ``config``: heads concatenated, averaged in the last."""
        return cls(d_in, d_out, config.model.heads, slot, concat=not last)

    @property
    def out_features(self) -> int:
        return self.bias.numel()

    @property
    def output_bias(self) -> nn.Parameter:
        """``b``: what ``add_bias=False`` leaves to the caller."""
        return self.bias

    def forward(self, x: Tensor, g: EpochGraph, x_agg: Tensor | None = None, add_bias: bool = True) -> Tensor:
        """``add_bias=False``: without ``+ b`` (see :meth:`SAGEConv.forward`)."""
        assert x_agg is None, "GAT has no precomputed first layer"
        z = self.project(x)
        narrower_input = self.lin.in_features < self.heads * self.d_out
        out = g.attend(
            z,
            self.source_scores,
            self.target_scores,
            self.negative_slope,
            self.slot,
            from_input=(x, self.project) if narrower_input else None,
        )
        return self.combine_heads(out, add_bias)

    def project(self, x: Tensor) -> Tensor:
        """``z = W x`` per head: [n, d_in] -> [n, heads, d_out]."""
        return self.lin(x).view(-1, self.heads, self.d_out)

    def source_scores(self, z: Tensor) -> Tensor:
        """``a_s^T z_u`` per head: [n, heads, d_out] -> [n, heads]."""
        return (z * self.att_src).sum(-1)

    def target_scores(self, z: Tensor) -> Tensor:
        """``a_d^T z_v`` per head: [n, heads, d_out] -> [n, heads]."""
        return (z * self.att_dst).sum(-1)

    def combine_heads(self, out: Tensor, add_bias: bool = True) -> Tensor:
        """The heads' aggregations [n, heads, d_out] concatenated ([n, heads * d_out]) or
        averaged ([n, d_out]), plus the bias (with ``add_bias``)."""
        out = out.reshape(out.shape[0], -1) if self.concat else out.mean(1)
        return out + self.bias if add_bias else out


# The built-in models by --model name: a model is its layer class (stacked by bnsgcn.nn.model.GNN).
LAYERS: dict[str, type[nn.Module]] = {"graphsage": SAGEConv, "gcn": GCNConv, "gat": GATConv}


def shard_graph(topology: Topology, model: str, device: torch.device) -> ShardGraph:
    """The static adjacency the layers of ``model`` (a ``--model``) aggregate over, on
    ``device``: normalised for a built-in layer's reduction; for a model class of the user's
    own, the pattern (``sum``; the other reductions are made from it), or the whole adjacency
    where the class sets ``attention = True``."""
    if model in LAYERS:
        layer = LAYERS[model]
        return ShardGraph(topology, layer.reduce, layer.attention, device)
    return ShardGraph(topology, "sum", bool(getattr(load_model_class(model), "attention", False)), device)
