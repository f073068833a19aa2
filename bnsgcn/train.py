"""One rank of a training job, top to bottom.

setup: join the job -> load this rank's shard -> build the normalised graphs ->
precompute the first layer's aggregation -> build the model, optimizer, reducer.
every epoch: sample boundary nodes -> exchange selections -> forward (boundary rows by
all-to-all) -> loss over local training nodes / global count -> backward (gradients of
boundary rows back to their owners; parameter gradients all-reduced in buckets) -> step
-> evaluate every ``eval_every`` epochs -> one JSON line -> checkpoint.
With ``--staleness 1`` the sample is drawn one epoch ahead and the boundary exchange runs
one epoch behind (:mod:`bnsgcn.stale`).
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from . import checkpoint, report
from .accounting import CATEGORIES, COLUMNS, INDEX, EpochAccount, resident_bytes, static_figures, tensor_bytes
from .comm import Comm, init_from_env
from .compress import WireFormat
from .config import TrainConfig
from .errors import UserError
from .exchange import BoundaryExchange, ExchangePlan, fetch_boundary
from .format import set_id
from .graph import ShardGraph
from .hierarchy import DirectPlanner, NodeAwarePlanner, make_planner, resolve_mode
from .kernels import spmm, spmm_add_
from .log import MetricsWriter, setup_logging
from .model import GNN
from .progress import Progress
from .reducer import GradientReducer
from .sampler import derive_seed, sample_boundary
from .shard import Shard, Topology, load_shard
from .stale import StaleExchange

SPLITS = ("train", "val", "test")


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


def run(config: TrainConfig) -> dict:
    """Run one rank of the job described by the environment (see :func:`bnsgcn.comm.init_from_env`)."""
    if config.threads:
        torch.set_num_threads(config.threads)
    comm = init_from_env(config.device, config.timeout, pipelined=config.staleness > 0)
    # After a failure the groups are left as they are: a peer may be dead or hung, and
    # tearing down a group with a collective in flight can block or abort the process,
    # which then hides the real error. The process ends right after anyway.
    summary = _train(config, comm)
    comm.close()
    return summary


def _resolve_run_dir(config: TrainConfig, comm: Comm) -> Path:
    """Rank 0 picks and creates the run directory; every rank learns it."""
    error = None
    run_dir = config.out
    if comm.rank == 0:
        if run_dir is None:
            run_dir = Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
            suffix = 1
            while run_dir.exists():
                run_dir = run_dir.with_name(f"{run_dir.name.split('.')[0]}.{suffix}")
                suffix += 1
        if not config.resume and checkpoint.has_checkpoints(run_dir):
            error = f"{run_dir} holds the checkpoints of an earlier run; pass --resume to continue it, or a new --out"
        folders = [] if error else [run_dir] + ([checkpoint.checkpoint_dir(run_dir)] if config.checkpoint_every else [])
        for folder in folders:
            try:
                folder.mkdir(parents=True, exist_ok=True)
                probe = folder / ".write-test"
                probe.write_text("")
                probe.unlink()
            except OSError as exc:
                error = f"cannot write {folder} ({exc.strerror}); pass a writable --out"
                break
    run_dir, error = comm.broadcast_object((run_dir, error))
    if error:
        raise UserError(error)
    return Path(run_dir)


def _graph_inputs(config: TrainConfig, comm: Comm, shard: Shard, topology: Topology, features: Tensor, labels: Tensor, train_mask: Tensor) -> GraphInputs:
    graph = ShardGraph(topology, config.model, comm.device)
    planner = make_planner(comm, topology, config.exchange)
    x_agg = None
    if config.use_precompute:
        # The first layer's aggregation never changes: compute it once over the full graph.
        boundary_x = fetch_boundary(comm, topology, features)
        with torch.no_grad():
            x_agg = spmm_add_(spmm(graph.inner, features), graph.boundary, boundary_x)
    return GraphInputs(topology, graph, planner, features, x_agg, labels, train_mask)


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
    return _graph_inputs(config, comm, shard, sub, shard.features[rows], shard.labels[rows], ones)


def _loss_sum(logits: Tensor, labels: Tensor, multilabel: bool) -> Tensor:
    if multilabel:
        return F.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
    return F.cross_entropy(logits, labels, reduction="sum")


def _score_counts(logits: Tensor, shard: Shard) -> Tensor:
    """Per split (train, val, test): [correct, total, 0] or [tp, fp, fn] for multi-label."""
    rows = []
    for mask in (shard.train_mask, shard.val_mask, shard.test_mask):
        if shard.multilabel:
            pred, true = logits[mask] > 0, shard.labels[mask] > 0.5
            rows.append([(pred & true).sum(), (pred & ~true).sum(), (~pred & true).sum()])
        else:
            correct = (logits[mask].argmax(1) == shard.labels[mask]).sum()
            rows.append([correct, mask.sum(), torch.zeros((), device=logits.device)])
    return torch.tensor([[float(v) for v in r] for r in rows], dtype=torch.float64)


def _scores(counts: Tensor, multilabel: bool) -> dict[str, float]:
    out = {}
    for name, (a, b, c) in zip(SPLITS, counts.tolist()):
        if multilabel:
            out[f"{name}_score"] = 2 * a / max(2 * a + b + c, 1)
        else:
            out[f"{name}_score"] = a / max(b, 1)
    return out


def _train(config: TrainConfig, comm: Comm) -> dict:
    if config.parts_dir is None:
        raise UserError("no partition set given; pass --parts-dir (bnsgcn-train finds one when exactly one matches)")
    baseline_rss = resident_bytes()  # the process before any graph data: torch, communicator
    config = replace(config, exchange=resolve_mode(config.exchange, comm))  # auto -> direct or hierarchical
    shard = load_shard(config.parts_dir, comm.rank, comm.world_size, verify=config.verify).to(comm.device)
    topo = shard.topology
    eval_inputs = _graph_inputs(config, comm, shard, topo, shard.features, shard.labels, shard.train_mask)
    train_inputs = _inductive_inputs(config, comm, shard) if config.inductive else eval_inputs
    global_train = int(comm.all_reduce(torch.tensor([float(train_inputs.train_mask.sum())], device=comm.device))[0])
    if global_train == 0:
        raise UserError(f"{config.parts_dir} has no training nodes; check the dataset's train mask")
    # Only input that passed every check gets a run directory: a failed start leaves none.
    run_dir = _resolve_run_dir(config, comm)
    log = setup_logging(comm.rank, run_dir / "log.txt" if comm.rank == 0 else None)
    log.info(
        "partition %d: %d inner nodes, %d boundary nodes, %d edges, device %s (%s), node %d of %d, %s exchange",
        comm.rank, topo.n_inner, topo.n_boundary, topo.nnz, comm.device, comm.backend, comm.node, comm.nodes.count, config.exchange,
    )

    torch.manual_seed(config.seed)  # identical initial parameters on every rank
    model = GNN(config, shard.features.shape[1], shard.num_classes, lambda t: comm.all_reduce(t)).to(comm.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    reducer = GradientReducer(model, comm, config.bucket_bytes)
    rows_format, grads_format = WireFormat(config.compress), WireFormat(config.grad_wire_format)
    exchange = BoundaryExchange(comm, rows_format, grads_format)
    stale = StaleExchange(comm, train_inputs.topology, exchange, rows_format, grads_format, config.stale_smoothing) if config.staleness else None
    signature = {"partition_set": set_id(shard.manifest), "dataset": shard.manifest["dataset"]["name"], **config.model_signature()}

    start_epoch, best = 0, {"val_score": -1.0, "epoch": -1, "test_score": None, "state": None}
    if config.resume:
        state = checkpoint.load_latest(run_dir, signature)
        if state is None:
            log.info("no checkpoint in %s: starting from epoch 0", checkpoint.checkpoint_dir(run_dir))
        else:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            start_epoch, best = state["epoch"], state["best"]
            if stale is not None:
                stale.load_state_dict(_stale_part(checkpoint.load_part(run_dir, start_epoch, comm.rank), config, run_dir, start_epoch, comm.rank))
            log.info("resumed from epoch %d", start_epoch)
    resolved = config.resolved(run_dir, comm.device.type, torch.get_num_threads())
    if comm.rank == 0:
        layout = {"world_size": comm.world_size, "nodes": comm.nodes.count, "ranks_per_node": [len(m) for m in comm.nodes.members]}
        (run_dir / "config.json").write_text(json.dumps(resolved.to_json() | layout, indent=1) + "\n")
    metric_paths = [run_dir / "metrics.jsonl"] + ([config.log_json] if config.log_json else [])
    metrics = MetricsWriter(metric_paths, keep_epochs=start_epoch) if comm.rank == 0 else None

    comm.stats.reset()  # setup traffic is not an epoch's
    progress = Progress(config.epochs - start_epoch, "epochs", enabled=comm.rank == 0)
    totals = torch.zeros(comm.world_size, len(COLUMNS), dtype=torch.float64)
    last_loss = float("nan")
    sample = lambda epoch: _sample(config, comm, train_inputs, epoch)  # noqa: E731
    ahead = None  # with staleness: the epoch's sample, drawn during the previous epoch
    for epoch in range(start_epoch, config.epochs):
        account = EpochAccount()
        t0 = time.perf_counter()
        with account.timed("sampling"):  # sample -> exchange selections -> this epoch's graph
            keep, plan = ahead or sample(epoch)
            if stale is not None:
                ahead = sample(epoch + 1)
                stale.prepare(ahead[1], ahead[0])
            g = train_inputs.graph.epoch(keep, config.p, plan, stale or exchange)
        model.train()
        torch.manual_seed(derive_seed(config.seed, comm.rank, epoch, 1))  # dropout
        with account.timed("forward"), account.saved_tensors():
            logits = model(train_inputs.features, g, train_inputs.x_agg)
            mask = train_inputs.train_mask
            loss_sum = _loss_sum(logits[mask], train_inputs.labels[mask], shard.multilabel)
        optimizer.zero_grad(set_to_none=False)
        with account.timed("backward"):
            (loss_sum / global_train).backward()
        with account.timed("reduction"):
            reducer.finish()
        optimizer.step()
        account.values.update(loss_sum=float(loss_sum.detach()), sampled_boundary=plan.num_received)
        evaluate = (config.eval_every and (epoch + 1) % config.eval_every == 0) or epoch + 1 == config.epochs
        if evaluate:
            with account.timed("evaluation"):
                scores = _evaluate(model, eval_inputs, shard, comm, exchange)
        account.values["epoch_time"] = time.perf_counter() - t0
        account.take_comm(comm)
        table = account.gather(comm)
        totals += table
        last_loss = float(table[:, INDEX["loss_sum"]].sum()) / global_train
        record = _epoch_record(epoch + 1, last_loss, table)
        if evaluate:
            record.update(scores)
            if scores["val_score"] > best["val_score"]:
                best = {"val_score": scores["val_score"], "epoch": epoch + 1, "test_score": scores["test_score"], "state": copy.deepcopy(model.state_dict())}
        if comm.rank == 0:
            metrics.write(record)
            if evaluate:
                log.info("epoch %d loss %.4f train %.4f val %.4f test %.4f (%.3fs/epoch)", epoch + 1, last_loss, scores["train_score"], scores["val_score"], scores["test_score"], record["time"]["epoch"])
        if config.checkpoint_every and (epoch + 1) % config.checkpoint_every == 0:
            if stale is not None:  # every part is written before rank 0 writes the checkpoint
                stale.drain()
                checkpoint.save_part(run_dir, epoch + 1, comm.rank, {"sample": {"p": config.p, "seed": config.seed}, **stale.state_dict()})
                comm.barrier()
            if comm.rank == 0:
                checkpoint.save(run_dir, epoch + 1, {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "best": best, "signature": signature}, config.keep_checkpoints)
        if config.checkpoint_every:
            comm.barrier()  # no rank runs ahead of a checkpoint it may have to resume from
        progress.update()
    progress.close()
    if stale is not None:
        stale.drain()  # the transfers for the epoch after the last one

    partition_bytes = tensor_bytes(shard.features, shard.labels, topo.indptr, topo.indices, topo.degree, topo.send_nodes, eval_inputs.x_agg, train_inputs.x_agg)
    figures = comm.all_gather_object(static_figures(comm, topo.n_inner, topo.n_boundary, topo.nnz, partition_bytes, baseline_rss))
    summary = {"summary": True, "epochs": config.epochs, "final_loss": last_loss, "best_val_score": best["val_score"], "best_epoch": best["epoch"], "test_score": best["test_score"], "run_dir": str(run_dir)}
    if comm.rank == 0:
        epochs_run = config.epochs - start_epoch
        report.write(run_dir, report.build(figures, totals / max(epochs_run, 1), COLUMNS, {"config": resolved.to_json(), "world_size": comm.world_size, "epochs": epochs_run}))
        if best["state"] is not None:
            torch.save(best["state"], run_dir / "best_model.pt")
        metrics.write(summary)
        metrics.close()
        log.info("best val %.4f at epoch %d, test %.4f; run directory %s", best["val_score"], best["epoch"], best["test_score"], run_dir)
    return summary | {"model": model}


def _stale_part(part: dict, config: TrainConfig, run_dir: Path, epoch: int, rank: int) -> dict:
    """A checkpoint part's stale rows belong to the samples of its --p and --seed: refuse others."""
    p, seed = part["sample"]["p"], part["sample"]["seed"]
    if (p, seed) != (config.p, config.seed):
        path = checkpoint.part_path(run_dir, epoch, rank)
        raise UserError(f"{path} holds stale boundary rows sampled with --p {p:g} --seed {seed}; resume --staleness 1 with those, or pass a new --out")
    return part


def _sample(config: TrainConfig, comm: Comm, inputs: GraphInputs, epoch: int) -> tuple[Tensor, ExchangePlan]:
    """Epoch ``epoch``'s boundary sample (bool [n_boundary]) and its plan; all ranks call together."""
    keep = sample_boundary(inputs.topology.boundary_counts, config.p, config.seed, comm.rank, epoch)
    return keep, inputs.planner.sample(keep, config.p)


def _epoch_record(epoch: int, loss: float, table: Tensor) -> dict:
    """The job-level JSON line of one epoch: times of the slowest rank, bytes of all ranks."""
    col = lambda name: table[:, INDEX[name]]  # noqa: E731
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
def _evaluate(model: GNN, inputs: GraphInputs, shard: Shard, comm: Comm, exchange: BoundaryExchange) -> dict[str, float]:
    """Full-graph scores (no sampling, no dropout) on every rank, counts summed over ranks."""
    model.eval()
    keep = torch.ones(inputs.topology.n_boundary, dtype=torch.bool)
    g = inputs.graph.epoch(keep, 1.0, inputs.planner.full(), exchange, traffic="evaluation")
    logits = model(inputs.features, g, inputs.x_agg)
    counts = comm.all_reduce(_score_counts(logits, shard).to(comm.device)).cpu()
    return _scores(counts, shard.multilabel)
