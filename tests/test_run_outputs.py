"""What a run writes (metrics.jsonl, its --log-json copy, config.json), how it scores, and
gradient reduction in several buckets."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from bnsgcn.comm.communicator import Comm
from bnsgcn.config import TrainConfig, validate
from bnsgcn.errors import UserError
from bnsgcn.nn.model import GNN
from bnsgcn.run.train import _score_counts, _scores
from bnsgcn.sync.reducer import GradientReducer

from .helpers import reference
from .helpers.graphs import partition, random_graph
from .helpers.ranks import run_ranks

TIME_KEYS = {
    "epoch",
    "sampling",
    "exchange",
    "compute",
    "reduction",
    "evaluation",
    "idle",
    "injected_delay",
    "sync",
    "elapsed",
}
SCORE_KEYS = {"train_score", "val_score", "test_score"}


def test_metrics_log_json_and_config(tmp_path):
    graph = random_graph(num_nodes=80, seed=6)
    parts = partition(graph, 2, tmp_path / "parts")
    run_dir, copy = tmp_path / "run", tmp_path / "copy.jsonl"
    # precompute left to the run (None): config.json must say what it chose
    config = TrainConfig.from_settings(
        parts_dir=parts,
        p=0.5,
        model="graphsage",
        layers=2,
        hidden=8,
        dropout=0.2,
        epochs=5,
        eval_every=2,
        device="cpu",
        out=run_dir,
        log_json=copy,
        seed=4,
    )
    run_ranks(2, [config])

    text = (run_dir / "metrics.jsonl").read_text()
    assert copy.read_text() == text
    records = [json.loads(line) for line in text.splitlines()]
    epochs, summary = records[:-1], records[-1]
    assert [r["epoch"] for r in epochs] == list(range(1, config.run.epochs + 1))
    evaluated = [r for r in epochs if SCORE_KEYS <= r.keys()]
    assert [r["epoch"] for r in evaluated] == [2, 4, 5]  # every eval_every epochs, and the last
    for r in epochs:
        assert math.isfinite(r["loss"]) and r["loss"] > 0
        assert r["time"].keys() == TIME_KEYS
        assert r["time"]["epoch"] > 0 and all(v >= 0 for v in r["time"].values())
        # every byte one rank sends, another receives
        assert r["bytes_sent"] == r["bytes_received"] == sum(r["bytes_sent_by_kind"].values()) > 0
        if r not in evaluated:
            assert not SCORE_KEYS & r.keys()
    for r in evaluated:
        assert all(0.0 <= r[k] <= 1.0 for k in SCORE_KEYS)

    best = max(evaluated, key=lambda r: r["val_score"])  # the first of equal scores, as the run keeps
    assert summary["summary"] is True
    assert summary["best_val_score"] == best["val_score"]
    assert summary["best_epoch"] == best["epoch"]
    assert summary["test_score"] == best["test_score"]
    assert summary["final_loss"] == epochs[-1]["loss"]

    written = json.loads((run_dir / "config.json").read_text())
    assert written["precompute"] is True  # graphsage's default
    assert written["out"] == str(run_dir)
    assert written["device"] == "cpu"
    assert written["threads"] == 1  # what the ranks of tests/helpers/ranks.py run with
    assert written["world_size"] == 2


def _shard(labels, logits_rows: int, multilabel: bool) -> SimpleNamespace:
    """Node 0 and 1 train, node 2 validation, node 3 test."""
    masks = [torch.tensor([i in split for i in range(logits_rows)]) for split in ((0, 1), (2,), (3,))]
    return SimpleNamespace(
        labels=labels, multilabel=multilabel, train_mask=masks[0], val_mask=masks[1], test_mask=masks[2]
    )


def test_micro_f1_counts_and_scores():
    logits = torch.tensor([[2.0, -1.0, 3.0], [-2.0, 1.0, -1.0], [1.0, 1.0, -3.0], [-1.0, -2.0, 4.0]])
    labels = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 0.0], [0.0, 1.0, 1.0], [0.0, 0.0, 1.0]])
    # predicted (logit > 0) vs true per node: 0: {0,2} vs {0,1}; 1: {1} vs {1}; 2: {0,1} vs {1,2}; 3: {2} vs {2}
    # train (nodes 0, 1): tp 2, fp 1, fn 1; validation (node 2): tp 1, fp 1, fn 1; test (node 3): tp 1
    counts = _score_counts(logits, _shard(labels, 4, multilabel=True))
    torch.testing.assert_close(
        counts, torch.tensor([[2.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    )
    # micro-F1 = 2 tp / (2 tp + fp + fn)
    assert _scores(counts, multilabel=True) == pytest.approx(
        {"train_score": 4 / 6, "val_score": 2 / 4, "test_score": 1.0}
    )


def test_accuracy_counts_and_scores():
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 1.0], [1.0, -1.0]])
    labels = torch.tensor([0, 1, 1, 0])  # argmax 0, 1, 0, 0: node 2 is wrong
    counts = _score_counts(logits, _shard(labels, 4, multilabel=False))
    torch.testing.assert_close(
        counts, torch.tensor([[2.0, 2.0, 0.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    )
    assert _scores(counts, multilabel=False) == {"train_score": 1.0, "val_score": 0.0, "test_score": 1.0}


def test_several_gradient_buckets_match_single_process(tmp_path):
    graph = random_graph(num_nodes=48, seed=2)
    parts = partition(graph, 2, tmp_path / "parts")
    tiny = 256 / 2**20  # MiB: a few parameter tensors per bucket
    configs = [
        reference.exact_config(model, False, parts, tmp_path / f"run-{model}", bucket_mb=tiny)
        for model in ("graphsage", "gat")
    ]
    one_rank = Comm(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), timeout=1.0)
    for config in configs:  # the ranks build the same reducer: it has several buckets
        torch.manual_seed(config.run.seed)
        model = GNN(config, graph.features.shape[1], graph.num_classes, lambda t: t)
        assert (
            len(GradientReducer(model.parameters_in_forward_order(), one_rank, config.sync.bucket_bytes).buckets) >= 3
        )
    results = run_ranks(2, configs)
    for i, config in enumerate(configs):
        reference.assert_run_matches(config, graph, [results[rank][i]["params"] for rank in range(2)])


def test_buckets_follow_the_order_backward_produces_gradients():
    config = TrainConfig.from_settings(model="graphsage", layers=4, hidden=256, norm="layer")
    model = GNN(config, 602, 41, lambda t: t)  # Reddit's widths
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for p in model.parameters_in_forward_order()]
    assert sorted(order) == sorted(names.values())  # every parameter, once
    blocks = list(dict.fromkeys(".".join(n.split(".")[:2]) for n in order))
    assert blocks == ["layers.0", "norms.0", "layers.1", "norms.1", "layers.2", "norms.2", "layers.3"]
    one_rank = Comm(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), timeout=1.0)
    buckets = GradientReducer(model.parameters_in_forward_order(), one_rank, config.sync.bucket_bytes).buckets
    assert len(buckets) >= 2  # the default size lets reduction start before backward ends
    assert names[id(buckets[0][0])].startswith("layers.3.")  # the first gradients backward produces


def test_bucket_size_must_be_positive():
    with pytest.raises(UserError, match="--bucket-mb 0.0 must be positive"):
        validate(TrainConfig.from_settings(bucket_mb=0.0))
