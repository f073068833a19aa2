"""Accuracy on real data: Cora, public split, METIS 4 parts, 4 ranks, p = 0.1, mean of 3 seeds.

Each model's mean over seeds 0-2 of the test accuracy at its best validation epoch must reach
its bar: GraphSAGE 0.79, GCN 0.80, GAT 0.80 (the published single-process figures are GCN
81.5%, GAT 83.0%; Cora's published GraphSAGE figure is of a different split). Training is
synchronous, so a seed's run repeats exactly on one machine; another machine's float rounding
takes another trajectory, which moves a seed's score about as much as another seed does.

120 epochs, evaluated every 4: the scores at the best validation epoch had converged by then.
Measured 2026-11-28 (2 cores, AMD EPYC; one run of 200 epochs evaluated every 2, from which
every shorter schedule is read off, training being the same whatever the schedule), mean of
seeds 0-2 and, for the spread, of seeds 3-5:

| schedule | GraphSAGE | GCN | GAT |
|---|---|---|---|
| 200 epochs, every 2 | 80.9 / 80.7 | 82.2 / 81.2 | 80.9 / 80.6 |
| 120 epochs, every 4 | 80.5 / 80.2 | 81.9 / 81.8 | 81.1 / 80.7 |

so each bar is 0.7-1.9 points below both seed triples' means (standard deviation of a seed's
score 0.6-0.8 at 120 epochs: 0.3-0.5 for a mean of three).
"""

from __future__ import annotations

import json

import numpy as np

from bnsgcn.config import TrainConfig

from .helpers.graphs import cora_metis
from .helpers.ranks import run_ranks

# (model, flags, bar)
MODELS = [
    ("graphsage", dict(hidden=16, dropout=0.5, lr=0.01), 0.79),
    ("gcn", dict(hidden=16, dropout=0.5, lr=0.01), 0.80),
    ("gat", dict(hidden=8, heads=8, dropout=0.6, lr=0.005), 0.80),
]
SEEDS = (0, 1, 2)
EPOCHS, EVAL_EVERY = 120, 4


def test_cora_accuracy_four_ranks(tmp_path):
    parts = cora_metis(4, tmp_path / "cora-4")
    configs = [
        TrainConfig.from_settings(
            parts_dir=parts,
            p=0.1,
            model=model,
            layers=2,
            norm="none",
            weight_decay=5e-4,
            epochs=EPOCHS,
            eval_every=EVAL_EVERY,
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
    print("cora test scores (best-validation epoch):", json.dumps(scores))  # pytest -rP
    for model, _, bar in MODELS:
        assert np.mean(scores[model]) >= bar, (model, scores[model])
