"""Test helpers: small graphs, partition sets, and running N ranks of the engine in-process."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import socket
import traceback
from pathlib import Path
from queue import Empty

import numpy as np
import torch

from bnsgcn.config import TrainConfig
from bnsgcn.partition.graph import Graph, canonical_csr
from bnsgcn.partition.partitioner import assign, method_info
from bnsgcn.partition.writer import write_partition_set

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def random_graph(
    num_nodes: int = 60,
    avg_degree: int = 4,
    features: int = 8,
    classes: int = 3,
    seed: int = 0,
    multilabel: bool = False,
) -> Graph:
    """A random graph with an isolated node, features that carry the label, and a split."""
    rng = np.random.default_rng(seed)
    m = num_nodes * avg_degree // 2
    src, dst = rng.integers(0, num_nodes - 1, m), rng.integers(0, num_nodes - 1, m)  # node N-1 isolated
    indptr, indices, _ = canonical_csr(src, dst, num_nodes)
    if multilabel:
        labels = (rng.random((num_nodes, classes)) < 0.4).astype(np.uint8)
        signal = labels.astype(np.float32) @ rng.normal(size=(classes, features)).astype(np.float32)
    else:
        labels = rng.integers(0, classes, num_nodes).astype(np.int64)
        signal = np.eye(classes, features, dtype=np.float32)[labels]
    x = (signal + rng.normal(scale=0.5, size=(num_nodes, features))).astype(np.float32)
    role = rng.permutation(num_nodes)
    train, val, test = (np.zeros(num_nodes, bool) for _ in range(3))
    train[role[: num_nodes // 2]] = True
    val[role[num_nodes // 2 : 3 * num_nodes // 4]] = True
    test[role[3 * num_nodes // 4 :]] = True
    return Graph("random", indptr, indices, x, labels, train, val, test, classes, multilabel=multilabel)


def partition(graph: Graph, parts: int, out: Path, method: str = "random", seed: int = 0) -> Path:
    assignment = assign(graph, parts, method=method, seed=seed)
    write_partition_set(
        graph, assignment, out, parts=parts, method_info=method_info(method, "cut", seed), progress=False
    )
    return out


def cora_metis(parts: int, out: Path) -> Path:
    """The Cora of ../shared/data (public split), METIS into ``parts``, written to ``out``."""
    from bnsgcn.partition.datasets import load_dataset

    graph = load_dataset("cora", SHARED_DATA / "planetoid", progress=False)
    return partition(graph, parts, out, method="metis")


def final_test_score(metrics: Path, epochs: int) -> float:
    """The test accuracy of the model a run ends with: its last epoch's evaluation (every run
    evaluates after its last epoch; with a decoupled ``--sync``, after the final average).
    Not the summary's score at the best-validation epoch: picking one of many evaluations by
    Cora's 500 validation nodes adds noise of its own (tests/test_sync.py, test_workpool.py)."""
    (last,) = [
        r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("epoch") == epochs and "test_score" in r
    ]
    return last["test_score"]


def graph_with_island(out: Path) -> Path:
    """A 4-part set whose partition 3 is a component of its own: no boundary node, and no
    other rank needs its rows (zero-sized splits in every all-to-all it takes part in)."""
    main, island = random_graph(num_nodes=90, avg_degree=5, seed=11), random_graph(num_nodes=30, avg_degree=4, seed=12)
    n = main.num_nodes + island.num_nodes
    rows = np.concatenate(
        [
            np.repeat(np.arange(g.num_nodes), np.diff(g.indptr)) + offset
            for g, offset in ((main, 0), (island, main.num_nodes))
        ]
    )
    sources = np.concatenate([main.indices, island.indices + main.num_nodes])
    indptr, indices, _ = canonical_csr(sources, rows, n)
    joined = Graph(
        "joined",
        indptr,
        indices,
        *(
            np.concatenate([getattr(main, k), getattr(island, k)])
            for k in ("features", "labels", "train_mask", "val_mask", "test_mask")
        ),
        main.num_classes,
    )
    assignment = np.concatenate([np.arange(main.num_nodes) % 3, np.full(island.num_nodes, 3)])
    write_partition_set(joined, assignment, out, parts=4, method_info=method_info("random", "cut", 0), progress=False)
    return out


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free port below the kernel's ephemeral range: ports picked ahead of a run must not
    be taken meanwhile by the outgoing connections (ephemeral ports) of earlier runs' ranks.
    Under pytest-xdist each worker picks from a slice of its own, so two workers never pick
    the same port between its check here and its rank 0 listening on it; and a worker never
    hands out a port twice (ports picked together for consecutive runs are all free now)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            ephemeral_low = int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    ports = range(10000, max(ephemeral_low, 10001))
    worker, workers = (
        os.environ.get("PYTEST_XDIST_WORKER", "gw0"),
        int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")),
    )
    ports = ports[int(worker.removeprefix("gw")) :: workers]
    for port in random.Random().sample(ports, min(200, len(ports))):
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no free port below the ephemeral range")


def _rank_main(
    rank: int,
    world: int,
    configs: list[TrainConfig],
    ports: list[int],
    queue,
    nodes: list[int],
    environ: dict[str, str],
    instrument=None,
) -> None:
    local_rank = nodes[:rank].count(nodes[rank])
    # A forked rank inherits the forkserver's environment, not the test's (monkeypatch.setenv)
    os.environ.clear()
    os.environ.update(environ)
    # LOCAL_WORLD_SIZE as the launcher, torchrun and SLURM set it: --device auto decides by it
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(nodes.count(nodes[rank])),
        GROUP_RANK=str(nodes[rank]),
    )
    torch.set_num_threads(1)
    from bnsgcn.run.train import run

    results = []
    try:
        for config, port in zip(configs, ports):
            os.environ["MASTER_PORT"] = str(port)
            collect = instrument() if instrument else None
            summary = run(config)
            model = summary.pop("model")
            results.append(summary | {"params": {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}})
            if collect is not None:
                results[-1]["instrumented"] = collect()
        queue.put((rank, results, None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))


def _rank_context():
    """Rank processes forked from a server that imported torch and the engine once
    (:mod:`tests.rank_preload`), instead of spawned to import them again."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.rank_preload", "tests.distributed"])
    return ctx


def run_ranks(
    world: int, configs: list[TrainConfig], timeout: float = 300, nodes: list[int] | None = None, instrument=None
) -> list[list[dict]]:
    """Run each config as a job of ``world`` ranks (processes); return results[rank][config].

    ``nodes[r]``: the node rank r plays (``GROUP_RANK``, as a multi-node launch sets it);
    default all on one node. ``instrument``: a module-level function each rank calls before
    each run; it returns a function whose result, after the run, is the result's
    ``instrumented``.
    """
    ctx = _rank_context()
    queue = ctx.Queue()
    ports = [free_port() for _ in configs]
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, world, configs, ports, queue, nodes or [0] * world, dict(os.environ), instrument),
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: list = [None] * world
    try:
        for _ in range(world):
            try:
                rank, res, err = queue.get(timeout=timeout)
            except Empty:  # say which ranks hang and which died (a crash reports nothing)
                states = [
                    f"rank {r} {'still running' if procs[r].is_alive() else f'exited with {procs[r].exitcode}'}"
                    for r in range(world)
                    if results[r] is None
                ]
                raise AssertionError(f"no result within {timeout:.0f} s: {', '.join(states)}") from None
            if err:
                raise AssertionError(f"rank {rank} failed:\n{err}")
            results[rank] = res
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results
