"""One rank of a training job, top to bottom.

setup: join the job -> load this rank's shard -> build the normalised graphs ->
precompute the first layer's aggregation -> build the model, optimizer, reducer.
every epoch: sample boundary nodes -> exchange selections -> forward (boundary rows by
all-to-all) -> loss over local training nodes / global count -> backward (gradients of
boundary rows back to their owners; parameter gradients all-reduced in buckets) -> step
-> evaluate every ``eval_every`` epochs -> one JSON line -> checkpoint.
With ``--staleness 1`` the sample is drawn one epoch ahead and the boundary exchange runs
one epoch behind (:mod:`bnsgcn.exchange.stale`).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch
import torch.nn.functional as F
from torch import Tensor

import bnsgcn
from bnsgcn import files
from bnsgcn.comm.communicator import Comm, init_from_env
from bnsgcn.comm.plan import fetch_boundary
from bnsgcn.comm.planners import DirectPlanner, NodeAwarePlanner, make_planner
from bnsgcn.config import TrainConfig, check_flags, parse_delays, parse_sync
from bnsgcn.data.format import set_id
from bnsgcn.data.sampler import derive_seed
from bnsgcn.data.shard import Shard, Topology, load_shard
from bnsgcn.errors import (
    JobStopped,
    PeerLost,
    UserError,
    failure_line,
    is_peer_failure,
    peer_lost_message,
)
from bnsgcn.exchange import Exchange, make_exchange, resolve_exchange_settings
from bnsgcn.kernels import cross_entropy_rows
from bnsgcn.kernels.backend import kernel_backend, seed_step
from bnsgcn.kernels.buffers import BufferPool, pooled
from bnsgcn.metrics import memory, report
from bnsgcn.metrics.accounting import (
    CATEGORIES,
    COLUMNS,
    INDEX,
    EpochAccount,
    peak_memory_bytes,
    resident_bytes,
    static_figures,
)
from bnsgcn.metrics.log import MetricsWriter, setup_logging
from bnsgcn.metrics.loggers import Loggers, make_loggers
from bnsgcn.metrics.progress import Progress, step
from bnsgcn.nn.graph import ShardGraph
from bnsgcn.nn.layers import shard_graph
from bnsgcn.nn.model import build_model, run_model
from bnsgcn.nn.optim import Optimization, make_optimization
from bnsgcn.nn.precision import allow_tf32
from bnsgcn.run import checkpoint, directory
from bnsgcn.run.evaluate import Evaluation
from bnsgcn.run.predict import trained_on
from bnsgcn.run.provenance import launch_info, new_run_dir
from bnsgcn.run.stopping import StopRequest, stop_on_signals
from bnsgcn.sync.averaging import (
    EpochTables,
    ParameterSync,
    make_sync,
)
from bnsgcn.sync.delay import InjectedDelay
from bnsgcn.sync.pool_averaging import make_pool_sync
from bnsgcn.sync.workpool import WorkPool

SPLITS = ("train", "val", "test")
# Compiling every CPU kernel took about a minute on 2 busy cores: longer than a collective's
# --timeout may be, so ranks wait for it through the store, this long at most.
KERNEL_COMPILE_TIMEOUT_S = 900.0


@dataclass
class GraphInputs:
    """What a forward pass over one graph (training or evaluation) needs."""

    topology: Topology
    graph: ShardGraph
    planner: DirectPlanner | NodeAwarePlanner
    features: Tensor
    x_agg: Tensor | None
    labels: Tensor
    train_mask: Tensor
    train_index: Tensor  # int64: the rows of train_mask, found once (no mask indexing per epoch)


def run(config: TrainConfig) -> dict:
    """Run one rank of the job described by the environment (see :func:`bnsgcn.comm.communicator.init_from_env`)."""
    if config.run.threads:
        torch.set_num_threads(config.run.threads)
    memory.return_freed_memory()  # before any data: freed temporaries leave the process
    comm = init_from_env(
        config.run.device,
        config.run.timeout,
        pipelined=config.exchange.staleness > 0,
        ranks_per_gpu=config.run.ranks_per_gpu,
    )
    # After a failure the groups are left as they are: a peer may be dead or hung, and
    # tearing down a group with a collective in flight can block or abort the process,
    # which then hides the real error. The process ends right after anyway.
    try:
        with stop_on_signals(config.checkpoint.every > 0) as stop:
            summary, draw_figures = _train(config, comm, stop)
    except Exception as exc:
        if is_peer_failure(exc):  # name the rank that caused it, if the store knows
            if isinstance(exc, PeerLost):
                raise
            raise PeerLost(peer_lost_message(exc, comm.who_stopped())) from exc
        if not isinstance(exc, JobStopped):  # this rank is the cause: tell the others
            comm.report_failure(failure_line(exc))
        raise
    comm.close()
    # rank 0's slow end-of-run work after the others left: no rank waits for it in a barrier
    draw_figures()
    return summary


def _resolve_run_dir(config: TrainConfig, comm: Comm) -> tuple[Path, Path | None]:
    """Rank 0 picks and creates the run directory; every rank learns it. An earlier run
    there is refused, unless resumed or moved aside with --force (:mod:`bnsgcn.run.directory`);
    the second value is where it went, if it was."""
    error = moved = None
    run_dir = config.run.out
    if comm.rank == 0:
        if run_dir is None:
            run_dir = new_run_dir(launch_info())
        try:
            if not config.checkpoint.resume and (held := directory.earlier_run(run_dir)):
                if not config.run.force:
                    raise directory.refusal(run_dir, held)
                moved = directory.move_aside(run_dir, held)
        except UserError as exc:
            error = str(exc)
        folders = [] if error else [run_dir] + ([checkpoint.checkpoint_dir(run_dir)] if config.checkpoint.every else [])
        for folder in folders:
            try:
                folder.mkdir(parents=True, exist_ok=True)
                files.check_writable(folder)
            except OSError as exc:
                error = f"cannot write {folder} ({exc.strerror}); pass a writable --out"
                break
    run_dir, moved, error = comm.broadcast_object((run_dir, moved, error))
    if error:
        raise UserError(error)
    return Path(run_dir), moved


def graph_inputs(
    config: TrainConfig,
    comm: Comm,
    shard: Shard,
    topology: Topology,
    features: Tensor,
    labels: Tensor,
    train_mask: Tensor,
) -> GraphInputs:
    graph = shard_graph(topology, config.model.name, comm.device)
    planner = make_planner(comm, topology, config.exchange.mode)
    x_agg = None
    if config.model.use_precompute:
        # The first layer's aggregation never changes: compute it once over the full graph.
        boundary_x = fetch_boundary(comm, topology, features)
        with torch.no_grad():
            x_agg = graph.aggregate(features, boundary_x)
    return GraphInputs(topology, graph, planner, features, x_agg, labels, train_mask, train_mask.nonzero().flatten())


def _inductive_inputs(config: TrainConfig, comm: Comm, shard: Shard) -> GraphInputs:
    """The subgraph induced by training nodes, with that subgraph's degrees."""
    topo = shard.topology
    # The topology stays on the CPU: fetch_boundary sends these on comm.device and hands
    # the values back on the CPU.
    train_cpu = shard.train_mask.cpu()
    boundary_train = fetch_boundary(comm, topo, train_cpu.to(torch.uint8)).bool()
    sub = topo.induced(train_cpu, boundary_train, train_cpu[topo.send_nodes])
    sub.degree[sub.n_inner :] = fetch_boundary(comm, sub, sub.degree[: sub.n_inner].contiguous())
    rows = shard.train_mask
    ones = torch.ones(sub.n_inner, dtype=torch.bool, device=comm.device)
    return graph_inputs(config, comm, shard, sub, shard.features[rows], shard.labels[rows], ones)


def _loss_sum(logits: Tensor, labels: Tensor, rows: Tensor, multilabel: bool) -> Tensor:
    """The loss summed over the rows ``rows`` of ``logits`` (the training nodes)."""
    if multilabel:
        return F.binary_cross_entropy_with_logits(
            logits.index_select(0, rows), labels.index_select(0, rows), reduction="sum"
        )
    return cross_entropy_rows(logits, rows, labels.index_select(0, rows))


def _score_counts(logits: Tensor, shard: Shard) -> Tensor:
    """Per split (train, val, test): [correct, total, 0] or [tp, fp, fn] for multi-label,
    float64 [3, 3] on the logits' device (masked sums: no mask indexing, no device sync)."""
    rows = []
    if shard.multilabel:
        pred, true = logits > 0, shard.labels > 0.5
        for mask in (shard.train_mask, shard.val_mask, shard.test_mask):
            m = mask.unsqueeze(1)
            rows.append(torch.stack([(pred & true & m).sum(), (pred & ~true & m).sum(), (~pred & true & m).sum()]))
    else:
        hit = logits.argmax(1) == shard.labels
        for mask in (shard.train_mask, shard.val_mask, shard.test_mask):
            rows.append(
                torch.stack([(hit & mask).sum(), mask.sum(), torch.zeros((), dtype=torch.int64, device=logits.device)])
            )
    return torch.stack(rows).to(torch.float64)


def _scores(counts: Tensor, multilabel: bool) -> dict[str, float]:
    out = {}
    for name, (a, b, c) in zip(SPLITS, counts.tolist()):
        if multilabel:
            out[f"{name}_score"] = 2 * a / max(2 * a + b + c, 1)
        else:
            out[f"{name}_score"] = a / max(b, 1)
    return out


@dataclass
class Job:
    """One rank's training job, as :func:`_setup` builds it."""

    config: TrainConfig  # ``exchange`` resolved
    resolved: TrainConfig  # every choice made (config.json)
    comm: Comm
    shard: Shard
    eval_inputs: GraphInputs
    train_inputs: GraphInputs
    global_train: int  # training nodes of all ranks
    run_dir: Path
    log: logging.Logger
    model: torch.nn.Module  # the built-in GNN or a class of the user's own (bnsgcn.nn.model.build_model)
    optimization: Optimization  # --optimizer, --lr-schedule, --grad-clip (bnsgcn.nn.optim)
    sync: ParameterSync  # --sync: the gradient all-reduce, or a decoupled mode (bnsgcn.sync.averaging)
    delay: InjectedDelay  # --inject-delay: this rank's sleep per epoch (a testing aid)
    exchange: Exchange  # training's boundary exchange, as the configuration asks (bnsgcn.exchange)
    evaluation: Evaluation  # the full-graph forward of evaluations, in slices (bnsgcn.run.evaluate)
    pool: WorkPool | None  # --work-pool: the partitions training takes steps on (bnsgcn.sync.workpool)
    signature: dict  # what a checkpoint must agree on
    baseline_rss: int  # the process before any graph data
    buffers: BufferPool | None  # a training step's kernel outputs, reused (CPU: bnsgcn.kernels.buffers)


@dataclass
class Best:
    """The best validation score so far: its epoch, test score and model state."""

    val_score: float = -1.0
    epoch: int = -1
    test_score: float | None = None
    state: dict | None = None

    def update(self, epoch: int, scores: dict[str, float], model: torch.nn.Module) -> None:
        if scores["val_score"] > self.val_score:
            self.val_score, self.epoch, self.test_score = scores["val_score"], epoch, scores["test_score"]
            self.state = copy.deepcopy(model.state_dict())


def _train(config: TrainConfig, comm: Comm, stop: StopRequest | None = None) -> tuple[dict, Callable[[], None]]:
    job = _setup(config, comm)
    start_epoch, best = _resume(job)
    metrics, loggers = _open_run_files(job, start_epoch)
    with loggers:  # closed also when the run fails: a tracker then marks the run failed
        comm.stats.reset()  # setup traffic is not an epoch's
        progress = Progress(config.run.epochs - start_epoch, "epochs", enabled=comm.rank == 0)
        tables: list[Tensor] = []  # every epoch's figures of every rank (the report takes medians)
        gathered = EpochTables(comm, job.sync.decoupled)
        started = time.perf_counter()
        last_loss = float("nan")
        for epoch in range(start_epoch, config.run.epochs):
            comm.report_progress(f"epoch {epoch + 1}")  # for the others to name this rank if it hangs
            account = EpochAccount(comm.device)
            scores = None
            # where every rank meets: every epoch, or with a decoupled --sync only before
            # evaluations, checkpoints and the end, where parameters are averaged first
            scheduled = config.evaluation.due(epoch + 1, config.run.epochs) or config.checkpoint.due(epoch + 1)
            sync_point = job.sync.is_sync_point(scheduled)
            job.optimization.start_epoch(epoch)  # the epoch's learning rate
            with account.timed("epoch"):  # device time on CUDA (bnsgcn.metrics.timing)
                with pooled(job.buffers):  # kernel outputs reused (bnsgcn.kernels.buffers)
                    if job.pool is not None:
                        _pool_epoch(job, epoch, account)
                    else:
                        _train_epoch(job, epoch, account)
                if sync_point and job.sync.decoupled:
                    with account.timed("sync"):
                        job.sync.average_all()
                if config.evaluation.due(epoch + 1, config.run.epochs):
                    with account.timed("evaluation"):
                        job.exchange.release()  # training's buffers are idle until the next epoch
                        if job.buffers is not None:
                            job.buffers.clear()
                        scores = _evaluate(job.model, job.eval_inputs, job.shard, comm, job.evaluation)
                    best.update(epoch + 1, scores, job.model)
                    if config.evaluation.every and (epoch + 1) % config.evaluation.every == 0:
                        # not the evaluation a run adds after its last epoch: an uninterrupted run has none there
                        job.optimization.evaluated(epoch + 1, scores["val_score"])
            account.values["elapsed"] = time.perf_counter() - started
            account.values["peak_memory_bytes"] = peak_memory_bytes(comm.device)
            account.take_comm(comm)
            for done, table in gathered.collect(epoch + 1, account, sync_point):
                _refuse_non_finite(done, table)
                tables.append(table)
                last_loss = float(table[:, INDEX["loss_sum"]].sum()) / job.global_train
                lr = job.optimization.lrs.pop(done)
                _write_epoch(job, metrics, loggers, done, last_loss, lr, table, scores if done == epoch + 1 else None)
            _checkpoint(job, epoch + 1, best)
            progress.update()
            if stop is not None and sync_point and (signum := stop.agreed(comm)):
                _stop(job, epoch + 1, best, signum)
        progress.close()
        job.exchange.close()  # nothing in flight when the groups close
        return _finish(job, metrics, loggers, best, tables, last_loss)


def compile_kernels(comm: Comm) -> None:
    """Have one process per machine compile the CPU kernels that numba's cache lacks
    (:mod:`bnsgcn.kernels.warmup`) before any rank calls one: a rank that compiles keeps the
    compiler's memory to its end. The first rank of each machine says through the job's
    store when its machine is ready; every rank waits for all of them."""
    from bnsgcn.kernels import torch_backend

    if kernel_backend(comm.device) is torch_backend:  # CUDA, or BNSGCN_KERNELS=torch: numba is not even imported
        return
    from bnsgcn.kernels import warmup

    leaders = [members[0] for members in comm.nodes.members]
    shared = comm.store is not None and comm.world_size > 1
    if comm.rank in leaders:
        outcome = "ready"
        if warmup.needs_compiling():
            outcome = _run_warmup(comm.rank)
        if shared:
            comm.store.set(f"kernels/{comm.node}", outcome)
        if outcome != "ready":
            raise UserError(outcome)
    if not shared:
        return
    keys = [f"kernels/{node}" for node in range(len(leaders))]
    try:
        comm.store.wait(keys, timedelta(seconds=KERNEL_COMPILE_TIMEOUT_S))
    except Exception:  # timed out (or the store is gone): name the machines' ranks not ready
        silent = [f"rank {leaders[n]}" for n, key in enumerate(keys) if not comm.store.check([key])]
        raise PeerLost(
            f"rank {comm.rank}: {', '.join(silent) or 'a rank'} did not finish compiling the CPU kernels within "
            f"{KERNEL_COMPILE_TIMEOUT_S:.0f} s"
        ) from None
    for node, key in enumerate(keys):
        if (outcome := comm.store.get(key).decode()) != "ready":
            raise PeerLost(f"rank {comm.rank}: rank {leaders[node]} failed: {outcome}")


def _run_warmup(rank: int) -> str:
    """``python -m bnsgcn.kernels.warmup`` in a process of its own: "ready", or what went wrong."""
    package_root = str(Path(bnsgcn.__file__).resolve().parents[1])  # where `bnsgcn` is importable from
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "bnsgcn.kernels.warmup"]
    again = "python -m bnsgcn.kernels.warmup"
    with step(f"[rank {rank}] compiling the CPU kernels into numba's cache (once per machine and version)"):
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=KERNEL_COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return (
                f"compiling the CPU kernels took longer than {KERNEL_COMPILE_TIMEOUT_S:.0f} s; "
                f"run {again} to see where it stops"
            )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"compiling the CPU kernels failed ({last}); run {again} to see the error, or set BNSGCN_KERNELS=torch"
    return "ready"


def _setup(config: TrainConfig, comm: Comm) -> Job:
    """Load the shard, build both graphs, the model, optimizer, reducer and exchanges; then
    (only for input that passed every check) the run directory and its log."""
    if config.data.parts_dir is None:
        raise UserError("no partition set given; pass --parts-dir (bnsgcn-train finds one when exactly one matches)")
    check_flags(config, comm.world_size)  # the launcher did, but torchrun and srun start ranks directly
    compile_kernels(comm)
    baseline_rss = resident_bytes()  # the process before any graph data: torch, communicator
    # auto -> direct or hierarchical (direct with --max-lag); auto -> on or off
    config = resolve_exchange_settings(config, comm)
    pool = (
        WorkPool(
            comm,
            config.data.parts_dir,
            config.model.name,
            config.model.use_precompute,
            config.run.seed,
            config.data.verify,
        )
        if config.sync.work_pool
        else None
    )
    # with a pool, this rank's shard (evaluation) is the union of its share of the partitions
    shard = (
        pool.merged_shard()
        if pool
        else load_shard(config.data.parts_dir, comm.rank, comm.world_size, verify=config.data.verify)
    ).to(comm.device)
    topo = shard.topology
    eval_inputs = graph_inputs(config, comm, shard, topo, shard.features, shard.labels, shard.train_mask)
    train_inputs = _inductive_inputs(config, comm, shard) if config.data.inductive else eval_inputs
    local_train = int(train_inputs.train_index.numel())
    global_train = int(comm.all_reduce(torch.tensor([float(local_train)], device=comm.device))[0])
    if global_train == 0:
        raise UserError(f"{config.data.parts_dir} has no training nodes; check the dataset's train mask")
    run_dir, moved = _resolve_run_dir(config, comm)
    log = setup_logging(comm.rank, run_dir / "log.txt" if comm.rank == 0 else None)
    if moved is not None:
        log.info("--force: moved the earlier run into %s", moved)
    log.info(
        "partition %d: %d inner nodes, %d boundary nodes, %d edges, device %s (%s), node %d of %d, %s exchange",
        comm.rank,
        topo.n_inner,
        topo.n_boundary,
        topo.nnz,
        comm.device,
        comm.backend,
        comm.node,
        comm.nodes.count,
        config.exchange.mode,
    )
    tf32_allowed = allow_tf32(config.run.precision, comm.device)
    if config.run.precision == "tf32" and not tf32_allowed and comm.rank == 0:
        log.info("--precision tf32: TF32 is a CUDA matmul mode; on %s the products stay float32", comm.device.type)
    torch.manual_seed(config.run.seed)  # identical initial parameters on every rank
    model = build_model(config, shard.features.shape[1], shard.num_classes, lambda t: comm.all_reduce(t))
    model = model.to(comm.device)
    optimization = make_optimization(config.optim, model.parameters(), config.run.epochs)
    optimizer = optimization.optimizer  # what a decoupled --sync averages besides the parameters
    # training's strategy over the training graph (collective to build with --max-lag)
    exchange = make_exchange(config, comm, train_inputs.topology, train_inputs.planner, log)
    return Job(
        config=config,
        resolved=config.resolved(run_dir, comm.device.type, torch.get_num_threads()),
        comm=comm,
        shard=shard,
        eval_inputs=eval_inputs,
        train_inputs=train_inputs,
        global_train=global_train,
        run_dir=run_dir,
        log=log,
        model=model,
        optimization=optimization,
        sync=(
            make_pool_sync(
                parse_sync(config.sync.mode),
                comm,
                model,
                optimizer,
                local_train,
                global_train,
                config.run.seed,
                log,
                pool.num_parts,
            )
            if pool
            else make_sync(
                parse_sync(config.sync.mode),
                comm,
                model,
                optimizer,
                config.sync.bucket_bytes,
                local_train,
                global_train,
                config.run.seed,
                log,
            )
        ),
        delay=InjectedDelay(parse_delays(config.sync.inject_delay), comm.rank, config.run.seed),
        exchange=exchange,
        evaluation=Evaluation(comm, config.evaluation.buffer_bytes, config.run.precision),
        pool=pool,
        signature={
            "partition_set": set_id(shard.manifest),
            "dataset": shard.manifest["dataset"]["name"],
            **config.model_signature(),
        },
        baseline_rss=baseline_rss,
        buffers=BufferPool() if comm.device.type == "cpu" else None,
    )


def _resume(job: Job) -> tuple[int, Best]:
    """The first epoch to run and the best model so far: from the checkpoint with --resume."""
    if not job.config.checkpoint.resume:
        return 0, Best()
    state, part = _load_checkpoint(job.config, job.comm, job.run_dir, job.signature, job.exchange)
    if state is None:
        job.log.info("no checkpoint in %s: starting from epoch 0", checkpoint.checkpoint_dir(job.run_dir))
        return 0, Best()
    error = changed = None
    path = checkpoint.checkpoint_path(job.run_dir, state["epoch"])
    try:  # a checkpoint edited since, or one of a model whose shapes its signature does not capture
        job.model.load_state_dict(state["model"])
        changed = job.optimization.resume(state)
    except UserError as exc:
        error = f"rank {job.comm.rank}: {path} {exc}"
    except (RuntimeError, ValueError, KeyError) as exc:
        lines = str(exc).strip().splitlines()
        # torch's first line says only "Error(s) in loading state_dict for GNN:"; the next names a tensor
        detail = (lines[1] if len(lines) > 1 else lines[0]).strip().rstrip(".")
        error = (
            f"rank {job.comm.rank}: {path} does not fit this model ({detail}); resume with the partition set and "
            "flags it was written with, or pass a new --out"
        )
    errors = [e for e in job.comm.all_gather_object(error) if e]
    if errors:
        raise UserError(errors[0])
    if part is not None:
        job.exchange.load_state_dict(part)
    if changed:
        job.log.info("optimizer flags changed since the checkpoint: %s", changed)
    job.log.info("resumed from epoch %d", state["epoch"])
    return state["epoch"], Best(**state["best"])


def _open_run_files(job: Job, start_epoch: int) -> tuple[MetricsWriter | None, Loggers]:
    """Rank 0 writes config.json, opens metrics.jsonl and starts the experiment loggers
    (``--logger``; each keeping the epochs a resumed checkpoint covers); the other ranks
    log nothing."""
    if job.comm.rank != 0:
        return None, Loggers()
    comm = job.comm
    layout = {
        "world_size": comm.world_size,
        "nodes": comm.nodes.count,
        "ranks_per_node": [len(m) for m in comm.nodes.members],
        "launch": launch_info(),
    }
    settings = job.resolved.to_json() | layout | trained_on(job.shard.manifest)
    # ASCII: json.dumps escapes the rest (an --out whose name is not UTF-8 included)
    files.write_bytes(job.run_dir / "config.json", (json.dumps(settings, indent=1) + "\n").encode())
    metrics = MetricsWriter(
        [job.run_dir / "metrics.jsonl"] + ([job.config.run.log_json] if job.config.run.log_json else []),
        keep_epochs=start_epoch,
    )
    return metrics, make_loggers(job.config, job.run_dir, settings, keep_epochs=start_epoch)


def _train_epoch(job: Job, epoch: int, account: EpochAccount) -> None:
    """sample -> this epoch's graph -> forward -> loss -> backward -> reduce -> step."""
    config, inputs = job.config, job.train_inputs
    if job.delay:  # a slow machine, emulated: its own phase, never compute
        with account.timed("injected_delay"):
            job.delay.sleep()
    with account.timed("sampling"):
        keep, plan = job.exchange.draw(epoch)
        g = inputs.graph.epoch(keep, config.exchange.p, plan, job.exchange)
    job.model.train()
    seed_step(derive_seed(config.run.seed, job.comm.rank, epoch, 1), job.comm.device)  # dropout
    resident = lambda: [inputs.features, inputs.x_agg, *job.exchange.buffers()]  # noqa: E731 (held anyway)
    with account.timed("forward"), account.saved_tensors(resident):
        logits = run_model(job.model, inputs.features, g, inputs.x_agg, config.run.precision)
        kept = getattr(job.model, "kept_for_recompute", [])  # the built-in GNN's segment inputs
        account.keep(kept + list((g.kept_rows or {}).values()))
        loss_sum = _loss_sum(logits, inputs.labels, inputs.train_index, job.shard.multilabel)
    job.optimization.optimizer.zero_grad(set_to_none=False)
    with account.timed("backward"):
        (loss_sum / job.global_train).backward()
    with account.timed("reduction"):
        job.sync.finish()
    if job.sync.decoupled:
        with account.timed("sync"):
            job.sync.before_step(epoch)
    grad_norm = _grad_norm(job.model)
    job.optimization.step(grad_norm)  # clipped by this norm first, with --grad-clip
    # the loss and the gradient norm stay on the device: EpochAccount.gather reads them once,
    # at the epoch's end
    account.values.update(loss_sum=loss_sum.detach(), grad_norm=grad_norm, sampled_boundary=plan.num_received, steps=1)
    account.values.update(job.exchange.figures())  # e.g. --max-lag's lag and its waits


def _pool_epoch(job: Job, epoch: int, account: EpochAccount) -> None:
    """--work-pool: take partitions from the epoch's pool, one step each, until it is empty
    (:mod:`bnsgcn.sync.workpool`); lockstep modes (:mod:`bnsgcn.sync.pool_averaging`) step in rounds, where
    a rank that found the pool empty contributes no gradient and the round is the last."""
    pool, sync, model = job.pool, job.sync, job.model
    sync.start_epoch()
    loss_sum, steps = torch.zeros((), device=job.comm.device), 0
    grad_norm = torch.zeros((), device=job.comm.device)
    model.train()
    while True:
        with account.timed("sampling"):
            taken = pool.take(epoch)
        if taken is None and not sync.lockstep:
            break
        job.optimization.optimizer.zero_grad(set_to_none=False)
        num_train = 0
        if taken is not None:
            if job.delay:  # a slow machine, emulated: slower at every piece of work
                with account.timed("injected_delay"):
                    job.delay.sleep()
            building = time.perf_counter()
            inputs = pool.inputs(taken[1])
            sync.not_busy(time.perf_counter() - building)  # a partition's graph is built once
            num_train = inputs.num_train
            # dropout drawn per partition and epoch: a step does not depend on the rank taking it
            seed_step(derive_seed(job.config.run.seed, taken[1], epoch, 1), job.comm.device)
            with account.timed("forward"):
                logits = run_model(model, inputs.features, inputs.graph, inputs.x_agg, job.config.run.precision)
                part_loss = _loss_sum(logits, inputs.labels, inputs.train_index, job.shard.multilabel)
            with account.timed("backward"):
                # lockstep: the summed loss (the round's mean is taken after the all-reduce)
                (part_loss if sync.lockstep else part_loss / max(num_train, 1)).backward()
            loss_sum = loss_sum + part_loss.detach()
            steps += 1
        with account.timed("reduction"):
            step, more = sync.finish_round(num_train, taken is not None) if sync.lockstep else (num_train > 0, True)
        if step:
            norm = _grad_norm(model)
            grad_norm = grad_norm + norm
            job.optimization.step(norm)
        with account.timed("sync"):
            sync.after_pool_step(epoch)
        if not more:
            break
    account.values.update(loss_sum=loss_sum, grad_norm=grad_norm, sampled_boundary=0, steps=steps)


def _grad_norm(model: torch.nn.Module) -> Tensor:
    """The L2 norm of the gradients the optimizer is about to step with, on their device
    (read with the loss, at the epoch's end: no synchronisation here)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros((), device=next(model.parameters()).device)
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))


def _refuse_non_finite(epoch: int, table: Tensor) -> None:
    """Every rank, from the epoch's gathered table: end the job when some rank's loss or
    gradient norm is not finite, before this epoch's records, checkpoint or best model are
    written (a non-finite step has already changed the parameters)."""
    loss, grad = table[:, INDEX["loss_sum"]], table[:, INDEX["grad_norm"]]
    bad = (~torch.isfinite(loss) | ~torch.isfinite(grad)).nonzero().flatten().tolist()
    if not bad:
        return
    where = ", ".join(f"rank {r} (loss sum {loss[r].item():g}, gradient norm {grad[r].item():g})" for r in bad)
    raise UserError(
        f"epoch {epoch}: training went non-finite on {where}; stopped before writing anything of this epoch "
        "(the checkpoints of earlier epochs are kept): check the inputs with --verify, or lower --lr"
    )


def _write_epoch(
    job: Job,
    metrics: MetricsWriter | None,
    loggers: Loggers,
    epoch: int,
    loss: float,
    lr: float,
    table: Tensor,
    scores: dict[str, float] | None,
) -> None:
    """Rank 0: the epoch's JSON line, the same record to the experiment loggers, and a log line when it was
    evaluated."""
    if metrics is None:
        return
    record = _epoch_record(epoch, loss, table) | {"lr": lr} | (scores or {})
    metrics.write(record)
    loggers.log_epoch(record)
    if scores is not None:
        job.log.info(
            "epoch %d loss %.4f train %.4f val %.4f test %.4f (%.3fs/epoch)",
            record["epoch"],
            record["loss"],
            scores["train_score"],
            scores["val_score"],
            scores["test_score"],
            record["time"]["epoch"],
        )


def _stop(job: Job, epoch: int, best: Best, signum: int) -> NoReturn:
    """Every rank, after ``epoch``, on a stop signal: checkpoint this epoch (unless the
    schedule just did), then end the job (:mod:`bnsgcn.run.stopping`)."""
    if not job.config.checkpoint.due(epoch):
        _checkpoint(job, epoch, best, now=True)
    name = signal.Signals(signum).name
    raise JobStopped(
        f"stopped by {name} after epoch {epoch}, checkpoint written to {checkpoint.checkpoint_dir(job.run_dir)}; "
        "run the same command with --resume to continue (a requeued SLURM job resumes by itself)",
        signum,
    )


def _checkpoint(job: Job, epoch: int, best: Best, now: bool = False) -> None:
    """Every --checkpoint-every epochs (or ``now``): each rank's part (what its exchange holds
    between epochs, if anything), then rank 0's checkpoint."""
    config, comm = job.config, job.comm
    if not config.checkpoint.every:
        return
    if not (now or config.checkpoint.due(epoch)):
        return  # no barrier either: with a decoupled --sync, ranks meet only at sync points
    if job.exchange.checkpoint_part is not None:  # every part is written before rank 0 writes the checkpoint
        job.exchange.drain()
        checkpoint.save_part(
            job.run_dir,
            epoch,
            comm.rank,
            {"sample": {"p": config.exchange.p, "seed": config.run.seed}, **job.exchange.state_dict()},
        )
        comm.barrier()
    if comm.rank == 0:
        state = {
            "model": job.model.state_dict(),
            "optimizer": job.optimization.optimizer.state_dict(),
            "optimization": job.optimization.state_dict(),  # the settings and the schedule's state
            "best": dict(vars(best)),
            "signature": job.signature,
        }
        checkpoint.save(job.run_dir, epoch, state, config.checkpoint.keep)
    comm.barrier()  # no rank runs ahead of a checkpoint it may have to resume from


def _finish(
    job: Job, metrics: MetricsWriter | None, loggers: Loggers, best: Best, tables: list[Tensor], last_loss: float
) -> tuple[dict, Callable[[], None]]:
    """The report (``tables``: every rank's figures, one table per epoch run; the report
    gives their steady-state medians), the best model and the summary line, also to the
    experiment loggers (rank 0); the summary (every rank), and what is left to do once the
    ranks have parted: rank 0 draws the report's figures (nothing on the others)."""
    config, comm, shard = job.config, job.comm, job.shard
    topo = shard.topology
    train, evaluate = job.train_inputs, job.eval_inputs
    holder_bytes = memory.holders(
        partition=[
            shard.features,
            shard.labels,
            shard.train_mask,
            shard.val_mask,
            shard.test_mask,
            topo.indptr,
            topo.indices,
            topo.degree,
            topo.send_nodes,
        ],
        precomputed=[evaluate.x_agg, train.x_agg, *(job.pool.precomputed_tensors() if job.pool else [])],
        adjacency=evaluate.graph.tensors()
        + (train.graph.tensors() if train is not evaluate else [])
        + (job.pool.adjacency_tensors() if job.pool else []),
        exchange_buffer_bytes=job.exchange.largest_bytes(),
        evaluation_buffer_bytes=job.evaluation.largest_bytes(),
        activation_buffer_bytes=job.buffers.largest_bytes if job.buffers is not None else 0,
        parameters=[t for p in job.model.parameters() for t in (p, p.grad)],
        optimizer_state=memory.optimizer_state_tensors(job.optimization.optimizer),
    )
    figures = comm.all_gather_object(
        static_figures(comm, topo.n_inner, topo.n_boundary, topo.nnz, holder_bytes, job.baseline_rss)
    )
    steps = torch.stack(tables)[:, :, INDEX["steps"]].sum(0).tolist() if tables else [0.0] * comm.world_size
    figures = [
        f | {"steps_total": int(n)} for f, n in zip(figures, steps)
    ]  # optimizer steps each rank took in this run
    summary = {
        "summary": True,
        "epochs": config.run.epochs,
        "final_loss": last_loss,
        "best_val_score": best.val_score,
        "best_epoch": best.epoch,
        "test_score": best.test_score,
        "run_dir": str(job.run_dir),
    }
    if metrics is not None:
        per_epoch, steady = (
            report.steady_state(tables, COLUMNS) if tables else ([dict.fromkeys(COLUMNS, 0.0)] * comm.world_size, None)
        )
        info = {
            "config": job.resolved.to_json(),
            "world_size": comm.world_size,
            "epochs": len(tables),
            "launch": launch_info(),
            "steady_state": steady,
        }
        built = report.build(figures, per_epoch, info)
        report.write(job.run_dir, built, figures=False)
        if best.state is not None:
            with files.atomic(job.run_dir / "best_model.pt") as sink:
                torch.save(best.state, sink)
        metrics.write(summary)
        metrics.close()
        loggers.log_summary(summary)
        job.log.info(
            "best val %.4f at epoch %d, test %.4f; run directory %s",
            best.val_score,
            best.epoch,
            best.test_score,
            job.run_dir,
        )
    summary |= {"model": job.model} | ({"partitions_taken": job.pool.taken} if job.pool else {})
    if metrics is None:
        return summary, lambda: None
    return summary, lambda: report.write_figures(built, job.run_dir)


def _load_checkpoint(
    config: TrainConfig, comm: Comm, run_dir: Path, signature: dict, exchange: Exchange
) -> tuple[dict | None, dict | None]:
    """Rank 0 picks the newest usable checkpoint (:func:`bnsgcn.run.checkpoint.newest`: it and
    every rank's part agree with their checksums); every rank loads that one (and, where its
    exchange keeps a part, its own part), or every rank stops with the first rank's error."""
    chosen = state = error = None
    if comm.rank == 0:
        try:
            parts = comm.world_size if exchange.checkpoint_part is not None else 0
            chosen, state = checkpoint.newest(run_dir, signature, parts) or (None, None)
        except UserError as exc:
            error = str(exc)
    chosen, error = comm.broadcast_object((chosen, error))
    if error:
        raise UserError(error)
    if chosen is None:
        return None, None
    part = None
    try:
        if state is None:  # rank 0 has it already
            state = checkpoint.load(chosen, signature)
        if exchange.checkpoint_part is not None:
            part = checkpoint.load_part(run_dir, state["epoch"], comm.rank)
            p, seed = part["sample"]["p"], part["sample"]["seed"]
            path = checkpoint.part_path(run_dir, state["epoch"], comm.rank)
            if (p, seed) != (config.exchange.p, config.run.seed):  # the stale rows belong to those samples
                raise UserError(
                    f"{path} holds stale boundary rows sampled with --p {p:g} --seed {seed}; resume --staleness 1 "
                    "with those, or pass a new --out"
                )
            written = "lag" if "lag" in part else "stale"  # the two exchanges hold their rows differently
            if written != exchange.checkpoint_part:
                flags = (
                    ("--max-lag", "add --max-lag (any S)") if written == "lag" else ("no --max-lag", "drop --max-lag")
                )
                raise UserError(
                    f"{path} was written by a run with {flags[0]}; {flags[1]} to resume it, or pass a new --out"
                )
    except UserError as exc:
        error = f"rank {comm.rank}: {exc}"
    errors = [e for e in comm.all_gather_object(error) if e]
    if errors:
        raise UserError(errors[0])
    return state, part


def _epoch_record(epoch: int, loss: float, table: Tensor) -> dict:
    """The job-level JSON line of one epoch: times of the slowest rank, bytes of all ranks."""
    columns = table.numpy()  # some 60 columns of a few ranks: numpy's indexing costs a tenth of torch's
    col = lambda name: columns[:, INDEX[name]]  # noqa: E731
    exchange = col("time_exchange_selections") + col("time_exchange_forward") + col("time_exchange_backward")
    compute = col("time_forward") + col("time_backward") - col("time_exchange_forward") - col("time_exchange_backward")
    return {
        "epoch": epoch,
        "loss": loss,
        "sampled_boundary": int(col("sampled_boundary").sum()),
        "time": {
            "epoch": float(col("epoch_time").max()),
            "sampling": float(col("time_sampling").max()),
            "exchange": float(exchange.max()),
            "compute": float(compute.max()),
            "reduction": float(col("time_reduction").max()),
            "evaluation": float(col("time_evaluation").max()),
            "idle": float(col("time_idle").max()),
            "injected_delay": float(col("time_injected_delay").max()),
            "sync": float(col("time_sync").max()),
            # wall seconds since the run's first epoch began, when the last rank ended this
            # one: with a decoupled --sync the sum of "epoch" (the slowest rank's, per epoch)
            # overstates the run's time, as ranks are slowest at different epochs
            "elapsed": float(col("elapsed").max()),
        },
        # per rank (index = rank): where ranks differ when some are slower (--inject-delay, --sync)
        "per_rank": {
            "steps": [int(v) for v in col("steps").tolist()],
            "injected_delay": col("time_injected_delay").tolist(),
            "sync": col("time_sync").tolist(),
            "idle": col("time_idle").tolist(),
            # --max-lag: the most epochs behind of any rows or gradients a rank used, and its
            # seconds waiting because they would have been older than allowed
            "lag": [int(v) for v in col("lag").tolist()],
            "lag_wait": col("time_lag_wait").tolist(),
            # the rank's peak memory so far (device allocated on CUDA, resident set on CPU)
            "peak_memory_bytes": [int(v) for v in col("peak_memory_bytes").tolist()],
        },
        "bytes_sent": int(sum(col(f"sent_{c}").sum() for c in CATEGORIES)),
        "bytes_received": int(sum(col(f"received_{c}").sum() for c in CATEGORIES)),
        "bytes_sent_by_kind": {c: int(col(f"sent_{c}").sum()) for c in CATEGORIES},
        # all-to-all bytes by where the receiving rank runs (all-reduce bytes not included)
        "bytes_intra_node": int(sum(col(f"intra_node_{c}").sum() for c in CATEGORIES)),
        "bytes_inter_node": int(sum(col(f"inter_node_{c}").sum() for c in CATEGORIES)),
        "bytes_inter_node_by_kind": {c: int(col(f"inter_node_{c}").sum()) for c in CATEGORIES},
    }


@torch.no_grad()
def _evaluate(
    model: torch.nn.Module, inputs: GraphInputs, shard: Shard, comm: Comm, evaluation: Evaluation
) -> dict[str, float]:
    """Full-graph scores (no sampling, no dropout) on every rank, counts summed over ranks."""
    model.eval()
    logits = evaluation.logits(model, inputs.graph, inputs.planner.full(), inputs.features, inputs.x_agg)
    counts = comm.all_reduce(_score_counts(logits, shard)).cpu()  # the scores: one read
    return _scores(counts, shard.multilabel)
