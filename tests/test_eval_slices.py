"""Evaluation in column slices (bnsgcn.run.evaluate, bnsgcn.exchange.sliced): the same logits as
the unsliced pass and as the dense float64 reference, for every model, with direct and node-aware exchange; smaller
buffers in the memory report."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bnsgcn.comm.plan import ExchangePlan, Relay
from bnsgcn.data.format import load_partition
from bnsgcn.exchange.sliced import slice_width
from bnsgcn.metrics import report
from bnsgcn.run import evaluate

from .helpers import reference
from .helpers.graphs import partition, random_graph
from .helpers.ranks import run_ranks

VARIANTS = [("graphsage", True), ("graphsage", False), ("gcn", True), ("gcn", False), ("gat", False)]
ONE_COLUMN = 1e-7  # MiB: every slice one column (of every head, for gat)
A_FEW_COLUMNS = 3e-4  # MiB (315 bytes): slices of a few columns, the last one narrower
LOGITS = evaluate.Evaluation.logits  # as imported: record_logits replaces it in a rank


def record_logits():
    """Inside a rank (``instrument`` of run_ranks): each evaluation also runs unsliced; the
    result is, per evaluation, (sliced logits, unsliced logits, slices taken)."""
    records = []

    def both(self, model, graph, plan, x, x_agg):
        sliced = LOGITS(self, model, graph, plan, x, x_agg)
        slices = self.slices
        unsliced = LOGITS(evaluate.Evaluation(self.comm, 0), model, graph, plan, x, x_agg)
        records.append((sliced.numpy().copy(), unsliced.numpy().copy(), slices))
        return sliced

    evaluate.Evaluation.logits = both
    return lambda: records


def _check_logits(configs, results, graph, world):
    """Every evaluation's sliced logits equal the unsliced ones; the last equals the dense
    reference with the run's final parameters."""
    a = reference.dense_adjacency(graph)
    x = torch.from_numpy(graph.features).double()
    inner = [np.asarray(load_partition(configs[0].data.parts_dir, r)["inner_nodes"]) for r in range(world)]
    for i, config in enumerate(configs):
        params = {k: torch.from_numpy(v).double() for k, v in results[0][i]["params"].items()}
        expected = reference.forward(config, a, params, x)
        for rank in range(world):
            records = results[rank][i]["instrumented"]
            assert records, "no evaluation ran"
            for sliced, unsliced, slices in records:
                label = (
                    f"{config.model.name} precompute={config.model.use_precompute} {config.exchange.mode} "
                    f"buffer={config.evaluation.buffer_mib} rank {rank}"
                )
                assert slices > config.model.layers, label  # really sliced: several slices per exchanging layer
                # bit-identical: each output column is the same sum, in the same order, whatever the slice
                np.testing.assert_array_equal(sliced, unsliced, err_msg=label)
            np.testing.assert_allclose(
                records[-1][0], expected[inner[rank]].numpy(), rtol=1e-4, atol=1e-5, err_msg=label
            )


@pytest.mark.parametrize("buffer_mib", [ONE_COLUMN, A_FEW_COLUMNS])
def test_sliced_evaluation_equals_unsliced_and_reference(tmp_path, buffer_mib):
    world = 3
    graph = random_graph(num_nodes=60, avg_degree=5, seed=21)
    parts = partition(graph, world, tmp_path / "parts", method="random")
    configs = [
        reference.exact_config(
            m, pre, parts, tmp_path / f"run-{m}-{pre}", epochs=1, eval_buffer_mib=buffer_mib, exchange="direct"
        )
        for m, pre in VARIANTS
    ]
    results = run_ranks(world, configs, instrument=record_logits)
    _check_logits(configs, results, graph, world)


def test_sliced_evaluation_with_node_aware_exchange(tmp_path):
    """Two emulated machines of two ranks: rows cross once per machine and are relayed."""
    world = 4
    graph = random_graph(num_nodes=80, avg_degree=5, seed=22)
    parts = partition(graph, world, tmp_path / "parts", method="random")
    configs = [
        reference.exact_config(
            m, pre, parts, tmp_path / f"run-{m}-{pre}", epochs=1, eval_buffer_mib=ONE_COLUMN, exchange="hierarchical"
        )
        for m, pre in [("graphsage", False), ("gcn", True), ("gat", False)]
    ]
    results = run_ranks(world, configs, nodes=[0, 0, 1, 1], instrument=record_logits)
    _check_logits(configs, results, graph, world)


def test_slice_width_bounds_both_buffers():
    """Columns per slice: the send buffer (rows sent and relayed) and the receive buffer
    each at most the budget, at least one column, at most all of them."""

    def plan(sent: int, received: int, relayed: int | None = None) -> ExchangePlan:
        relay = (
            None
            if relayed is None
            else Relay(
                torch.zeros(relayed, dtype=torch.int64), [relayed], [0], torch.zeros(received, dtype=torch.int64)
            )
        )
        return ExchangePlan(torch.zeros(sent, dtype=torch.int64), [sent], [received], relay)

    assert slice_width(plan(10, 20), (64,), 4, 20 * 4 * 5) == 5  # receive-bound
    assert slice_width(plan(40, 20), (64,), 4, 20 * 4 * 5) == 2  # send-bound
    assert slice_width(plan(10, 20, relayed=80), (64,), 4, 20 * 4 * 5) == 1  # relay-bound
    assert slice_width(plan(10, 20), (4, 16), 4, 20 * 4 * 4 * 3) == 3  # gat: a column of every head
    assert slice_width(plan(10, 20), (64,), 4, 1) == 1  # at least one column
    assert slice_width(plan(10, 20), (64,), 4, 1 << 30) == 64  # at most all
    assert slice_width(plan(0, 0), (8,), 4, 16) == 4  # no boundary row: no division by 0


def test_report_shows_smaller_evaluation_buffers(tmp_path):
    """Same run sliced and unsliced: the same scores, smaller evaluation buffers in the
    report, training's exchange buffers unchanged."""
    graph = random_graph(num_nodes=120, avg_degree=6, features=16, seed=23)
    parts = partition(graph, 2, tmp_path / "parts", method="random")
    budget = 1e-3  # MiB (1,048 bytes): a few of 16 columns
    configs = [
        reference.exact_config(
            "graphsage",
            False,
            parts,
            tmp_path / f"buffer-{mib}",
            hidden=16,
            epochs=2,
            eval_every=1,
            eval_buffer_mib=mib,
        )
        for mib in (0.0, budget)
    ]
    results = run_ranks(2, configs)
    assert results[0][1]["best_val_score"] == results[0][0]["best_val_score"]
    unsliced, sliced = (report.load(c.run.out)["ranks"] for c in configs)
    for whole, part in zip(unsliced, sliced):
        assert 0 < part["evaluation_buffer_bytes"] <= 2 * budget * 2**20 < whole["evaluation_buffer_bytes"]
        assert part["exchange_buffer_bytes"] == whole["exchange_buffer_bytes"] > 0
