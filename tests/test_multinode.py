"""Two bnsgcn-train invocations with --nnodes 2 on 127.0.0.1 train as one 4-rank job."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .helpers import kernels
from .helpers.graphs import partition, random_graph
from .helpers.ranks import free_port

FLAGS = [
    "--p",
    "0.5",
    "--model",
    "graphsage",
    "--layers",
    "2",
    "--hidden",
    "8",
    "--epochs",
    "4",
    "--eval-every",
    "2",
    "--seed",
    "5",
]


def _losses(run_dir) -> list:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def test_two_nodes_match_one_four_rank_run(tmp_path):
    kernels.compiled()
    parts = partition(random_graph(num_nodes=160, avg_degree=6, seed=9), 4, tmp_path / "parts")
    train = [sys.executable, "-m", "bnsgcn.launch.cli", "--parts-dir", str(parts), *FLAGS]
    single = subprocess.run(
        [*train, "--procs", "4", "--out", str(tmp_path / "single")], capture_output=True, text=True, timeout=300
    )
    assert single.returncode == 0, single.stderr

    port = str(free_port())
    nodes = [
        subprocess.Popen(
            [
                *train,
                "--procs",
                "2",
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                "--out",
                str(tmp_path / "multi"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err
    assert _losses(tmp_path / "multi") == pytest.approx(_losses(tmp_path / "single"), rel=1e-6)
    assert "[rank 3]" in outputs[1][1]  # the second node ran ranks 2 and 3
