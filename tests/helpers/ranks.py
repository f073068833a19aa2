"""Running N ranks of the engine in-process (:func:`run_ranks`), the ports they meet on, what a
run ends with, and instruments a rank can run with (gradients, or rates and parameters, at
every optimizer step)."""

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

from . import kernels


def held_out_score(metrics: Path, parts: Path, evaluations: int = 2) -> float:
    """The accuracy of the model a run ends with on every held-out node, the validation and
    the test nodes together (weighted by their numbers), averaged over the run's last
    ``evaluations`` evaluations (every run evaluates after its last epoch; with a decoupled
    ``--sync`` each evaluation follows a full average of every rank's parameters).

    A sharper statistic of the same accuracy than the last test score alone: on Cora 1,500
    nodes instead of 1,000, and a model's epoch-to-epoch jitter averaged over two
    evaluations. Not the summary's score at the best-validation epoch: picking one of many
    evaluations by the validation nodes adds noise of its own."""
    from bnsgcn.data.format import load_partition, read_manifest

    arrays = [load_partition(parts, k) for k in range(read_manifest(parts)["parts"])]
    val, test = (sum(int(np.asarray(a[mask]).sum()) for a in arrays) for mask in ("val_mask", "test_mask"))
    scored = [r for r in map(json.loads, metrics.read_text().splitlines()) if "test_score" in r and "epoch" in r]
    scored = sorted((r for r in scored if not r.get("summary")), key=lambda r: r["epoch"])[-evaluations:]
    assert len(scored) == evaluations, f"{metrics}: fewer than {evaluations} evaluations"
    return float(np.mean([(val * r["val_score"] + test * r["test_score"]) / (val + test) for r in scored]))


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
    work=None,
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
            if work is not None:  # another job than training: its result as it is
                results.append(work(config))
                continue
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
    (:mod:`tests.helpers.preload`), instead of spawned to import them again. The server finds
    the modules by name from the repository root (the current directory when pytest runs
    there); from elsewhere it does without them and each rank imports what it needs."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.helpers.preload", "tests.helpers.ranks"])
    return ctx


def run_ranks(
    world: int,
    configs: list[TrainConfig],
    timeout: float = 300,
    nodes: list[int] | None = None,
    instrument=None,
    work=None,
) -> list[list[dict]]:
    """Run each config as a job of ``world`` ranks (processes); return results[rank][config].

    ``nodes[r]``: the node rank r plays (``GROUP_RANK``, as a multi-node launch sets it);
    default all on one node. ``instrument``: a module-level function each rank calls before
    each run; it returns a function whose result, after the run, is the result's
    ``instrumented``. ``work``: a module-level function each rank calls with each config
    instead of training (its return value is the result).
    """
    kernels.compiled()
    ctx = _rank_context()
    queue = ctx.Queue()
    ports = [free_port() for _ in configs]
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, world, configs, ports, queue, nodes or [0] * world, dict(os.environ), instrument, work),
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


def _wrap_steps(before=None, after=None):
    """Inside a rank: call ``before(optimizer)`` and ``after(optimizer)`` around every step of
    every optimizer of the engine; returns what undoes it."""
    from bnsgcn.nn import optim

    classes = [c for c in vars(optim).values() if isinstance(c, type) and issubclass(c, optim.Optimizer)]
    real = {c: vars(c)["step"] for c in classes if "step" in vars(c) and c is not optim.Optimizer}

    def wrapped(real_step):
        def step(self, *args, **kwargs):
            if before:
                before(self)
            result = real_step(self, *args, **kwargs)
            if after:
                after(self)
            return result

        return step

    for cls, real_step in real.items():
        cls.step = wrapped(real_step)

    def undo():
        for cls, real_step in real.items():
            cls.step = real_step

    return undo


def record_gradients():
    """Inside a rank: record every parameter gradient at each optimizer step (run_ranks' instrument)."""
    steps: list[list[np.ndarray]] = []
    undo = _wrap_steps(before=lambda o: steps.append([p.grad.detach().clone().numpy() for p in o.params]))

    def collect():
        undo()
        return steps

    return collect


def record_steps():
    """Inside a rank: at each optimizer step, its learning rate and the parameters after it
    (run_ranks' instrument)."""
    steps: list[dict] = []
    undo = _wrap_steps(
        after=lambda o: steps.append({"lr": o.group["lr"], "params": [p.detach().clone().numpy() for p in o.params]})
    )

    def collect():
        undo()
        return steps

    return collect
