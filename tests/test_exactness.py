"""With p = 1 and no dropout, partition-parallel training equals single-process training."""

from __future__ import annotations

import pytest

from .helpers import reference
from .helpers.graphs import partition, random_graph
from .helpers.ranks import run_ranks
from .helpers.reference import VARIANTS


@pytest.mark.parametrize("world", [2, 3, 4])
def test_p1_matches_single_process(tmp_path, world):
    graph = random_graph(num_nodes=48, seed=world)
    parts = partition(graph, world, tmp_path / "parts", method="random")
    configs = [reference.exact_config(m, pre, parts, tmp_path / f"run-{m}-{pre}") for m, pre in VARIANTS]
    configs.append(reference.exact_config("graphsage", False, parts, tmp_path / "run-batchnorm", norm="batch"))
    results = run_ranks(world, configs)
    for i, config in enumerate(configs):
        reference.assert_run_matches(config, graph, [results[rank][i]["params"] for rank in range(world)])


@pytest.mark.parametrize("world", [2, 3])
def test_p1_inductive_and_multilabel_match_single_process(tmp_path, world):
    """Inductive mode trains on the train-induced subgraph with its own degrees; multi-label
    tasks use a summed binary cross-entropy."""
    graph = random_graph(num_nodes=64, avg_degree=6, seed=7)
    multilabel = random_graph(num_nodes=64, avg_degree=6, seed=8, multilabel=True, classes=4)
    parts = partition(graph, world, tmp_path / "parts", method="random")
    parts_ml = partition(multilabel, world, tmp_path / "parts-ml", method="random")
    configs = [
        reference.exact_config("graphsage", True, parts, tmp_path / "inductive-pre", inductive=True),
        reference.exact_config("gcn", False, parts, tmp_path / "inductive", inductive=True),
        reference.exact_config("graphsage", False, parts_ml, tmp_path / "multilabel"),
    ]
    results = run_ranks(world, configs)
    references = [reference.induced_by_train_nodes(graph)] * 2 + [multilabel]
    for i, (config, ref_graph) in enumerate(zip(configs, references)):
        reference.assert_run_matches(config, ref_graph, [results[rank][i]["params"] for rank in range(world)])
