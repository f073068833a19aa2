"""The GNN stack: layers, normalisation, activation and dropout."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import TrainConfig
from .graph import EpochGraph
from .kernels import dropout, layer_norm_relu_dropout
from .layers import GATConv, GCNConv, SAGEConv


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
        count = _AllReduceSum.apply(x.new_tensor([float(x.shape[0])]), self.reduce)
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
    """

    def __init__(self, config: TrainConfig, in_dim: int, num_classes: int, reduce: Callable[[Tensor], Tensor]):
        super().__init__()
        self.dropout = config.dropout
        self.activation = F.elu if config.model == "gat" else F.relu
        self.layers = nn.ModuleList()
        self.norms = nn.ModuleList()
        d_in = in_dim
        for i in range(config.layers):
            last = i == config.layers - 1
            d_out = num_classes if last else config.hidden
            if config.model == "graphsage":
                layer: nn.Module = SAGEConv(d_in, d_out, slot=i)
            elif config.model == "gcn":
                layer = GCNConv(d_in, d_out, slot=i)
            else:
                layer = GATConv(d_in, d_out, config.heads, slot=i, concat=not last)
                d_out = d_out * (1 if last else config.heads)
            self.layers.append(layer)
            if not last:
                self.norms.append(_norm(config.norm, d_out, reduce))
            d_in = d_out

    def parameters_in_forward_order(self) -> list[nn.Parameter]:
        """Layer 0, norm 0, layer 1, ...: backward produces their gradients in reverse."""
        modules = [m for i, layer in enumerate(self.layers) for m in (layer, *self.norms[i : i + 1])]
        return [p for m in modules for p in m.parameters()]

    def forward(self, x: Tensor, g: EpochGraph, x_agg: Tensor | None = None) -> Tensor:
        # GCN with the precomputed first aggregation never reads x itself: no mask to draw for it.
        reads_x = x_agg is None or self.layers[0].reads_x_with_x_agg
        h = dropout(x, self.dropout, self.training) if reads_x else x
        for i, layer in enumerate(self.layers):
            if i == 0 and x_agg is not None:
                h = layer(h, g, dropout(x_agg, self.dropout, self.training))
            else:
                h = layer(h, g)
            if i < len(self.norms):
                h = self._between_layers(self.norms[i], h)
        return h

    def _between_layers(self, norm: nn.Module, h: Tensor) -> Tensor:
        """norm -> activation -> the next layer's input dropout; one fused pass for layer norm + ReLU."""
        if isinstance(norm, nn.LayerNorm) and self.activation is F.relu:
            return layer_norm_relu_dropout(h, norm.weight, norm.bias, norm.eps, self.dropout, self.training)
        return dropout(self.activation(norm(h)), self.dropout, self.training)


def _norm(kind: str, dim: int, reduce: Callable[[Tensor], Tensor]) -> nn.Module:
    if kind == "layer":
        return nn.LayerNorm(dim)
    if kind == "batch":
        return SyncBatchNorm(dim, reduce)
    return nn.Identity()
