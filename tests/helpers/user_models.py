"""Two models that are not built in, written against the public API alone (``forward(x,
graph)``, ``graph.aggregate``; docs/api.md, "Your own model"), as a user writes them: the
ranks of a test import them as ``--model tests.helpers.user_models:GIN`` and ``:APPNPNet``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class GINConv(nn.Module):
    r"""Graph isomorphism layer: :math:`h'_v = \mathrm{MLP}((1 + \epsilon) h_v + \sum_{u \in N(v)} h_u)`,
    the MLP Linear -> ReLU -> Linear."""

    def __init__(self, d_in: int, d_out: int, eps: float, train_eps: bool) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d_in, d_out), nn.ReLU(), nn.Linear(d_out, d_out))
        self.eps = nn.Parameter(torch.tensor([eps])) if train_eps else eps

    def forward(self, x: Tensor, graph) -> Tensor:
        # every row of the graph holds the node's self-loop: the sum over N(v) and v is
        # h_v + sum over N(v), so eps h_v added to it makes (1 + eps) h_v + sum over N(v)
        return self.mlp(graph.aggregate(x, "sum", into=self.eps * x))


class GIN(nn.Module):
    """``num_layers`` GIN layers (widths in -> hidden ... -> out), ReLU between them, dropout
    before each."""

    def __init__(
        self,
        in_channels: int,
        hidden_channels: int,
        out_channels: int,
        num_layers: int,
        dropout: float,
        eps: float = 0.0,
        train_eps: bool = False,
    ) -> None:
        super().__init__()
        widths = [in_channels] + [hidden_channels] * (num_layers - 1) + [out_channels]
        self.dropout = dropout
        self.convs = nn.ModuleList(GINConv(a, b, eps, train_eps) for a, b in zip(widths, widths[1:]))

    def forward(self, x: Tensor, graph) -> Tensor:
        for i, conv in enumerate(self.convs):
            x = conv(F.dropout(x, self.dropout, self.training), graph)
            if i < len(self.convs) - 1:
                x = F.relu(x)
        return x


class APPNPNet(nn.Module):
    r"""An MLP of ``num_layers`` linear layers (ReLU between them, dropout before each), then
    ``K`` steps of personalised-PageRank propagation
    :math:`h \leftarrow (1 - \alpha) \hat A h + \alpha h_0` with :math:`\hat A` GCN's
    normalisation of the graph with self-loops."""

    def __init__(
        self,
        in_channels: int,
        hidden_channels: int,
        out_channels: int,
        num_layers: int,
        dropout: float,
        K: int = 10,
        alpha: float = 0.1,
    ) -> None:
        super().__init__()
        widths = [in_channels] + [hidden_channels] * (num_layers - 1) + [out_channels]
        self.dropout, self.K, self.alpha = dropout, K, alpha
        self.lins = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x: Tensor, graph) -> Tensor:
        for i, lin in enumerate(self.lins):
            x = lin(F.dropout(x, self.dropout, self.training))
            if i < len(self.lins) - 1:
                x = F.relu(x)
        h = x
        for _ in range(self.K):  # each step one exchange of [num_inner, out_channels] rows
            h = (1 - self.alpha) * graph.aggregate(h, "gcn") + self.alpha * x
        return h
