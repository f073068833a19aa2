"""The node order within partitions (``bnsgcn.partition.order``): blocks of nodes that share
neighbours, found by METIS or, where METIS would not fit, by label propagation; exact
training on a set written in that order."""

from __future__ import annotations

import numpy as np
import pytest

import bnsgcn.partition.order as order_module
from bnsgcn.data.format import load_partition, read_manifest
from bnsgcn.errors import UserError
from bnsgcn.partition.graph import Graph
from bnsgcn.partition.order import block_positions
from bnsgcn.partition.partitioner import assign, method_info
from bnsgcn.partition.writer import find_reusable, write_partition_set

from .helpers import reference
from .helpers.graphs import community_graph, random_graph
from .helpers.ranks import run_ranks
from .helpers.reference import VARIANTS


def near_fraction(graph: Graph, assignment: np.ndarray, position: np.ndarray, window: int) -> float:
    """Share of the edges inside a partition whose two ends lie within ``window`` places of each other."""
    rows = np.repeat(np.arange(graph.num_nodes), graph.in_degree())
    cols = graph.indices.astype(np.int64)
    inside = assignment[rows] == assignment[cols]
    return float(np.mean(np.abs(position[rows[inside]] - position[cols[inside]]) < window))


def id_positions(assignment: np.ndarray) -> np.ndarray:
    """Each node's place among its partition's nodes in ascending id (the order without blocks)."""
    position = np.empty(assignment.shape[0], dtype=np.int64)
    for k in np.unique(assignment):
        nodes = np.flatnonzero(assignment == k)
        position[nodes] = np.arange(nodes.shape[0])
    return position


@pytest.mark.parametrize("case", ["metis", "memory", "many blocks"])
def test_blocks_put_neighbours_near_each_other(monkeypatch, case):
    """METIS finds the blocks; label propagation does where METIS would not fit the memory
    or would have too many blocks to find."""
    monkeypatch.setattr(order_module, "BLOCK_NODES", 100)
    if case == "many blocks":
        monkeypatch.setattr(order_module, "METIS_MAX_BLOCKS", 9)  # each partition has 10 blocks
    graph = community_graph()
    assignment = assign(graph, 2, "metis", "cut", 0)
    limit = 1 if case == "memory" else None  # 1 byte: METIS never fits
    position, blocks = block_positions(graph, assignment, 2, seed=3, memory_limit=limit, progress=False)
    assert blocks == {"block_nodes": 100, "parts": ["metis" if case == "metis" else "label propagation"] * 2}

    # a permutation of 0 .. n_k - 1 within every partition
    for k in range(2):
        assert np.array_equal(np.sort(position[assignment == k]), np.arange(int((assignment == k).sum())))
    # the same seed gives the same order
    again, _ = block_positions(graph, assignment, 2, seed=3, memory_limit=limit, progress=False)
    assert np.array_equal(position, again)

    # in id order about 2 blocks / n_k of the edges (0.2) join nodes less than a block apart; in blocks, 0.57-0.69
    blocked, by_id = (
        near_fraction(graph, assignment, position, 100),
        near_fraction(graph, assignment, id_positions(assignment), 100),
    )
    assert blocked > 2.5 * by_id, (blocked, by_id)


def test_p1_matches_single_process_in_block_order(tmp_path, monkeypatch):
    """Every model, p = 1, on a set whose partitions are in block order (several blocks each):
    the rows' order changes nothing the models compute."""
    monkeypatch.setattr(order_module, "BLOCK_NODES", 8)
    graph = random_graph(num_nodes=64, avg_degree=5, seed=21)
    assignment = assign(graph, 2, "metis", "cut", 0)
    position, blocks = block_positions(graph, assignment, 2, progress=False)
    assert blocks["parts"] == ["metis", "metis"]
    parts = tmp_path / "parts"
    write_partition_set(
        graph, assignment, parts, parts=2, method_info=method_info("metis", "cut", 0), progress=False, position=position
    )
    inner = load_partition(parts, 0)["inner_nodes"]
    assert not np.all(np.diff(inner) > 0)  # really not in id order
    configs = [reference.exact_config(m, pre, parts, tmp_path / f"run-{m}-{pre}") for m, pre in VARIANTS]
    results = run_ranks(2, configs)
    for i, config in enumerate(configs):
        reference.assert_run_matches(config, graph, [results[rank][i]["params"] for rank in range(2)])


def test_sets_from_before_node_orders_count_as_id_order(tmp_path):
    """A manifest without ``node_order`` (written before it existed) was in ascending ids: a
    request for that order reuses it, a request for blocks does not."""
    graph = random_graph(num_nodes=40, seed=2)
    info = method_info("random", "cut", 0)
    write_partition_set(
        graph, assign(graph, 2, "random", seed=0), tmp_path / "set", parts=2, method_info=info, progress=False
    )
    assert "node_order" not in read_manifest(tmp_path / "set")["partitioner"]
    assert find_reusable(tmp_path / "set", graph.name, 2, info | {"node_order": "ids"}) is not None
    with pytest.raises(UserError, match="holds a different partition set; pass --force"):
        find_reusable(tmp_path / "set", graph.name, 2, info | {"node_order": "blocks"})
