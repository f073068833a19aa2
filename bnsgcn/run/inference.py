"""A trained model outside training: a run's model, and its logits over the whole graph in
one process (what ``bnsgcn.train`` returns, docs/api.md).

The whole graph is put back together from the partition set: every edge and self-loop is
stored once, in the row of its destination in the partition that owns it
(docs/partition-format.md), so the rows of all partitions, their columns mapped to global
ids, are the graph's CSR. The graph, its features and the logits must fit in this process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from bnsgcn.comm.plan import full_plan
from bnsgcn.config import SETTINGS, TrainConfig
from bnsgcn.data.format import load_partition, read_manifest
from bnsgcn.data.shard import Topology
from bnsgcn.errors import UserError
from bnsgcn.exchange import LocalExchange
from bnsgcn.nn.layers import shard_graph
from bnsgcn.nn.model import build_model, run_model

MODEL_FILE = "best_model.pt"


@dataclass
class WholeGraph:
    """A partition set's graph in its global node ids.

    ``indptr`` int64 [N+1] and ``indices`` int32 [nnz]: the in-edges of every node, self-loop
    included, ascending sources; ``features`` float32 [N, F]; ``labels`` int64 [N] or uint8
    [N, C] (multi-label); masks bool [N].
    """

    indptr: np.ndarray
    indices: np.ndarray
    features: np.ndarray
    labels: np.ndarray
    train_mask: np.ndarray
    val_mask: np.ndarray
    test_mask: np.ndarray

    @property
    def num_nodes(self) -> int:
        return int(self.indptr.shape[0] - 1)


def read_whole_graph(parts_dir: Path) -> WholeGraph:
    """The graph of the partition set at ``parts_dir``, from all its partitions (checked as a
    rank checks its own, :func:`bnsgcn.data.format.load_partition`)."""
    manifest = read_manifest(parts_dir)
    dataset = manifest["dataset"]
    n = int(dataset["num_nodes"])
    labels_shape = (n, dataset["num_classes"]) if dataset.get("multilabel") else (n,)
    features = np.zeros((n, dataset["num_features"]), dtype=np.float32)
    labels = np.zeros(labels_shape, dtype=np.uint8 if dataset.get("multilabel") else np.int64)
    masks = {name: np.zeros(n, dtype=bool) for name in ("train_mask", "val_mask", "test_mask")}
    destinations, sources = [], []
    for part in range(manifest["parts"]):
        arrays = load_partition(parts_dir, part)
        inner = arrays["inner_nodes"]
        columns = np.concatenate([inner, arrays["boundary_nodes"]])
        destinations.append(np.repeat(inner, np.diff(arrays["adj_indptr"])))
        sources.append(columns[arrays["adj_indices"]])
        features[inner] = arrays["features"]
        labels[inner] = arrays["labels"]
        for name, mask in masks.items():
            mask[inner] = arrays[name]
    dst, src = np.concatenate(destinations), np.concatenate(sources)
    order = np.lexsort((src, dst))
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=n), out=indptr[1:])
    return WholeGraph(indptr, src[order].astype(np.int32), features, labels, **masks)


def run_config(run_dir: Path) -> TrainConfig:
    """The configuration a run recorded (its ``config.json``: every setting, resolved)."""
    path = Path(run_dir) / "config.json"
    try:
        recorded = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{path} cannot be read ({exc}); is {run_dir} a finished run directory?") from None
    settings = {k: v for k, v in recorded.items() if k in SETTINGS}  # config.json adds the job's layout
    for name in ("parts_dir", "out", "log_json"):
        if settings.get(name) is not None:
            settings[name] = Path(settings[name])
    return TrainConfig.from_settings(**settings)


def load_model(run_dir: Path) -> tuple[torch.nn.Module, TrainConfig]:
    """The model of a finished run, on the CPU in eval mode, with the parameters of its best
    validation epoch (``best_model.pt``), and the run's configuration."""
    config = run_config(run_dir)
    dataset = read_manifest(config.data.parts_dir)["dataset"]
    model = build_model(config, dataset["num_features"], dataset["num_classes"], lambda t: t)
    path = Path(run_dir) / MODEL_FILE
    if not path.is_file():
        raise UserError(f"{path} is missing: the run did not finish an evaluation")
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return model.eval(), config


@torch.no_grad()
def whole_graph_logits(model: torch.nn.Module, config: TrainConfig, graph: WholeGraph) -> Tensor:
    """Logits float32 [N, C] of ``model`` (the settings ``config``) over every node of ``graph``,
    in global node order: evaluation's forward pass (no sampling, no dropout) over one
    partition holding every node, so no row crosses between ranks."""
    device = torch.device("cpu")
    n = graph.num_nodes
    topology = Topology(
        n_inner=n,
        indptr=torch.from_numpy(graph.indptr),
        indices=torch.from_numpy(graph.indices),
        degree=torch.from_numpy(np.diff(graph.indptr).astype(np.float32)),  # self-loop included
        boundary_counts=[0],
        send_nodes=torch.empty(0, dtype=torch.int64),
        send_counts=[0],
    )
    adjacency = shard_graph(topology, config.model.name, device)
    x = torch.from_numpy(graph.features)
    x_agg = adjacency.aggregate(x, x.new_zeros((0, x.shape[1]))) if config.model.use_precompute else None
    epoch = adjacency.epoch(torch.zeros(0, dtype=torch.bool), 1.0, full_plan(topology, device), LocalExchange())
    model.eval()
    return run_model(model, x, epoch, x_agg)
