"""The node-order benchmark (benchmarks/node_order.py): its renumbering of a block-ordered
partition and a short run of it."""

from __future__ import annotations

import json

import numpy as np

import bnsgcn.partition.order as order_module
from benchmarks import node_order as bench
from bnsgcn.data.format import load_partition
from bnsgcn.data.shard import load_shard
from bnsgcn.partition.order import block_positions
from bnsgcn.partition.partitioner import assign, method_info
from bnsgcn.partition.writer import write_partition_set

from ..helpers.graphs import community_graph


def test_node_order_benchmark_renumbers_a_block_set_as_the_id_set(tmp_path, monkeypatch):
    """benchmarks/node_order.py times a partition in its own order and in ascending ids; its
    renumbering of a block-ordered partition is exactly what the writer makes in id order."""
    monkeypatch.setattr(order_module, "BLOCK_NODES", 50)
    graph = community_graph(communities=4, size=150, seed=5)
    assignment = assign(graph, 3, "metis", "cut", 0)
    position, _ = block_positions(graph, assignment, 3, progress=False)
    info = method_info("metis", "cut", 0)
    write_partition_set(
        graph,
        assignment,
        tmp_path / "blocks",
        parts=3,
        method_info=info | {"node_order": "blocks"},
        progress=False,
        position=position,
    )
    write_partition_set(graph, assignment, tmp_path / "ids", parts=3, method_info=info, progress=False)
    for k in range(3):
        blocks, ids = load_shard(tmp_path / "blocks", k, 3).topology, load_shard(tmp_path / "ids", k, 3).topology
        arrays = load_partition(tmp_path / "blocks", k)
        assert not np.array_equal(blocks.indices.numpy(), ids.indices.numpy())
        renumbered = bench.in_id_order(blocks, np.asarray(arrays["inner_nodes"]), np.asarray(arrays["boundary_nodes"]))
        for name in ("indptr", "indices", "degree"):
            assert np.array_equal(getattr(renumbered, name).numpy(), getattr(ids, name).numpy()), name

    assert (
        bench.main(
            [
                "--parts-dir",
                str(tmp_path / "blocks"),
                "--part",
                "1",
                "--widths",
                "8",
                "--repeat",
                "2",
                "--out",
                str(tmp_path / "r.json"),
            ]
        )
        == 0
    )
    record = json.loads((tmp_path / "r.json").read_text())
    assert record["node_order"] == "blocks" and len(record["products"]) == 8  # 2 orders x 2 column sets x 2 products
    assert all(row["median_s"] > 0 for row in record["products"])
