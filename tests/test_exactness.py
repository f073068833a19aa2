"""With p = 1 and no dropout, partition-parallel training equals single-process training."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from bnsgcn.config import TrainConfig

from . import reference
from .distributed import partition, random_graph, run_ranks

VARIANTS = [("graphsage", True), ("graphsage", False), ("gcn", True), ("gcn", False), ("gat", False)]


def _config(model: str, precompute: bool, parts_dir, out, norm="layer") -> TrainConfig:
    return TrainConfig(
        parts_dir=parts_dir, p=1.0, model=model, layers=3, hidden=8, heads=2, dropout=0.0, norm=norm,
        lr=0.01, epochs=4, eval_every=0, precompute=precompute, device="cpu", out=out, seed=3,
    )


def _bias_before_norm(name: str, layers: int) -> bool:
    return name.endswith("bias") and name.startswith("layers.") and int(name.split(".")[1]) < layers - 1


@pytest.mark.parametrize("world", [2, 3, 4])
def test_p1_matches_single_process(tmp_path, world):
    graph = random_graph(num_nodes=48, seed=world)
    parts = partition(graph, world, tmp_path / "parts", method="random")
    configs = [_config(m, pre, parts, tmp_path / f"run-{m}-{pre}") for m, pre in VARIANTS]
    configs.append(_config("graphsage", False, parts, tmp_path / "run-batchnorm", norm="batch"))
    results = run_ranks(world, configs)
    for i, config in enumerate(configs):
        ref_losses, ref_params = reference.train(config, graph)
        lines = [json.loads(l) for l in (config.out / "metrics.jsonl").read_text().splitlines()]
        losses = [l["loss"] for l in lines if "loss" in l]
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6), (config.model, config.use_precompute)
        for rank in range(world):  # every rank holds the same, correct parameters
            params = results[rank][i]["params"]
            for name, ref in ref_params.items():
                if config.norm == "batch" and _bias_before_norm(name, config.layers):
                    continue  # batch norm cancels it: its true gradient is 0 and Adam turns float noise into steps
                torch.testing.assert_close(torch.from_numpy(params[name]).double(), ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"{config.model} {config.norm} {name}: {m}")


def test_p1_inductive_and_multilabel_match_single_process(tmp_path):
    """Inductive mode trains on the train-induced subgraph with its own degrees; multi-label
    tasks use a summed binary cross-entropy."""
    graph = random_graph(num_nodes=64, avg_degree=6, seed=7)
    multilabel = random_graph(num_nodes=64, avg_degree=6, seed=8, multilabel=True, classes=4)
    parts = partition(graph, 2, tmp_path / "parts", method="random")
    parts_ml = partition(multilabel, 2, tmp_path / "parts-ml", method="random")
    configs = [
        replace(_config("graphsage", True, parts, tmp_path / "inductive-pre"), inductive=True),
        replace(_config("gcn", False, parts, tmp_path / "inductive"), inductive=True),
        _config("graphsage", False, parts_ml, tmp_path / "multilabel"),
    ]
    results = run_ranks(2, configs)
    references = [reference.induced_by_train_nodes(graph)] * 2 + [multilabel]
    for i, (config, ref_graph) in enumerate(zip(configs, references)):
        ref_losses, ref_params = reference.train(config, ref_graph)
        lines = [json.loads(l) for l in (config.out / "metrics.jsonl").read_text().splitlines()]
        assert [l["loss"] for l in lines if "loss" in l] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        for name, ref in ref_params.items():
            torch.testing.assert_close(torch.from_numpy(results[0][i]["params"][name]).double(), ref, rtol=1e-4, atol=1e-5)
