"""``--work-pool`` (bnsgcn.sync.workpool, bnsgcn.sync.pool_averaging): more partitions than ranks, taken from a pool.

* the evaluation shard, the union of a rank's partitions, equals the partition of the same
  graph written directly with the merged assignment (edges, degrees, boundary and send lists
  by global id);
* one rank and two ranks with ``allreduce``: losses and final parameters equal an
  independent dense float64 reference that trains on the partitions in the pool's order
  (one partition per step, or rounds of two with the round's mean loss);
* with ranks of different speeds, every partition is taken exactly once per epoch in every
  mode, and the fast ranks take more; the job ends with one model;
* Cora (4 partitions, 2 ranks, p = 0): every mode within the tolerance of the pool's
  synchronous all-reduce;
* bad combinations are refused in one line; a killed rank is named.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bnsgcn.config import TrainConfig, validate
from bnsgcn.data.shard import load_shard
from bnsgcn.errors import UserError
from bnsgcn.partition.partitioner import assign
from bnsgcn.sync.workpool import merge_partitions, pool_order

from .helpers.cli import TRAIN, assert_user_error, run_cli
from .helpers.faults import assert_killed_rank_is_named, train_args
from .helpers.graphs import cora_metis, partition, random_graph
from .helpers.ranks import held_out_score, run_ranks
from .helpers.reference import dense_adjacency, initial_params

PARTS = 6


@pytest.fixture(scope="module")
def graph():
    return random_graph(num_nodes=150, avg_degree=5, seed=21)


@pytest.fixture(scope="module")
def parts6(graph, tmp_path_factory):
    return partition(graph, PARTS, tmp_path_factory.mktemp("pool") / "graph-6")


# --- the evaluation shard ----------------------------------------------------------------------


def _edges_and_lists(shard, inner_ids: np.ndarray, boundary_ids: np.ndarray) -> tuple:
    """A shard's structure by global id: its edge set, degrees, boundary ids per owner rank
    and send ids per requesting rank (orders included)."""
    topo = shard.topology
    column_ids = np.concatenate([inner_ids, boundary_ids])
    rows = np.repeat(inner_ids, np.diff(topo.indptr.numpy()))
    edges = sorted(zip(rows.tolist(), column_ids[topo.indices.numpy()].tolist()))
    degrees = dict(zip(column_ids.tolist(), topo.degree.tolist()))
    bounds = np.cumsum([0, *topo.boundary_counts])
    boundary = [boundary_ids[bounds[q] : bounds[q + 1]].tolist() for q in range(len(topo.boundary_counts))]
    send_bounds = np.cumsum([0, *topo.send_counts])
    sends = [
        inner_ids[topo.send_nodes.numpy()[send_bounds[q] : send_bounds[q + 1]]].tolist()
        for q in range(len(topo.send_counts))
    ]
    return edges, degrees, boundary, sends, sorted(inner_ids.tolist())


@pytest.mark.parametrize("world", (1, 2, 4))
def test_merged_shard_equals_the_partition_written_directly(graph, parts6, tmp_path, world):
    from bnsgcn.data.format import load_partition

    shards = [load_shard(parts6, k, PARTS) for k in range(PARTS)]
    ids = {
        k: (load_partition(parts6, k)["inner_nodes"], load_partition(parts6, k)["boundary_nodes"]) for k in range(PARTS)
    }
    direct = partition_with(graph, assign(graph, PARTS, method="random", seed=0) % world, world, tmp_path / "direct")
    for rank in range(world):
        merged = merge_partitions(shards, {k: ids[k] for k in range(rank, PARTS, world)}, rank, world)
        inner = np.concatenate([ids[k][0] for k in range(rank, PARTS, world)])
        expected = load_shard(direct, rank, world)
        arrays = load_partition(direct, rank)
        # The merge orders boundary columns as the writer does (owner rank, then ascending
        # id), so the direct set's boundary ids name the merged columns too: a column the
        # merge numbered differently shows as a wrong edge below.
        boundary = np.asarray(arrays["boundary_nodes"])
        assert merged.topology.n_boundary == len(boundary), rank
        want = _edges_and_lists(expected, np.asarray(arrays["inner_nodes"]), boundary)
        got = _edges_and_lists(merged, inner, boundary)
        for name, a, b in zip(("edges", "degrees", "boundary ids", "send ids", "inner ids"), got, want):
            assert a == b, f"rank {rank} of {world}: {name} differ"
        torch.testing.assert_close(merged.features[np.argsort(inner)], expected.features)  # both ascending by id
        assert torch.equal(merged.train_mask[np.argsort(inner)], expected.train_mask)


def partition_with(graph, assignment: np.ndarray, parts: int, out):
    from bnsgcn.partition.partitioner import method_info
    from bnsgcn.partition.writer import write_partition_set

    write_partition_set(
        graph, assignment, out, parts=parts, method_info=method_info("random", "cut", 0), progress=False
    )
    return out


# --- the training steps against a dense reference ----------------------------------------------


def _reference(config: TrainConfig, graph, assignment: np.ndarray, world: int) -> tuple[list[float], dict]:
    """Float64, one process: each epoch, the partitions in the pool's order, ``world`` per
    step (a round), each on its own subgraph normalised by full-graph degrees, the first
    layer's aggregation over the full graph; the step's loss is the mean over the round's
    training nodes. GraphSAGE, no norm, no dropout. Returns per-epoch loss (summed over the
    epoch's steps / all training nodes) and the final parameters."""
    a = dense_adjacency(graph)
    mean = a / a.sum(1, keepdim=True)  # full-graph degrees (self-loop included)
    x = torch.from_numpy(graph.features).double()
    first_agg = mean @ x
    labels = torch.from_numpy(graph.labels)
    train = torch.from_numpy(graph.train_mask)
    params = {k: v.requires_grad_(True) for k, v in initial_params(config, graph).items()}
    opt = torch.optim.Adam(params.values(), lr=config.optim.lr)
    losses = []
    for epoch in range(config.run.epochs):
        order = pool_order(config.run.seed, epoch, PARTS).tolist()
        total = 0.0
        for start in range(0, PARTS, world):
            loss_sum, count = 0.0, 0
            for part in order[start : start + world]:
                nodes = torch.from_numpy(np.flatnonzero(assignment == part))
                a_kk = mean[nodes][:, nodes]
                h = None
                for i in range(config.model.layers):
                    p = {k.split(".", 2)[2]: v for k, v in params.items() if k.startswith(f"layers.{i}.")}
                    if i == 0:
                        h = (
                            x[nodes] @ p["lin_self.weight"].T
                            + p["lin_self.bias"]
                            + first_agg[nodes] @ p["lin_neigh.weight"].T
                        )
                    else:
                        h = h @ p["lin_self.weight"].T + p["lin_self.bias"] + a_kk @ h @ p["lin_neigh.weight"].T
                    if i < config.model.layers - 1:
                        h = F.relu(h)
                rows = train[nodes]
                loss_sum = loss_sum + F.cross_entropy(h[rows], labels[nodes][rows], reduction="sum")
                count += int(rows.sum())
            opt.zero_grad()
            (loss_sum / count).backward()
            opt.step()
            total += float(loss_sum.detach())
        losses.append(total / int(train.sum()))
    return losses, {k: v.detach() for k, v in params.items()}


def pool_config(parts_dir, out, **overrides) -> TrainConfig:
    base = dict(
        parts_dir=parts_dir,
        p=0.0,
        model="graphsage",
        layers=2,
        hidden=8,
        dropout=0.0,
        norm="none",
        lr=0.01,
        epochs=3,
        eval_every=0,
        device="cpu",
        seed=5,
        work_pool=True,
        out=out,
    )
    return TrainConfig.from_settings(**(base | overrides))


@pytest.mark.parametrize("world", (1, 2))
def test_allreduce_pool_equals_the_dense_reference(graph, parts6, tmp_path, world):
    config = pool_config(parts6, tmp_path / "run")
    results = run_ranks(world, [config])
    ref_losses, ref_params = _reference(config, graph, assign(graph, PARTS, method="random", seed=0), world)
    lines = [json.loads(line) for line in (config.run.out / "metrics.jsonl").read_text().splitlines()]
    assert [line["loss"] for line in lines if "loss" in line] == pytest.approx(ref_losses, rel=1e-5)
    for rank_results in results:  # every rank holds the reference's parameters
        for name, ref in ref_params.items():
            torch.testing.assert_close(
                torch.from_numpy(rank_results[0]["params"][name]).double(), ref, rtol=1e-4, atol=1e-5
            )


# --- every partition once per epoch, with ranks of different speeds ----------------------------


@pytest.mark.parametrize("sync", ("allreduce", "grouped:2", "partial:2", "gossip:1"))
def test_every_partition_once_per_epoch_with_a_slow_rank(parts6, tmp_path, sync):
    epochs = 4
    config = pool_config(parts6, tmp_path / "run", epochs=epochs, eval_every=2, sync=sync, inject_delay="0:0.15")
    results = run_ranks(3, [config])
    taken = [r[0]["partitions_taken"] for r in results]
    for epoch in range(epochs):
        parts = sorted(p for rank in taken for p in rank.get(epoch, []))
        assert parts == list(range(PARTS)), (sync, epoch, taken)
    per_rank = [sum(len(v) for v in rank.values()) for rank in taken]
    if sync in ("partial:2", "gossip:1"):
        # Free modes: the fast ranks take more, together. Not each of them: a fast rank that
        # gossips with the slow one waits for it, and the other fast rank may take the rest.
        assert per_rank[0] < sum(per_rank[1:]) / 2, (sync, per_rank)
    lines = [json.loads(line) for line in (config.run.out / "metrics.jsonl").read_text().splitlines()]
    assert [sum(line["per_rank"]["steps"]) for line in lines if "per_rank" in line] == [PARTS] * epochs
    params = [r[0]["params"] for r in results]
    for name in params[0]:  # the run ends with one model
        for other in params[1:]:
            np.testing.assert_array_equal(other[name], params[0][name])


# --- Cora: each mode against the pool's synchronous all-reduce ---------------------------------

# The target: each mode within 1.5 points of the pool's synchronous all-reduce, on the mean
# over 4 seeds of the accuracy of the model a run ends with, on Cora's 1,500 held-out nodes
# (validation and test together) and averaged over the run's last two evaluations
# (helpers.ranks.held_out_score): a sharper statistic than the last test score alone. The
# decoupled modes average asynchronously (arrival order, the newest parameters a leader
# published), so a seed's score moves from run to run; evaluating every 5 epochs makes each
# evaluation a sync point, one full average (every 10 left grouped:5 1.2 points below). Cora's
# features are its 64 leading principal components (helpers.graphs.cora_metis): the modes are
# compared with each other, not with a published score, at a third of the time of 1,433 columns.
#
# Measured 2026-11-29 on 2 cores of a machine that other jobs kept busy (load 6-8), seeds 0-23
# with the 4 partitions (all-reduce repeats exactly). Per mode, the mean and standard deviation
# over the runs of (mode - all-reduce, same seed), in points:
#
#   held-out, last two evaluations:  grouped:5 +0.30 (0.58), partial:2 +0.26 (0.50), gossip:1 +0.25 (0.43)
#
# so with 4 seeds a mean below -1.5 is more than 5 standard deviations of the mean away for
# every mode. With all 1,433 feature columns, 6 seeds measured grouped:5 -0.75 (0.60),
# partial:2 -0.30 (0.34) and gossip:1 -0.09 (0.47) at three times the time.
CORA_TOLERANCE = 0.015


@pytest.fixture(scope="module")
def cora4(tmp_path_factory):
    return cora_metis(4, tmp_path_factory.mktemp("cora") / "cora-4", components=64)


CORA_SEEDS = tuple(range(4))


def cora_pool_scores(parts, syncs: list[str], out) -> dict[str, float]:
    """Mean held-out accuracy over CORA_SEEDS per --sync mode, 2 ranks taking the 4 partitions."""
    configs = [
        TrainConfig.from_settings(
            parts_dir=parts,
            p=0.0,
            model="graphsage",
            layers=2,
            norm="none",
            hidden=16,
            dropout=0.5,
            lr=0.01,
            weight_decay=5e-4,
            epochs=100,
            eval_every=5,
            seed=seed,
            device="cpu",
            sync=sync,
            work_pool=True,
            out=out / f"{sync.replace(':', '-')}-{seed}",
        )
        for sync in syncs
        for seed in CORA_SEEDS
    ]
    run_ranks(2, configs, timeout=900)
    scores = {sync: [] for sync in syncs}
    for c in configs:
        scores[c.sync.mode].append(held_out_score(c.run.out / "metrics.jsonl", parts))
    return {sync: float(np.mean(values)) for sync, values in scores.items()}


def test_cora_pool_modes_reach_the_synchronous_accuracy(cora4, tmp_path):
    scores = cora_pool_scores(cora4, ["allreduce", "grouped:5", "partial:2", "gossip:1"], tmp_path)
    print(f"cora work pool (4 parts, 2 ranks, mean of {len(CORA_SEEDS)} seeds) held-out scores: {scores}")  # -rP
    assert scores["allreduce"] > 0.7, scores  # the pool trains at all (the majority class: 0.32)
    for sync, score in scores.items():
        assert score >= scores["allreduce"] - CORA_TOLERANCE, (sync, scores)


# --- refusals and a rank that dies -------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, words",
    [
        (dict(p=0.1), "--work-pool trains each partition on its own subgraph"),
        (dict(p=0.0, staleness=1), "--work-pool exchanges no boundary rows"),
        (dict(p=0.0, norm="batch"), "--norm batch sums statistics"),
        (dict(p=0.0, inductive=True), "--work-pool does not support --inductive"),
    ],
)
def test_bad_combinations_are_refused_in_one_line(overrides, words):
    with pytest.raises(UserError, match=words):
        validate(TrainConfig.from_settings(work_pool=True, **overrides))


def test_launcher_needs_ranks_and_enough_parts(parts6, tmp_path):
    assert_user_error(
        run_cli(TRAIN, ["--parts-dir", str(parts6), "--p", "0", "--work-pool"], tmp_path),
        "--work-pool needs the number of ranks",
    )
    few = partition(random_graph(num_nodes=60, seed=2), 2, tmp_path / "few")
    assert_user_error(
        run_cli(TRAIN, ["--procs", "3", "--parts-dir", str(few), "--p", "0", "--work-pool"], tmp_path),
        "re-partition into at least 3 parts",
    )


@pytest.mark.parametrize("sync", ("allreduce", "gossip:1"))
def test_rank_killed_in_a_pool_job_is_named(parts6, tmp_path, sync):
    run_dir = tmp_path / "run"
    args = train_args(
        parts6,
        run_dir,
        "--epochs",
        "100000",
        "--checkpoint-every",
        "0",
        "--p",
        "0",
        "--work-pool",
        "--sync",
        sync,
        "--eval-every",
        "50",
    )
    # with a decoupled sync metrics.jsonl is written at sync points only: the log says when
    # setup is done (and training starts)
    assert_killed_rank_is_named(
        tmp_path,
        args,
        started=lambda: (run_dir / "log.txt").exists() and "inner nodes" in (run_dir / "log.txt").read_text(),
    )
