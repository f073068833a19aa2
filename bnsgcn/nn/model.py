"""The model: the built-in GNN stack (layers, normalisation, activation and dropout) or a
class of the user's own (:mod:`bnsgcn.nn.user_model`), and how the engine builds and runs
either (:func:`build_model`, :func:`run_model`)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bnsgcn.comm.wire import WireFormat
from bnsgcn.config import TrainConfig
from bnsgcn.errors import UserError
from bnsgcn.kernels import RecomputedDropout, dropout, layer_norm_relu_dropout
from bnsgcn.nn.graph import EpochGraph
from bnsgcn.nn.layers import LAYERS
from bnsgcn.nn.precision import compute_precision, float32_rows
from bnsgcn.nn.recompute import recomputed
from bnsgcn.nn.user_model import build_user_model


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks whose gradient is again the sum over ranks (each rank's loss
    depends on the global sum)."""

    @staticmethod
    def forward(ctx, x, reduce):  # noqa: D102
        ctx.reduce = reduce
        return reduce(x.clone())

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return ctx.reduce(grad.clone()), None


class SyncBatchNorm(nn.Module):
    r"""Batch normalisation whose statistics cover the inner nodes of all ranks.

    .. math:: \mu = \frac{1}{N}\sum_{r,v} x_{rv},\quad \sigma^2 = \frac{1}{N}\sum_{r,v}(x_{rv}-\mu)^2,
              \quad y = \gamma \frac{x - \mu}{\sqrt{\sigma^2 + \epsilon}} + \beta

    ``reduce`` sums a tensor over ranks in place. Shapes: [n_inner, d] -> [n_inner, d].
    """

    def __init__(self, dim: int, reduce: Callable[[Tensor], Tensor], momentum: float = 0.1, eps: float = 1e-5):
        super().__init__()
        self.reduce, self.momentum, self.eps = reduce, momentum, eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.register_buffer("running_mean", torch.zeros(dim))
        self.register_buffer("running_var", torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            return (x - self.running_mean) * torch.rsqrt(self.running_var + self.eps) * self.weight + self.bias
        # a fill on the device, not a copy from the host (which would wait for the device)
        count = _AllReduceSum.apply(torch.full((1,), float(x.shape[0]), dtype=x.dtype, device=x.device), self.reduce)
        mean = _AllReduceSum.apply(x.sum(0), self.reduce) / count
        var = _AllReduceSum.apply(((x - mean) ** 2).sum(0), self.reduce) / count
        with torch.no_grad():
            unbiased = var * count / (count - 1).clamp(min=1)
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(unbiased, self.momentum)
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias


class GNN(nn.Module):
    """``layers`` graph layers; between them norm -> activation; dropout before each layer.

    ``x`` [n_inner, F] (and ``x_agg`` [n_inner, F], the precomputed first-layer
    aggregation, when the model uses it) -> logits [n_inner, num_classes].

    What backward keeps (training). The input dropout of the first layer is a
    :class:`~bnsgcn.kernels.RecomputedDropout`: ``x`` and ``x_agg`` are resident and need
    no gradient, so backward keeps their masks and recomputes ``dropout(x)`` and
    ``dropout(x_agg)`` [n_inner, F] for the weight gradients (one elementwise pass each)
    instead of keeping them. Further, the forward pass runs as *segments*, each a
    :func:`bnsgcn.nn.recompute.recomputed`: a segment keeps only its input and recomputes
    its inside in backward (dropout masks too: the random state is restored). Always, a
    hidden layer that multiplies first and aggregates few columns (``cheap_to_recompute``:
    [n_inner, d_in] -> [n_inner, d_out] with d_out < d_in) is one segment with the norm
    before it: it keeps ``y`` [n_inner, d_in] instead of ``y``, the mask and ``h``. Not the
    output layer, though it multiplies first too: its backward runs first, while all that
    forward kept is alive, so recomputing it there lowers no peak (measured: the same peak
    RSS per rank on the reference graph, docs/benchmarks.md) and costs a norm and a GEMM
    per step. With ``remat`` (``--remat``) every layer is a segment, together with the norm, activation
    and dropout before it (unless the norm is ``batch``, whose statistics are all-reduced:
    it stays outside). A segment of layer ``l`` then keeps ``y_{l-1}`` [n_inner, d] (the
    previous layer's output) instead of ``h_{l-1}``, the norm's input and mask, and the
    aggregation ``A h`` its dense product needs: one activation per layer instead of about
    four; the output layer shares the segment of the layer before it (its recomputation
    costs next to nothing), so ``L >= 3`` layers keep ``L - 2`` activations (``L - 1``
    with int8/int4 rows, whose rounding draws random numbers between the two layers). The
    boundary rows a segment received are kept by the :class:`~bnsgcn.nn.graph.EpochGraph`
    and handed out again when it is recomputed, so rows cross the network once per layer and
    direction, as without ``remat``.
    ``kept_for_recompute`` lists the segment inputs of the last training pass (the memory
    report counts them as saved activations).

    A hidden layer followed by the fused layer norm + ReLU leaves its bias to that step
    (``bias_in_norm``; :func:`~bnsgcn.kernels.layer_norm_relu_dropout`'s ``shift``): the
    layer returns ``W x`` terms only, and the norm adds ``b`` as it reads them.
    """

    def __init__(self, config: TrainConfig, in_dim: int, num_classes: int, reduce: Callable[[Tensor], Tensor]):
        super().__init__()
        self.dropout = config.model.dropout
        self.remat = config.model.remat
        # the output layer may share the segment before it only when nothing between the two
        # draws random numbers that its recomputation would not draw again: the stochastic
        # rounding of int8/int4 rows does, and replayed rows are not rounded again
        self.merge_output_segment = config.model.remat and not WireFormat(config.wire_format).draws_random_numbers
        layer_class = LAYERS[config.model.name]
        self.activation = layer_class.activation
        self.layers = nn.ModuleList()
        self.norms = nn.ModuleList()
        self.kept_for_recompute: list[Tensor] = []
        d_in = in_dim
        for i in range(config.model.layers):
            last = i == config.model.layers - 1
            layer = layer_class.build(d_in, num_classes if last else config.model.hidden, i, last, config)
            self.layers.append(layer)
            if not last:
                self.norms.append(_norm(config.model.norm, layer.out_features, reduce))
            d_in = layer.out_features
        # Recomputed for backward (--remat), an output layer that multiplies first needs only its dense
        # products: its aggregation keeps nothing, and its output goes unused (see _layer).
        self.replay_skips_aggregation = [
            i == config.model.layers - 1 and layer.cheap_to_recompute for i, layer in enumerate(self.layers)
        ]
        # A hidden layer followed by the fused layer norm + ReLU leaves its bias to that pass
        # (added as the norm reads its rows, its gradient summed as backward writes them):
        # no pass of its own each way.
        self.bias_in_norm = [self._fused(norm) for norm in self.norms] + [False]
        # A hidden layer that exchanges its input exchanges ReLU outputs (dropout after the
        # ReLU keeps zeros zero): their zero entries pass no gradient back, so their rows may
        # cross as their nonzero entries alone (BoundaryExchange.start).
        self.nonzero_only_slots = frozenset(
            i for i, layer in enumerate(self.layers) if i > 0 and layer.exchanges_input and self.activation is F.relu
        )

    def parameters_in_forward_order(self) -> list[nn.Parameter]:
        """Layer 0, norm 0, layer 1, ...: backward produces their gradients in reverse."""
        modules = [m for i, layer in enumerate(self.layers) for m in (layer, *self.norms[i : i + 1])]
        return [p for m in modules for p in m.parameters()]

    def forward(self, x: Tensor, g: EpochGraph, x_agg: Tensor | None = None) -> Tensor:
        self.kept_for_recompute = []
        # layers recomputed in backward even without remat (see the class docstring)
        last = len(self.layers) - 1
        always = [0 < i < last and layer.cheap_to_recompute for i, layer in enumerate(self.layers)]
        if self.training and torch.is_grad_enabled() and g is not None:
            # a recomputed layer takes its boundary rows from here (layer i exchanges as slot i)
            g.keep_rows(
                frozenset(
                    i
                    for i, cheap in enumerate(always)
                    if (self.remat or cheap) and not self.replay_skips_aggregation[i]
                )
            )
            g.nonzero_only_slots = self.nonzero_only_slots
        h = self._segment(g, self._first_layer, x, x_agg, g)
        for i in range(1, len(self.layers)):
            norm = self.norms[i - 1]
            if isinstance(norm, SyncBatchNorm):  # its all-reduce must run once: outside
                h = self._segment(
                    g, self._layer, self._between_layers(norm, h, self._bias_before(i)), i, g, None, always=always[i]
                )
            elif self.merge_output_segment and i == last - 1 and not isinstance(self.norms[last - 1], SyncBatchNorm):
                # the output layer joins the segment before it: its recomputation is cheap,
                # and the segment keeps y_{L-3} instead of also y_{L-2}
                return self._segment(g, self._last_two_layers, h, i, g, norm)
            else:
                h = self._segment(g, self._layer, h, i, g, norm, always=always[i])
        return h

    def _first_layer(self, x: Tensor, x_agg: Tensor | None, g: EpochGraph) -> Tensor:
        """Input dropout -> layer 0 (-> the norm after it is the next segment's)."""
        # x and x_agg need no gradient: what layer 0 keeps of their dropout is the mask
        recomputed = RecomputedDropout()
        # GCN with the precomputed first aggregation never reads x itself: no mask to draw for it.
        reads_x = x_agg is None or self.layers[0].reads_x_with_x_agg
        h = recomputed(x, self.dropout, self.training) if reads_x else x
        add_bias = not self.bias_in_norm[0]
        with recomputed.saving_recipes():
            if x_agg is not None:
                out = self.layers[0](h, g, recomputed(x_agg, self.dropout, self.training), add_bias=add_bias)
            else:
                out = self.layers[0](h, g, add_bias=add_bias)
        return out

    def _layer(self, y: Tensor, i: int, g: EpochGraph, norm: nn.Module | None) -> Tensor:
        """The step between layers ``i - 1`` and ``i`` (unless done already: ``norm`` None) -> layer ``i``."""
        h = y if norm is None else self._between_layers(norm, y, self._bias_before(i))
        layer = self.layers[i]
        if g.replaying and self.replay_skips_aggregation[i]:
            return layer.dense_products(h)[0]
        return layer(h, g, add_bias=not self.bias_in_norm[i])

    def _last_two_layers(self, y: Tensor, i: int, g: EpochGraph, norm: nn.Module) -> Tensor:
        """Layer ``i`` and the output layer ``i + 1``, each with the step before it."""
        return self._layer(self._layer(y, i, g, norm), i + 1, g, self.norms[i])

    def _segment(self, g: EpochGraph, fn: Callable[..., Tensor], *args, always: bool = False) -> Tensor:
        """``fn(*args)``, as a recomputed segment when training with ``remat`` (or ``always``)."""
        if not (self.training and torch.is_grad_enabled() and (self.remat or always)):
            return fn(*args)
        self.kept_for_recompute += [a for a in args if isinstance(a, Tensor)]
        # The recomputation runs inside g.replay(): boundary rows come from the forward pass.
        replay = g.replay if g is not None else nullcontext  # None: a first layer that exchanges nothing
        return recomputed(fn, *args, replay=replay)

    def _fused(self, norm: nn.Module) -> bool:
        return isinstance(norm, nn.LayerNorm) and self.activation is F.relu

    def _bias_before(self, i: int) -> Tensor | None:
        """The bias of layer ``i - 1`` where the step before layer ``i`` adds it (else None:
        the layer added it)."""
        return self.layers[i - 1].output_bias if self.bias_in_norm[i - 1] else None

    def _between_layers(self, norm: nn.Module, h: Tensor, bias: Tensor | None = None) -> Tensor:
        """(+ the layer's bias, where left to this step) -> norm -> activation -> the next
        layer's input dropout; one fused pass for layer norm + ReLU. The norm runs in float32
        (a bfloat16 product is widened first)."""
        h = float32_rows(h)
        if self._fused(norm):
            return layer_norm_relu_dropout(h, norm.weight, norm.bias, norm.eps, self.dropout, self.training, shift=bias)
        return dropout(self.activation(norm(h)), self.dropout, self.training)


def _norm(kind: str, dim: int, reduce: Callable[[Tensor], Tensor]) -> nn.Module:
    if kind == "layer":
        return nn.LayerNorm(dim)
    if kind == "batch":
        return SyncBatchNorm(dim, reduce)
    return nn.Identity()


def build_model(config: TrainConfig, in_dim: int, num_classes: int, reduce: Callable[[Tensor], Tensor]) -> nn.Module:
    """The model of ``config``: the built-in :class:`GNN` of ``--model`` (``reduce`` sums a
    tensor over ranks in place, for ``--norm batch``), or an instance of the user's class."""
    if config.model.builtin:
        return GNN(config, in_dim, num_classes, reduce)
    return build_user_model(config, in_dim, num_classes)


def run_model(
    model: nn.Module, x: Tensor, graph: EpochGraph, x_agg: Tensor | None = None, precision: str = "fp32"
) -> Tensor:
    """One forward pass of ``model`` over ``graph`` (its calls numbered from slot 0): logits
    [n_inner, C] from this rank's rows ``x`` [n_inner, F] (and the built-in models'
    precomputed first aggregation ``x_agg``, where used), its products in ``precision``
    (:mod:`bnsgcn.nn.precision`), the logits float32. A user's model that returns
    anything else is refused in one line."""
    graph.start_pass()
    with compute_precision(precision, x.device):
        logits = model(x, graph) if x_agg is None else model(x, graph, x_agg)
    if not isinstance(logits, Tensor) or logits.dim() != 2 or logits.shape[0] != x.shape[0]:
        got = list(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        raise UserError(
            f"the model's forward returned {got}; it must return logits [num_inner, classes], a row for each of the "
            f"{x.shape[0]} rows of x"
        )
    return float32_rows(logits)


def parameters_in_forward_order(model: nn.Module) -> list[nn.Parameter]:
    """``model``'s parameters in the order forward uses them (backward produces their
    gradients in reverse): :meth:`GNN.parameters_in_forward_order`, or a user's model's in
    the order its modules were registered."""
    return model.parameters_in_forward_order() if isinstance(model, GNN) else list(model.parameters())
