"""A dense, single-process implementation of the three models, written independently of
the engine's layers and kernels: the ground truth for the exactness tests, and the check
of a partition-parallel run against it (of another model too, given its dense forward)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from bnsgcn.config import TrainConfig
from bnsgcn.nn.model import build_model
from bnsgcn.partition.graph import Graph, canonical_csr


def dense_adjacency(graph: Graph) -> Tensor:
    """A[v, u] = 1 for every edge u -> v, plus self-loops; float64 [N, N]."""
    n = graph.num_nodes
    a = torch.zeros(n, n, dtype=torch.float64)
    rows = torch.repeat_interleave(torch.arange(n), torch.from_numpy(graph.in_degree()))
    a[rows, torch.from_numpy(graph.indices.astype("int64"))] = 1.0
    return a + torch.eye(n, dtype=torch.float64)


def induced_by_train_nodes(graph: Graph) -> Graph:
    """The subgraph induced by the training nodes (all of them training nodes)."""
    keep = graph.train_mask
    new_id = np.cumsum(keep) - 1
    rows = np.repeat(np.arange(graph.num_nodes), graph.in_degree())
    edge = keep[rows] & keep[graph.indices]
    indptr, indices, _ = canonical_csr(new_id[graph.indices[edge]], new_id[rows[edge]], int(keep.sum()))
    ones = np.ones(int(keep.sum()), dtype=bool)
    return Graph(
        "induced",
        indptr,
        indices,
        graph.features[keep],
        graph.labels[keep],
        ones,
        ~ones,
        ~ones,
        graph.num_classes,
        graph.multilabel,
    )


def initial_params(config: TrainConfig, graph: Graph) -> dict[str, Tensor]:
    """The parameters every rank starts from (same seed, same constructor)."""
    torch.manual_seed(config.run.seed)
    model = build_model(config, graph.features.shape[1], graph.num_classes, lambda t: t)
    return {k: v.detach().double().clone() for k, v in model.state_dict().items()}


def forward(config: TrainConfig, a: Tensor, params: dict[str, Tensor], x: Tensor) -> Tensor:
    deg = a.sum(1)
    h = x
    for i in range(config.model.layers):
        last = i == config.model.layers - 1
        p = {k.split(".", 2)[2]: v for k, v in params.items() if k.startswith(f"layers.{i}.")}
        if config.model.name == "graphsage":
            h = h @ p["lin_self.weight"].T + p["lin_self.bias"] + (a / deg[:, None]) @ h @ p["lin_neigh.weight"].T
        elif config.model.name == "gcn":
            norm = a / torch.sqrt(deg[:, None] * deg[None, :])
            h = norm @ h @ p["lin.weight"].T + p["bias"]
        else:
            heads = config.model.heads
            z = (h @ p["lin.weight"].T).view(h.shape[0], heads, -1)
            s_src = (z * p["att_src"]).sum(-1)
            s_dst = (z * p["att_dst"]).sum(-1)
            e = F.leaky_relu(s_dst[:, None, :] + s_src[None, :, :], 0.2)  # [v, u, head]
            e = e.masked_fill(a[:, :, None] == 0, float("-inf"))
            alpha = torch.softmax(e, dim=1)
            out = torch.einsum("vuh,uhd->vhd", alpha, z)
            h = (out.mean(1) if last else out.reshape(out.shape[0], -1)) + p["bias"]
        if not last:
            if config.model.norm == "layer":
                h = F.layer_norm(h, h.shape[1:], params[f"norms.{i}.weight"], params[f"norms.{i}.bias"])
            elif config.model.norm == "batch":
                mean, var = h.mean(0), h.var(0, unbiased=False)
                h = (h - mean) / torch.sqrt(var + 1e-5) * params[f"norms.{i}.weight"] + params[f"norms.{i}.bias"]
            h = F.elu(h) if config.model.name == "gat" else F.relu(h)
    return h


def train(config: TrainConfig, graph: Graph, model_forward=forward) -> tuple[list[float], dict[str, Tensor]]:
    """Full-graph training in one process, float64: losses per epoch and final parameters.
    ``model_forward(config, a, params, x)``: the model's dense forward (default: the built-in ones)."""
    a = dense_adjacency(graph)
    x = torch.from_numpy(graph.features).double()
    labels = torch.from_numpy(graph.labels)
    train_mask = torch.from_numpy(graph.train_mask)
    params = {k: v.requires_grad_(True) for k, v in initial_params(config, graph).items() if "running" not in k}
    opt, schedule = torch_optimizer(config, list(params.values()))
    losses = []
    for _ in range(config.run.epochs):
        logits = model_forward(config, a, params, x)
        if graph.multilabel:
            loss = F.binary_cross_entropy_with_logits(
                logits[train_mask], labels[train_mask].double(), reduction="sum"
            ) / int(train_mask.sum())
        else:
            loss = F.cross_entropy(logits[train_mask], labels[train_mask])
        opt.zero_grad()
        loss.backward()
        if config.optim.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params.values(), config.optim.grad_clip)
        opt.step()
        if schedule is not None:
            schedule.step()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in params.items()}


def torch_optimizer(config: TrainConfig, params: list[Tensor]):
    """``torch.optim``'s optimizer for the run's ``--optimizer`` and its scheduler (stepped once
    per epoch; None for a constant rate) for ``--warmup-epochs`` and ``--lr-schedule`` none,
    cosine or step: the engine's schedules written with torch's own (plateau needs the
    validation scores, which this trainer does not compute)."""
    o = config.optim
    if o.name == "sgd":
        opt = torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov, weight_decay=o.weight_decay)
    else:
        opt = (torch.optim.AdamW if o.name == "adamw" else torch.optim.Adam)(
            params, lr=o.lr, weight_decay=o.weight_decay
        )
    assert o.lr_schedule != "plateau", "the reference has no validation scores"
    lr_scheduler = torch.optim.lr_scheduler
    main = {
        "none": None,
        "cosine": lambda: lr_scheduler.CosineAnnealingLR(opt, T_max=o.cosine_length(config.run.epochs)),
        "step": lambda: lr_scheduler.StepLR(opt, step_size=o.lr_step_epochs, gamma=o.lr_gamma),
    }[o.lr_schedule]
    if not o.warmup_epochs:
        return opt, main() if main else None
    warmup = lr_scheduler.LinearLR(opt, start_factor=1 / (o.warmup_epochs + 1), total_iters=o.warmup_epochs)
    if main is None:
        return opt, warmup
    return opt, lr_scheduler.SequentialLR(opt, [warmup, main()], milestones=[o.warmup_epochs])


# (model, --precompute) of the exactness tests; GAT without: --precompute is refused for it (not exact)
VARIANTS = [
    ("graphsage", True),
    ("graphsage", False),
    ("gcn", True),
    ("gcn", False),
    ("gat", False),
]


def exact_config(model: str, precompute: bool, parts_dir, out, **overrides) -> TrainConfig:
    """A small configuration under which a partition-parallel run must equal :func:`train`:
    p = 1 and no dropout."""
    base = dict(
        parts_dir=parts_dir,
        p=1.0,
        model=model,
        layers=3,
        hidden=8,
        heads=2,
        dropout=0.0,
        norm="layer",
        lr=0.01,
        epochs=4,
        eval_every=0,
        precompute=precompute,
        device="cpu",
        out=out,
        seed=3,
    )
    return TrainConfig.from_settings(**(base | overrides))


def _bias_before_norm(name: str, layers: int) -> bool:
    return name.endswith("bias") and name.startswith("layers.") and int(name.split(".")[1]) < layers - 1


def assert_run_matches(config: TrainConfig, graph: Graph, params_by_rank: list[dict], model_forward=forward) -> None:
    """The run of ``config`` (losses in its metrics.jsonl; every rank's final parameters,
    numpy arrays by name) equals :func:`train` on ``graph`` (with ``model_forward``)."""
    ref_losses, ref_params = train(config, graph, model_forward)
    lines = [json.loads(line) for line in (config.run.out / "metrics.jsonl").read_text().splitlines()]
    losses = [line["loss"] for line in lines if "loss" in line]
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6), (
        config.model.name,
        config.model.use_precompute,
        config.model.norm,
    )
    for params in params_by_rank:  # every rank holds the same, correct parameters
        for name, ref in ref_params.items():
            if config.model.norm == "batch" and _bias_before_norm(name, config.model.layers):
                continue  # batch norm cancels it: its true gradient is 0 and Adam turns float noise into steps
            torch.testing.assert_close(
                torch.from_numpy(params[name]).double(),
                ref,
                rtol=1e-4,
                atol=1e-5,
                msg=lambda m: f"{config.model.name} {config.model.norm} {name}: {m}",
            )
