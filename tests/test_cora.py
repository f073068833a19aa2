"""Accuracy on real data: Cora, public split, 4 ranks, p = 0.1, mean of 3 seeds."""

from __future__ import annotations

import json

import numpy as np

from bnsgcn.config import TrainConfig
from bnsgcn.partition.datasets import load_dataset
from bnsgcn.partition.partitioner import assign, method_info
from bnsgcn.partition.writer import write_partition_set

from .helpers.graphs import SHARED_DATA
from .helpers.ranks import run_ranks

# (model, flags, bar): the published single-process figures are GCN 81.5%, GAT 83.0%
MODELS = [
    ("graphsage", dict(hidden=16, dropout=0.5, lr=0.01), 0.79),
    ("gcn", dict(hidden=16, dropout=0.5, lr=0.01), 0.80),
    ("gat", dict(hidden=8, heads=8, dropout=0.6, lr=0.005), 0.80),
]
SEEDS = (0, 1, 2)


def test_cora_accuracy_four_ranks(tmp_path):
    graph = load_dataset("cora", SHARED_DATA / "planetoid", progress=False)
    parts = tmp_path / "cora-4"
    write_partition_set(
        graph,
        assign(graph, 4, method="metis", seed=0),
        parts,
        parts=4,
        method_info=method_info("metis", "cut", 0),
        progress=False,
    )
    configs = [
        TrainConfig.from_settings(
            parts_dir=parts,
            p=0.1,
            model=model,
            layers=2,
            norm="none",
            weight_decay=5e-4,
            epochs=200,
            eval_every=2,
            seed=seed,
            device="cpu",
            out=tmp_path / f"{model}-{seed}",
            **flags,
        )
        for model, flags, _ in MODELS
        for seed in SEEDS
    ]
    run_ranks(4, configs, timeout=1200)
    scores = {}
    for config in configs:
        summary = json.loads((config.run.out / "metrics.jsonl").read_text().splitlines()[-1])
        scores.setdefault(config.model.name, []).append(summary["test_score"])
    print(
        "cora test scores (best-validation epoch):", json.dumps(scores)
    )  # recorded in docs/benchmarks.md (pytest -rP)
    for model, _, bar in MODELS:
        assert np.mean(scores[model]) >= bar, (model, scores[model])
