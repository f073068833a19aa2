"""The GPU (NCCL) path: every tensor handed to a collective is on the rank's device.

NCCL refuses CPU tensors, but on a CPU-only machine (gloo) every tensor is on the CPU
anyway, so a misplaced one goes unnoticed there. Comm therefore refuses any tensor that is
not on ``comm.device``, and the placement tests below give the callers a Comm declared on
another device ("meta") to see where they put what they send, without a GPU. The 2-rank
NCCL runs need two GPUs and are skipped, with the reason, where there are fewer.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bnsgcn.comm.communicator import Comm
from bnsgcn.comm.plan import fetch_boundary, make_plan
from bnsgcn.data.sampler import sample_boundary
from bnsgcn.data.shard import load_shard

from .helpers import reference
from .helpers.graphs import partition, random_graph
from .helpers.ranks import run_ranks

GPUS = torch.cuda.device_count()
needs_two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"2 NCCL ranks need 2 CUDA GPUs; this machine has {GPUS}")


class _ReachedCollective(Exception):
    """Raised by :class:`_MetaComm` once a collective's tensors passed the device check."""


class _MetaComm(Comm):
    """A one-rank Comm on the meta device that checks what it is handed, then stops the
    caller (meta tensors hold no data to carry on with)."""

    def __init__(self) -> None:
        super().__init__(rank=0, world_size=1, local_rank=0, device=torch.device("meta"), timeout=1.0)

    def all_to_all(self, send, send_counts, recv_counts, out, category):
        self._check_device(send, out)
        raise _ReachedCollective


def test_comm_refuses_tensors_off_its_device():
    comm = Comm(rank=0, world_size=1, local_rank=0, device=torch.device("meta"), timeout=1.0)
    on_cpu = torch.zeros(4)
    on_meta = torch.zeros(4, device="meta")
    with pytest.raises(RuntimeError, match="tensor on cpu, but this rank communicates on meta"):
        comm.all_to_all(on_cpu, [4], [4], on_meta, "control")
    with pytest.raises(RuntimeError, match="tensor on cpu"):
        comm.all_to_all(on_meta, [4], [4], on_cpu, "control")
    with pytest.raises(RuntimeError, match="tensor on cpu"):
        comm.all_reduce(on_cpu)
    with pytest.raises(RuntimeError, match="tensor on cpu"):
        comm.all_reduce_async(on_cpu)
    assert comm.all_reduce(on_meta) is on_meta  # a tensor on comm.device passes


@pytest.fixture(scope="module")
def topology(tmp_path_factory):
    parts = partition(random_graph(num_nodes=80, seed=4), 2, tmp_path_factory.mktemp("nccl") / "parts")
    topo = load_shard(parts, 0, 2).topology
    assert topo.n_boundary > 0
    return topo


def test_selection_exchange_sends_from_comm_device(topology):
    keep = sample_boundary(topology.boundary_counts, 0.3, seed=0, rank=0, epoch=0)
    with pytest.raises(_ReachedCollective):
        make_plan(_MetaComm(), topology, keep, 0.3)


def test_setup_fetch_of_cpu_values_sends_from_comm_device(topology):
    """Inductive setup fetches training flags and degrees, which live on the CPU."""
    with pytest.raises(_ReachedCollective):
        fetch_boundary(_MetaComm(), topology, torch.ones(topology.n_inner, dtype=torch.uint8))
    with pytest.raises(_ReachedCollective):
        fetch_boundary(_MetaComm(), topology, topology.degree[: topology.n_inner].contiguous())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_two_gpus)])
def test_sampled_inductive_run(tmp_path, device):
    """p = 0.3 with --inductive: selections are exchanged over the induced subgraph, whose
    boundary nodes are the training nodes among each rank's boundary nodes."""
    graph = random_graph(num_nodes=120, avg_degree=6, seed=9)
    parts = partition(graph, 2, tmp_path / "parts")
    config = reference.exact_config(
        "graphsage", True, parts, tmp_path / "run", p=0.3, inductive=True, epochs=5, device=device
    )
    run_ranks(2, [config])
    boundary = [int(graph.train_mask[np.load(parts / f"part-{r}" / "boundary_nodes.npy")].sum()) for r in range(2)]
    records = [json.loads(line) for line in (config.run.out / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if "epoch" in r]
    assert len(epochs) == config.run.epochs
    for record in epochs:
        assert np.isfinite(record["loss"])
        # one bit per induced boundary node; p of them move, up to one per rank and owner
        assert record["bytes_sent_by_kind"]["selections"] == sum((n + 7) // 8 for n in boundary)
        assert abs(record["sampled_boundary"] - 0.3 * sum(boundary)) <= 2


@needs_two_gpus
@pytest.mark.parametrize("model, precompute", [("graphsage", True), ("gcn", False), ("gat", False)])
def test_nccl_p1_matches_single_process(tmp_path, model, precompute):
    graph = random_graph(num_nodes=48, seed=2)
    parts = partition(graph, 2, tmp_path / "parts")
    config = reference.exact_config(model, precompute, parts, tmp_path / "run", device="cuda")
    results = run_ranks(2, [config])
    reference.assert_run_matches(config, graph, [results[rank][0]["params"] for rank in range(2)])
