"""``bnsgcn.export(run_dir)``: a finished run's model as a plain ``torch.nn.Module``, no ranks.

``module(x, edge_index)`` takes the features as the dataset has them before the partition
step's preprocessing (``x`` float [N, F]) and the edges as PyG does (``edge_index`` int64
[2, E], messages flowing ``edge_index[0] -> edge_index[1]``), and returns the logits
float32 [N, C] of the model the run kept (``best_model.pt``), computed as evaluation does:

* the features' preprocessing the partition set's loader applied (its manifest's
  ``dataset.feature_preprocessing``, copied into the run's config.json): none, row
  normalisation (``x / x.sum(1)``, rows summing to 0 kept), or standardisation
  (``(x - mean) / std``, the statistics from the set's ``feature_stats.npz``, kept as buffers);
* the edges as the partition step keeps them: each once, self-loops in ``edge_index``
  dropped and one per node added (the partition step also makes a directed graph
  symmetric, which this does not: pass both directions of an undirected edge);
* each layer's normalisation by in-degrees (self-loop included): GCN's
  ``1 / sqrt(deg(u) deg(v))``, GraphSAGE's mean ``1 / deg(v)``, GAT's attention softmax over
  each node's in-edges; the norms (layer norm, batch norm's running statistics) and
  activations between layers; no dropout.

Aggregations are sparse (``index_add_`` over the edges): memory grows with E, not N^2.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bnsgcn.config import TrainConfig
from bnsgcn.data.format import NO_PREPROCESSING, ROW_NORMALISE, STANDARDISE, feature_preprocessing, read_manifest
from bnsgcn.errors import UserError
from bnsgcn.nn.layers import LAYERS
from bnsgcn.nn.model import SyncBatchNorm
from bnsgcn.nn.user_model import build_user_model
from bnsgcn.run.inference import MODEL_FILE, run_config


class FeaturePreprocessing(nn.Module):
    """What the partition step did to the features: ``kind`` none, row_normalise or
    standardise (``mean``, ``std`` float32 [F] buffers)."""

    def __init__(self, kind: str, num_features: int) -> None:
        super().__init__()
        self.kind = kind
        if kind == STANDARDISE:
            self.register_buffer("mean", torch.zeros(num_features))
            self.register_buffer("std", torch.ones(num_features))

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == ROW_NORMALISE:
            sums = x.sum(1, keepdim=True)
            return torch.where(sums > 0, x / torch.where(sums > 0, sums, torch.ones_like(sums)), x)
        if self.kind == STANDARDISE:
            return (x - self.mean) / self.std
        return x

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}"


class Edges:
    """``edge_index`` with one self-loop per node (its own dropped) and the in-degrees."""

    def __init__(self, edge_index: Tensor, num_nodes: int) -> None:
        if edge_index.dim() != 2 or edge_index.shape[0] != 2:
            raise UserError(f"edge_index has shape {list(edge_index.shape)}; pass int64 [2, E] (source, target)")
        src, dst = edge_index.to(torch.int64)
        # as the partition step: each edge once (one int64 key per edge), no self-loop of its own
        keys = torch.unique(dst[src != dst] * num_nodes + src[src != dst])
        loops = torch.arange(num_nodes, device=edge_index.device)
        self.src = torch.cat([keys % num_nodes, loops])
        self.dst = torch.cat([keys // num_nodes, loops])
        self.num_nodes = num_nodes
        self.degree = torch.bincount(self.dst, minlength=num_nodes).to(torch.float32)

    def sum_into_targets(self, values: Tensor) -> Tensor:
        """``values`` [E, ...] (one per edge) summed at each edge's target: [N, ...]."""
        out = values.new_zeros((self.num_nodes, *values.shape[1:]))
        return out.index_add_(0, self.dst, values)

    def mean(self, h: Tensor) -> Tensor:
        return self.sum_into_targets(h[self.src]) / self.degree.unsqueeze(1)

    def symmetric(self, h: Tensor) -> Tensor:
        scale = torch.rsqrt(self.degree).unsqueeze(1)
        return self.sum_into_targets((h * scale)[self.src]) * scale

    # The aggregation primitive of bnsgcn.nn.EpochGraph over the whole graph, for a model of
    # the user's own (its forward(x, graph) runs here unchanged; every node is "inner").

    def aggregate(self, h: Tensor, reduce: str = "sum", into: Tensor | None = None) -> Tensor:
        """``A h`` [N, d] for ``reduce`` ``sum``, ``mean`` or ``gcn`` (self-loops included),
        added into ``into`` in place where given."""
        if reduce == "sum":
            out = self.sum_into_targets(h[self.src])
        elif reduce == "mean":
            out = self.mean(h)
        elif reduce == "gcn":
            out = self.symmetric(h)
        else:
            raise ValueError(f"reduce={reduce!r}: pass 'sum', 'mean' or 'gcn'")
        return out if into is None else into.add_(out)

    @property
    def num_inner(self) -> int:
        return self.num_nodes

    num_sampled = 0  # every neighbour is here

    @property
    def in_degree(self) -> Tensor:
        return self.degree - 1

    @property
    def gcn_norm(self) -> Tensor:
        return torch.rsqrt(self.degree)


class GCNLayer(nn.Module):
    """:class:`bnsgcn.nn.layers.GCNConv`'s math; the same parameter names."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out, bias=False)
        self.bias = nn.Parameter(torch.zeros(d_out))

    def forward(self, h: Tensor, edges: Edges) -> Tensor:
        return edges.symmetric(self.lin(h)) + self.bias


class SAGELayer(nn.Module):
    """:class:`bnsgcn.nn.layers.SAGEConv`'s math; the same parameter names."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.lin_self = nn.Linear(d_in, d_out)
        self.lin_neigh = nn.Linear(d_in, d_out, bias=False)

    def forward(self, h: Tensor, edges: Edges) -> Tensor:
        return self.lin_self(h) + self.lin_neigh(edges.mean(h))


class GATLayer(nn.Module):
    """:class:`bnsgcn.nn.layers.GATConv`'s math (every node present: no ``1/p`` weights);
    the same parameter names."""

    def __init__(self, d_in: int, d_out: int, heads: int, concat: bool, negative_slope: float = 0.2) -> None:
        super().__init__()
        self.heads, self.d_out, self.concat, self.negative_slope = heads, d_out, concat, negative_slope
        self.lin = nn.Linear(d_in, heads * d_out, bias=False)
        self.att_src = nn.Parameter(torch.zeros(heads, d_out))
        self.att_dst = nn.Parameter(torch.zeros(heads, d_out))
        self.bias = nn.Parameter(torch.zeros(heads * d_out if concat else d_out))

    def forward(self, h: Tensor, edges: Edges) -> Tensor:
        z = self.lin(h).view(-1, self.heads, self.d_out)
        scores = (z * self.att_src).sum(-1)[edges.src] + (z * self.att_dst).sum(-1)[edges.dst]  # [E, heads]
        scores = F.leaky_relu(scores, self.negative_slope)
        top = scores.new_full((edges.num_nodes, self.heads), -torch.inf)
        top = top.scatter_reduce(0, edges.dst.unsqueeze(1).expand_as(scores), scores, "amax")
        weights = torch.exp(scores - top[edges.dst])
        total = edges.sum_into_targets(weights)
        out = edges.sum_into_targets(weights.unsqueeze(-1) * z[edges.src]) / total.unsqueeze(-1)
        out = out.reshape(out.shape[0], -1) if self.concat else out.mean(1)
        return out + self.bias


class BatchNormEval(nn.Module):
    """:class:`bnsgcn.nn.model.SyncBatchNorm` in eval mode (its running statistics)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.register_buffer("running_mean", torch.zeros(dim))
        self.register_buffer("running_var", torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return (x - self.running_mean) * torch.rsqrt(self.running_var + self.eps) * self.weight + self.bias


class ExportedGNN(nn.Module):
    """A run's GNN over a whole graph in one process (see the module): ``forward(x,
    edge_index)`` -> logits [N, C]. Its ``state_dict`` is the run's model's (same names)
    plus ``preprocessing.mean``/``std`` for standardised features."""

    def __init__(self, config: TrainConfig, num_features: int, num_classes: int, preprocessing: str) -> None:
        super().__init__()
        self.model_name = config.model.name
        self.preprocessing = FeaturePreprocessing(preprocessing, num_features)
        self.activation = LAYERS[config.model.name].activation
        self.layers = nn.ModuleList()
        self.norms = nn.ModuleList()
        d_in = num_features
        for i in range(config.model.layers):
            last = i == config.model.layers - 1
            d_out = num_classes if last else config.model.hidden
            if config.model.name == "gcn":
                layer = GCNLayer(d_in, d_out)
            elif config.model.name == "graphsage":
                layer = SAGELayer(d_in, d_out)
            else:
                layer = GATLayer(d_in, d_out, config.model.heads, concat=not last)
            self.layers.append(layer)
            d_in = layer.bias.numel() if isinstance(layer, GATLayer) else d_out
            if not last:
                self.norms.append(_norm(config.model.norm, d_in))

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        edges = Edges(edge_index, x.shape[0])
        h = self.layers[0](self.preprocessing(x.to(torch.float32)), edges)
        for norm, layer in zip(self.norms, self.layers[1:]):
            h = layer(self.activation(norm(h)), edges)
        return h


class ExportedUserModel(nn.Module):
    """A run's model of the user's own class over a whole graph in one process:
    ``forward(x, edge_index)`` -> logits [N, C], the class's ``forward(x, graph)`` given an
    :class:`Edges` for ``graph``. Its ``state_dict`` is the run's model's under ``model.``."""

    def __init__(self, model: nn.Module, num_features: int, preprocessing: str) -> None:
        super().__init__()
        self.preprocessing = FeaturePreprocessing(preprocessing, num_features)
        self.model = model

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        return self.model(self.preprocessing(x.to(torch.float32)), Edges(edge_index, x.shape[0]))


def _norm(kind: str, dim: int) -> nn.Module:
    if kind == "layer":
        return nn.LayerNorm(dim)
    if kind == "batch":
        return BatchNormEval(dim, SyncBatchNorm(dim, lambda t: t).eps)
    return nn.Identity()


def export(
    run_dir: str | os.PathLike, preprocessing: str | None = None, device: str | torch.device = "cpu"
) -> ExportedGNN | ExportedUserModel:
    """The model of the finished run in ``run_dir`` as an :class:`ExportedGNN` (a model of
    the user's own: :class:`ExportedUserModel`) on ``device``,
    in eval mode (docs/api.md).

    The features' preprocessing is the one the run recorded (config.json; for a run made
    before that was recorded, its partition set's manifest). A partition set written before
    the manifest recorded it says "unknown": export then refuses unless ``preprocessing``
    says what to do (``"none"``: use ``x`` as given, e.g. features preprocessed already).
    ``preprocessing`` also overrides a recorded "row_normalise" or "none"; "standardise"
    needs the set's statistics file."""
    run_dir = Path(run_dir)
    config = run_config(run_dir)
    path = run_dir / MODEL_FILE
    if not path.is_file():
        raise UserError(f"{path} is missing: the run did not finish an evaluation; train it to the end")
    state = torch.load(path, map_location="cpu", weights_only=True)
    recorded = json.loads((run_dir / "config.json").read_text()).get("feature_preprocessing")
    parts_dir = config.data.parts_dir
    if recorded is None:  # a run from before runs recorded it: its partition set may say
        recorded = feature_preprocessing(read_manifest(parts_dir))
    entry = {"kind": preprocessing} if preprocessing is not None else recorded
    kinds = (NO_PREPROCESSING, ROW_NORMALISE, STANDARDISE)
    if entry["kind"] not in kinds:
        if preprocessing is not None:
            raise UserError(f"preprocessing={preprocessing!r} is not one of {', '.join(kinds)}")
        raise UserError(
            f"{run_dir} does not record how its partition set's features were preprocessed ({entry['kind']}); "
            "re-partition to record it, or pass preprocessing='none' if x is given as the set holds it"
        )
    if entry["kind"] == STANDARDISE:
        entry = recorded if recorded.get("kind") == STANDARDISE else entry
        stats_path = parts_dir / entry.get("file", "")
        if "file" not in entry or not stats_path.is_file():
            raise UserError(
                f"{stats_path} with the features' mean and std is missing; pass the run's partition set "
                "(made with its statistics), or preprocessing='none' for features standardised already"
            )
        with np.load(stats_path) as stats:
            state = state | {
                "preprocessing.mean": torch.from_numpy(stats["mean"]),
                "preprocessing.std": torch.from_numpy(stats["std"]),
            }
    if not config.model.builtin:
        dataset = read_manifest(parts_dir)["dataset"]
        model = build_user_model(config, dataset["num_features"], dataset["num_classes"])
        module = ExportedUserModel(model, dataset["num_features"], entry["kind"])
        module.load_state_dict({(k if k.startswith("preprocessing.") else f"model.{k}"): v for k, v in state.items()})
        return module.to(device).eval()
    first = next(v for k, v in state.items() if k.startswith("layers.0.lin"))
    last = state[f"layers.{config.model.layers - 1}.bias"] if config.model.name != "graphsage" else None
    num_classes = (
        last.numel() if last is not None else state[f"layers.{config.model.layers - 1}.lin_self.weight"].shape[0]
    )
    module = ExportedGNN(config, first.shape[1], num_classes, entry["kind"])
    module.load_state_dict(state)
    return module.to(device).eval()
