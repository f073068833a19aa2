"""Stragglers: time to accuracy of every ``--sync`` mode, with and without ``--work-pool``,
when some ranks are slower (injected delays), on the emulated cluster.

    python -m benchmarks.stragglers                     # the full plan: 2 nodes x 4 ranks, 1gbit
    python -m benchmarks.stragglers --only pool-gossip1 # one run again (its record is replaced)
    python -m benchmarks.stragglers --quick --no-cluster --out /tmp/s.json   # tiny, 4 ranks, loopback
    python -m benchmarks.stragglers --dry-run           # print the plan, run nothing
    python -m benchmarks.stragglers --render benchmarks/results/stragglers.json   # tables again
    python -m benchmarks.stragglers --relative-delays --out /tmp/r.json   # delays scaled to this machine

Every run trains the same model (GraphSAGE 2 x 64, dropout 0.2, no precomputation, Adam lr
0.01, layer norm) with the same seed on the suite's synthetic accuracy graph
(:data:`benchmarks.suite.ACCURACY`), with injected delays as in the straggler studies of
grouped and partial reduction (g-ARAR, g-ARPS, mw-PR, which simulated stragglers with
per-epoch sleeps): of 8 ranks, 3 slow (0.8 s), 2 medium (0.4 s) and 3 fast (0 s) per epoch,
spread over both nodes (slow 0, 1, 4; medium 2, 5; fast 3, 6, 7; ranks 0-3 on node 0).
With ``--work-pool`` the delay is per step (one per partition taken) and the set has 32
parts, so it is scaled by ranks / parts = 8 / 32 (0.2 s and 0.1 s per partition): a slow
machine is as slow per unit of work as without the pool.

Runs (:func:`plan`): synchronous ``allreduce`` at p = 0 (the baseline) and p = 0.1 on 8 parts;
every decoupled ``--sync`` without the pool at p = 0 on 8 parts; every ``--sync``, allreduce
included, with ``--work-pool`` on 32 parts at p = 0. Each is one multi-node job on the
emulated cluster (:mod:`benchmarks.cluster`: network namespaces, links capped at 1 Gbit/s),
or with ``--no-cluster`` one ``bnsgcn-train --procs N`` on loopback.

Time: with a decoupled ``--sync`` the epoch records are gathered at sync points only and
``time.epoch`` is the slowest rank's epoch, so their sum overstates a run. A run's training
seconds at epoch ``e`` are ``time.elapsed`` of ``e`` (wall seconds from the first epoch's
start to when the last rank ended ``e``) minus the evaluation seconds of the epochs up to
``e`` (each epoch's slowest rank's). Time to accuracy: those seconds at the first evaluated
epoch whose validation score reaches the best validation score of the ``allreduce`` p = 0 run
of the same seed minus 1 point (0.01). The target: the best decoupled or pool mode
reaches that in at most 0.6x the ``allreduce`` p = 0 run's time.

Delays relative to the machine (``--relative-delays``): the fixed delays make a different
regime on a slower or faster CPU (the baseline's epoch is mostly the slow ranks' sleep, which
does not change, while the pool's epochs are compute and scale with the CPU). With the flag a
short calibration job (the baseline for :data:`CALIBRATION_EPOCHS` epochs) measures what this
machine adds to the slowest rank's sleep per epoch, and every delay is scaled by that over the
same figure on the machine the delays were set on (:attr:`Setting.reference_non_delay_s`), as
the emulated cluster scales the links to keep a GPU cluster's ratio of communication to
compute.

Results go to ``--out`` (rewritten atomically after every run); tables to stdout; with
matplotlib a figure of the validation curves next to it (``<out>-curves.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runnable from a checkout without installing the package
    sys.path.insert(0, str(REPO))

from benchmarks import cluster  # noqa: E402
from benchmarks.suite import ACCURACY, _table, execute, machine, write_json  # noqa: E402
from bnsgcn.errors import UserError  # noqa: E402
from bnsgcn.metrics import report  # noqa: E402

TARGET_POINTS = 0.01  # the target: the baseline's best validation score minus 1 point
TARGET_RATIO = 0.6  # the target: the best mode reaches it in <= 0.6x the baseline's time
BASELINE = "allreduce"  # the label of the synchronous p = 0 run that sets the target
TARGET_TEXT = "the best mode reaches synchronous all-reduce's accuracy (within 1 point) in <= 0.6x the time"
CALIBRATION_EPOCHS = 20  # --relative-delays: the calibration job's epochs (the first two are left out)


@dataclass(frozen=True)
class Setting:
    """What one preset runs on: graph, cluster shape, model, delays, epochs."""

    name: str
    graph: str
    nodes: int
    ranks_per_node: int
    parts: int  # the partition set without the pool: one part per rank
    pool_parts: int  # the partition set of --work-pool runs
    link: str
    model_flags: tuple[str, ...]
    eval_every: int
    delays: dict[int, float]  # rank -> seconds per epoch (no pool)
    epochs: int  # runs without the pool (one epoch: one step per rank)
    pool_epochs: dict[str, int]  # decoupled --sync with the pool -> epochs ("*": the others)
    syncs: tuple[str, ...]  # decoupled modes without the pool
    pool_syncs: tuple[str, ...]  # every mode with the pool (allreduce first)
    baseline_p: tuple[float, ...]  # allreduce without the pool at these p (0 first: the baseline)
    timeout_s: float
    # the baseline's seconds per epoch beyond its slowest rank's delay on the machine the delays
    # were set on: --relative-delays scales them by this machine's figure over this one
    reference_non_delay_s: float
    # decoupled --sync with the pool -> --eval-every of an extra run: its epochs are shorter,
    # so evaluations (sync points, where every rank meets) as often in seconds as the baseline's
    pool_eval_every: dict[str, int] = field(default_factory=dict)

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node


# The suite's accuracy model and graph (ACCURACY_FLAGS but --eval-every): every layer
# aggregates every epoch, so each step is a full forward and backward pass.
MODEL_FLAGS = (
    "--model",
    "graphsage",
    "--layers",
    "2",
    "--hidden",
    "64",
    "--dropout",
    "0.2",
    "--no-precompute",
    "--lr",
    "0.01",
)
FULL = Setting(
    name="full",
    graph=ACCURACY,
    nodes=2,
    ranks_per_node=4,
    parts=8,
    pool_parts=32,
    link="1gbit",
    model_flags=MODEL_FLAGS,
    eval_every=5,
    delays={0: 0.8, 1: 0.8, 4: 0.8, 2: 0.4, 5: 0.4},  # slow 0, 1, 4; medium 2, 5; fast 3, 6, 7
    # Each run trains for about the baseline's training seconds (~90 s): without the pool and
    # with allreduce every epoch waits for the slowest rank (0.8 s); the decoupled pool modes
    # measured 0.63 (grouped), 0.46 (partial:4), 0.51 (gossip:1), 0.30 (gossip:4) and 0.15 s
    # (partial:2) per epoch here, so they get more epochs in the same time.
    epochs=100,
    pool_epochs={"*": 200, "gossip:4": 300, "partial:2": 600},
    syncs=("grouped:5", "partial:4", "partial:6", "gossip:1", "gossip:4"),
    pool_syncs=("allreduce", "grouped:5", "grouped:1", "partial:2", "partial:4", "gossip:1", "gossip:4"),
    baseline_p=(0.0, 0.1),
    timeout_s=900,
    # the epoch's time outside the injected sleep: the median seconds per epoch of allreduce at
    # no delay on the reference Xeon, less the 0.8 s sleep
    reference_non_delay_s=0.051,
    # 5 epochs of the baseline (0.9 s each) are about 30 of pool partial:2 (0.15 s) and 15 of
    # pool gossip:4 (0.29 s)
    pool_eval_every={"partial:2": 30, "gossip:4": 15},
)
QUICK = Setting(
    name="quick",
    graph="synthetic:nodes=800,degree=20,classes=4,features=16,homophily=0.9,noise=5",
    nodes=2,
    ranks_per_node=2,
    parts=4,
    pool_parts=8,
    link="1gbit",
    model_flags=(
        "--model",
        "graphsage",
        "--layers",
        "2",
        "--hidden",
        "16",
        "--dropout",
        "0.2",
        "--no-precompute",
        "--lr",
        "0.01",
    ),
    eval_every=2,
    delays={0: 0.1, 2: 0.05},  # slow 0 (node 0), medium 2 (node 1), fast 1, 3
    epochs=10,
    pool_epochs={"*": 10},
    syncs=("partial:2",),
    pool_syncs=("allreduce", "gossip:1"),
    baseline_p=(0.0, 0.1),
    timeout_s=120,
    reference_non_delay_s=0.05,
)


@dataclass(frozen=True)
class Planned:
    """One training job of the plan."""

    label: str
    sync: str
    pool: bool
    p: float
    epochs: int
    seed: int
    delay_spec: str  # --inject-delay as passed: per epoch, or per step with the pool
    parts: int
    eval_every: int

    @property
    def name(self) -> str:
        return f"{self.label}-s{self.seed}"


def delay_spec(delays: dict[int, float], scale: float = 1.0) -> str:
    """``--inject-delay`` of per-rank seconds times ``scale`` (``0:0.8,1:0.8,...``)."""
    return ",".join(f"{rank}:{seconds * scale:g}" for rank, seconds in sorted(delays.items()))


def label(sync: str, pool: bool, p: float = 0.0) -> str:
    """``allreduce``, ``allreduce-p0.1``, ``gossip1``, ``pool-grouped5-3``, ..."""
    text = sync.replace(":", "", 1).replace(":", "-") + (f"-p{p:g}" if p else "")
    return ("pool-" if pool else "") + text


def plan(setting: Setting, seeds: tuple[int, ...], scale: float = 1.0) -> list[Planned]:
    """Every run, baseline first (its best validation score sets the others' target), with
    the setting's delays times ``scale`` (``--relative-delays``)."""
    per_epoch = delay_spec(setting.delays, scale)
    per_step = delay_spec(setting.delays, scale * setting.ranks / setting.pool_parts)
    runs = []
    for seed in seeds:
        runs += [
            Planned(
                label("allreduce", False, p),
                "allreduce",
                False,
                p,
                setting.epochs,
                seed,
                per_epoch,
                setting.parts,
                setting.eval_every,
            )
            for p in setting.baseline_p
        ]
        runs += [
            Planned(label(s, False), s, False, 0.0, setting.epochs, seed, per_epoch, setting.parts, setting.eval_every)
            for s in setting.syncs
        ]
        # allreduce with the pool steps in lockstep rounds: its epochs take as long as without
        for s in setting.pool_syncs:
            epochs = setting.epochs if s == "allreduce" else setting.pool_epochs.get(s, setting.pool_epochs["*"])
            runs.append(
                Planned(label(s, True), s, True, 0.0, epochs, seed, per_step, setting.pool_parts, setting.eval_every)
            )
            if s in setting.pool_eval_every:
                every = setting.pool_eval_every[s]
                runs.append(
                    Planned(
                        f"{label(s, True)}-e{every}", s, True, 0.0, epochs, seed, per_step, setting.pool_parts, every
                    )
                )
    return runs


# ---------------------------------------------------------------------------- running


def parts_dir(work: Path, setting: Setting, parts: int) -> Path:
    return work / "parts" / f"{cluster.graph_key(setting.graph, None)}-metis-{parts}"


def partition_command(work: Path, setting: Setting, parts: int) -> list[str]:
    """METIS into ``parts``; bnsgcn-partition keeps an identical set already at --out."""
    return [
        "bnsgcn-partition",
        setting.graph,
        "--parts",
        str(parts),
        "--method",
        "metis",
        "--out",
        str(parts_dir(work, setting, parts)),
    ]


def train_flags(work: Path, setting: Setting, run: Planned) -> tuple[str, ...]:
    """The bnsgcn-train flags of a run beyond where it runs (after the cluster's own, so they win)."""
    flags = [
        "--parts-dir",
        str(parts_dir(work, setting, run.parts)),
        *setting.model_flags,
        "--eval-every",
        str(run.eval_every),
        "--seed",
        str(run.seed),
        "--sync",
        run.sync,
        "--inject-delay",
        run.delay_spec,
    ]
    return tuple(flags + (["--work-pool"] if run.pool else []))


@dataclass(frozen=True)
class ClusterRun(cluster.Run):
    """A :class:`benchmarks.cluster.Run` named by the plan (the flags hold the partition set)."""

    label: str = ""

    @property
    def name(self) -> str:
        return self.label


def cluster_run(work: Path, setting: Setting, run: Planned) -> ClusterRun:
    return ClusterRun(
        setting.graph,
        None,
        "metis",
        setting.nodes,
        setting.ranks_per_node,
        setting.link,
        run.p,
        "auto",
        "graphsage",
        run.epochs,
        threads_per_rank(setting),
        train_flags(work, setting, run),
        label=run.name,
    )


def threads_per_rank(setting: Setting) -> int:
    return max(1, (os.cpu_count() or 1) // setting.ranks)


def loopback_command(work: Path, setting: Setting, run: Planned) -> list[str]:
    """``--no-cluster``: one launcher starting every rank on this machine."""
    return [
        "bnsgcn-train",
        "--procs",
        str(setting.ranks),
        "--threads",
        str(threads_per_rank(setting)),
        "--p",
        f"{run.p:g}",
        "--epochs",
        str(run.epochs),
        "--out",
        str(work / "runs" / run.name),
        *train_flags(work, setting, run),
    ]


def read_records(run_dir: Path) -> tuple[list[dict], dict]:
    """The epoch lines (in epoch order) and the summary line of a run's metrics.jsonl."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    epochs = sorted((line for line in lines if "time" in line), key=lambda line: line["epoch"])
    return epochs, next((line for line in lines if line.get("summary")), {})


def training_curve(epochs: list[dict]) -> list[tuple[int, float, float, float]]:
    """(epoch, training seconds, validation score, test score) of every evaluated epoch:
    ``time.elapsed`` minus the evaluation seconds of every epoch up to it."""
    curve, evaluation = [], 0.0
    for record in epochs:
        evaluation += record["time"].get("evaluation", 0.0)
        if record.get("val_score") is not None:
            curve.append(
                (record["epoch"], record["time"]["elapsed"] - evaluation, record["val_score"], record["test_score"])
            )
    return curve


def non_delay_seconds(epochs: list[dict], delays: dict[int, float]) -> float:
    """What a machine adds to the injected sleep: the median epoch of a synchronous run
    (``time.elapsed`` steps less evaluation), past the first two (start-up), less the slowest
    rank's delay."""
    ends = [record["time"]["elapsed"] for record in epochs]
    seconds = [b - a - record["time"].get("evaluation", 0.0) for a, b, record in zip(ends, ends[1:], epochs[1:])][1:]
    if not seconds:
        raise UserError(f"the calibration job ran {len(epochs)} epochs; it needs at least 3")
    return float(sorted(seconds)[len(seconds) // 2]) - max(delays.values(), default=0.0)


def calibration_run(setting: Setting) -> Planned:
    """The baseline with the setting's fixed delays, evaluated once at its end."""
    return Planned(
        "calibration",
        "allreduce",
        False,
        0.0,
        CALIBRATION_EPOCHS,
        0,
        delay_spec(setting.delays),
        setting.parts,
        CALIBRATION_EPOCHS,
    )


def read_run(run_dir: Path, run: Planned) -> dict:
    """The figures of one finished run."""
    epochs, summary = read_records(run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    ranks = report.load(run_dir)["ranks"]
    per_epoch_steps = [record["per_rank"]["steps"] for record in epochs]
    per_rank = lambda key: [sum(r["per_rank"][key][i] for r in epochs) for i in range(len(ranks))]  # noqa: E731
    evaluation = sum(r["time"].get("evaluation", 0.0) for r in epochs)
    elapsed = epochs[-1]["time"]["elapsed"]
    curve = training_curve(epochs)
    return {
        "epochs_run": len(epochs),
        "exchange": config.get("exchange"),
        "best_val_score": summary.get("best_val_score"),
        "best_epoch": summary.get("best_epoch"),
        "test_score": summary.get("test_score"),  # at the best validation epoch
        "final_val_score": curve[-1][2] if curve else None,
        "val_curve": [[e, s, v] for e, s, v, _ in curve],
        "test_curve": [[e, t] for e, _, _, t in curve],
        "elapsed_s": elapsed,
        # the first epoch: start-up work on first use (building graphs, compiling kernels when
        # their on-disk cache is stale), the same in every mode unless something stalls it
        "first_epoch_s": epochs[0]["time"]["elapsed"] - epochs[0]["time"].get("evaluation", 0.0),
        "first_epoch_compute_s": epochs[0]["time"].get("compute"),
        "evaluation_s": evaluation,
        "training_s": elapsed - evaluation,
        "training_s_per_epoch": (elapsed - evaluation) / len(epochs),
        "steps_per_rank": [int(sum(s[i] for s in per_epoch_steps)) for i in range(len(ranks))],
        "steps_per_rank_report": [r.get("steps") for r in ranks],
        "steps_per_epoch": per_epoch_steps,
        "injected_delay_s_per_rank": per_rank("injected_delay"),
        "sync_s_per_rank": per_rank("sync"),
        "idle_s_per_rank": per_rank("idle"),
    }


def attach_targets(document: dict) -> None:
    """``time_to_accuracy`` on every run (against the baseline of its seed) and the
    target (``document["target"]``)."""
    runs = [r for r in document["runs"] if "error" not in r]
    baselines = {r["seed"]: r for r in runs if r["label"] == BASELINE}
    for run in runs:
        base = baselines.get(run["seed"])
        if base is None or not base["val_curve"]:
            run["time_to_accuracy"] = None
            continue
        target = base["best_val_score"] - TARGET_POINTS
        reached = next(((e, s) for e, s, v in run["val_curve"] if v >= target), None)
        run["time_to_accuracy"] = {"target": target, "epoch": reached and reached[0], "seconds": reached and reached[1]}
        if reached and "first_epoch_s" in run:
            run["time_to_accuracy"]["seconds_after_first_epoch"] = reached[1] - run["first_epoch_s"]
    for run in runs:
        mine, base = run.get("time_to_accuracy"), baselines.get(run["seed"], {}).get("time_to_accuracy")
        run["time_ratio"] = (
            mine["seconds"] / base["seconds"]
            if mine and base and mine["seconds"] is not None and base["seconds"]
            else None
        )
        after = lambda t: t and t.get("seconds_after_first_epoch")  # noqa: E731
        run["time_ratio_after_first_epoch"] = (
            after(mine) / after(base) if after(mine) is not None and after(base) else None
        )
    document["target"] = target_verdict(runs)
    document["target_after_first_epoch"] = target_verdict(
        runs, "time_ratio_after_first_epoch", "seconds_after_first_epoch"
    )


def target_verdict(runs: list[dict], ratio: str = "time_ratio", seconds: str = "seconds") -> dict:
    """The target, over the decoupled and pool modes (allreduce itself excluded),
    per seed: the smallest time ratio among the runs that reached the baseline's target
    (``ratio``/``seconds``: the keys of the measure, training seconds or those after the first epoch)."""
    out = {"text": TARGET_TEXT, "points": TARGET_POINTS, "ratio": TARGET_RATIO, "per_seed": []}
    for seed in sorted({r["seed"] for r in runs}):
        base = next((r for r in runs if r["seed"] == seed and r["label"] == BASELINE), None)
        if base is None or not base.get("time_to_accuracy") or base["time_to_accuracy"].get(seconds) is None:
            continue
        modes = [r for r in runs if r["seed"] == seed and r["sync"] != "allreduce"]
        reached = [r for r in modes if r.get(ratio) is not None]
        best = min(reached, key=lambda r: r[ratio]) if reached else None
        out["per_seed"].append(
            {
                "seed": seed,
                "baseline_best_val": base["best_val_score"],
                "target_val": base["time_to_accuracy"]["target"],
                "baseline_seconds": base["time_to_accuracy"][seconds],
                "best_mode": best and best["label"],
                "best_seconds": best and best["time_to_accuracy"][seconds],
                "best_ratio": best and best[ratio],
                "met": bool(best and best[ratio] <= TARGET_RATIO),
                "not_reached": [r["label"] for r in modes if r.get(ratio) is None],
            }
        )
    out["met"] = bool(out["per_seed"]) and all(s["met"] for s in out["per_seed"])
    return out


def load_document(out: Path) -> dict:
    try:
        return json.loads(out.read_text())
    except (OSError, ValueError):
        return {"runs": []}


def benchmark(
    setting: Setting,
    make_runs: Callable[[float], list[Planned]],
    work: Path,
    out: Path,
    command: str,
    use_cluster: bool,
    relative: bool = False,
) -> dict:
    """Partition, (build the cluster and measure its link,) (calibrate the delays,) run
    ``make_runs(scale)`` (the delays times ``scale``: 1 unless ``relative``); the document."""
    earlier = load_document(out)
    document = earlier | {
        "benchmark": "stragglers",
        "preset": setting.name,
        "date": date.today().isoformat(),
        "machine": machine(),
        "setting": asdict(setting) | {"ranks": setting.ranks, "cluster": use_cluster},
        "relative_delays": relative,
    }
    if (earlier.get("preset"), earlier.get("relative_delays", False)) != (
        setting.name,
        relative,
    ):  # records of another plan
        document["runs"], document["commands"] = [], []
        document.pop("delay_scale", None)
    document["commands"] = document.get("commands", []) + [command]  # every invocation whose records are here
    records = {r["name"]: r for r in document["runs"]}
    scale = 1.0
    for parts in dict.fromkeys(r.parts for r in make_runs(scale)):
        command_ = partition_command(work, setting, parts)
        print(f"partition: {shlex.join(command_)}", file=sys.stderr, flush=True)
        error = execute(command_, os.cpu_count() or 1, int(setting.timeout_s))[1]
        if error is not None:
            raise UserError(f"partitioning failed: {error.splitlines()[-1]}")

    def calibrate(execute_run) -> float:
        """--relative-delays: measure this machine; the delays' scale."""
        run = calibration_run(setting)
        print(f"calibration: {run.epochs} epochs of the baseline with the fixed delays", file=sys.stderr, flush=True)
        shutil.rmtree(work / "runs" / run.name, ignore_errors=True)
        error, _ = execute_run(run)
        if error is not None:
            raise UserError(f"the calibration job failed: {error.splitlines()[-1]}")
        measured = non_delay_seconds(read_records(work / "runs" / run.name)[0], setting.delays)
        if measured <= 0:
            raise UserError(
                f"the calibration job's epochs took no longer than its slowest delay ({measured:+.3f} s); "
                "run it again on a quieter machine"
            )
        measured_scale = measured / setting.reference_non_delay_s
        document["delay_scale"] = {
            "reference_non_delay_s": setting.reference_non_delay_s,
            "measured_non_delay_s": measured,
            "scale": measured_scale,
            "calibration_epochs": run.epochs,
        }
        print(
            f"  {measured:.3f} s per epoch beyond the delays (reference {setting.reference_non_delay_s:g} s): "
            f"delays x {measured_scale:.3f}",
            file=sys.stderr,
            flush=True,
        )
        return measured_scale

    def one(i: int, total: int, run: Planned, execute_run) -> None:
        print(f"[{i}/{total}] {run.name}", file=sys.stderr, flush=True)
        record = asdict(run) | {
            "name": run.name,
            "date": date.today().isoformat(),
            "ranks": setting.ranks,
            "delays_per_epoch": {str(k): v * scale for k, v in setting.delays.items()},
        }
        shutil.rmtree(work / "runs" / run.name, ignore_errors=True)
        start = time.perf_counter()
        error, extra = execute_run(run)
        record["wall_s"] = time.perf_counter() - start
        record |= extra
        if error is None:
            try:
                record |= read_run(work / "runs" / run.name, run)
            except (OSError, ValueError, KeyError, IndexError) as exc:
                error = f"unreadable run directory: {exc!r}"
        if error is not None:
            record["error"] = error
            print(f"  failed: {error}", file=sys.stderr)
        else:
            print(
                f"  best val {record['best_val_score']:.4f}, test {record['test_score']:.4f}, "
                f"training {record['training_s']:.1f} s, "
                f"wall {record['wall_s']:.1f} s, steps {record['steps_per_rank']}",
                file=sys.stderr,
                flush=True,
            )
        records[run.name] = record
        document["runs"] = list(records.values())
        attach_targets(document)
        write_json(out, document)

    def run_all(execute_run) -> None:
        nonlocal scale
        if relative:
            scale = calibrate(execute_run)
        runs = make_runs(scale)
        for i, run in enumerate(runs, 1):
            one(i, len(runs), run, execute_run)

    if not use_cluster:

        def on_loopback(run: Planned) -> tuple[str | None, dict]:
            command_ = loopback_command(work, setting, run)
            return execute(command_, threads_per_rank(setting), int(setting.timeout_s))[1], {
                "command": shlex.join(command_)
            }

        run_all(on_loopback)
        return document

    removed = cluster.remove_leftovers()
    if removed:
        print(f"removed leftovers of an earlier, killed run: {', '.join(removed)}", file=sys.stderr)
    rate = cluster.parse_rate(setting.link)
    with cluster.emulated_cluster(setting.nodes, rate) as made:
        measured = cluster.measure_link(made)
        document["link"] = {"requested": setting.link, "rate_bit_s": rate, "measured_gbit_s": measured}
        print(f"link {setting.link}: measured {measured:.3f} Gbit/s from node 0 to node 1", file=sys.stderr, flush=True)

        def on_cluster(run: Planned) -> tuple[str | None, dict]:
            job = cluster_run(work, setting, run)
            commands = [shlex.join(cluster.node_command(work, job, made, i)) for i in range(setting.nodes)]
            return cluster.run_nodes(work, job, made, setting.timeout_s), {"commands": commands}

        run_all(on_cluster)
    return document


# ---------------------------------------------------------------------------- output


def _s(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _steps(record: dict) -> str:
    return " ".join(str(s) for s in record["steps_per_rank"])


def _names(records: list[dict]) -> list[str]:
    """The runs' labels, with the seed when there are several."""
    several = len({r["seed"] for r in records}) > 1
    return [r["name"] if several else r["label"] for r in records]


def run_table(records: list[dict]) -> str:
    head = [
        "run",
        "--sync",
        "pool",
        "parts",
        "p",
        "epochs",
        "best val",
        "test at best val",
        "final val",
        "to target: epoch / training s",
        "/ allreduce",
        "after epoch 1: s / ratio",
        "epoch 1 s",
        "training s",
        "s per epoch",
        "wall s",
        "steps per rank (0-7)",
    ]
    rows = []
    for name, r in zip(_names(records), records):
        reached = r.get("time_to_accuracy") or {}
        to = (
            "-"
            if not reached
            else (f"{reached['epoch']} / {reached['seconds']:.1f}" if reached["seconds"] is not None else "not reached")
        )
        after = reached.get("seconds_after_first_epoch")
        after = "-" if after is None else f"{after:.1f} / {_s(r.get('time_ratio_after_first_epoch'), 2)}"
        rows.append(
            [
                name,
                f"`{r['sync']}`",
                "yes" if r["pool"] else "no",
                str(r["parts"]),
                f"{r['p']:g}",
                str(r["epochs"]),
                f"{r['best_val_score']:.4f}",
                f"{r['test_score']:.4f}",
                f"{r['final_val_score']:.4f}",
                to,
                _s(r.get("time_ratio"), 2),
                after,
                _s(r.get("first_epoch_s")),
                _s(r["training_s"]),
                _s(r["training_s_per_epoch"], 3),
                _s(r["wall_s"]),
                _steps(r),
            ]
        )
    return _table(head, rows)


def wait_table(records: list[dict]) -> str:
    """Seconds per rank over the run: injected delay, parameter sync, idle at gathering points."""
    head = ["run", "injected delay s (rank 0-7)", "sync s (rank 0-7)", "idle s (rank 0-7)"]
    fmt = lambda values: " ".join(f"{v:.1f}" for v in values)  # noqa: E731
    return _table(
        head,
        [
            [name, fmt(r["injected_delay_s_per_rank"]), fmt(r["sync_s_per_rank"]), fmt(r["idle_s_per_rank"])]
            for name, r in zip(_names(records), records)
        ],
    )


def curve_table(records: list[dict], step_s: float = 10.0) -> str:
    """The validation curves against training seconds: per run, the score of its last
    evaluation at or before every ``step_s`` seconds (blank past the run's end)."""
    end = max(s for r in records for _, s, _ in r["val_curve"])
    step = step_s if end > 2 * step_s else max(end / 5, 1e-3)
    marks = [step * i for i in range(1, int(end / step) + 2)]
    head = ["run", *(f"{t:g} s" for t in marks)]

    def at(r: dict, t: float) -> str:
        if t - step >= r["val_curve"][-1][1]:
            return ""
        seen = [v for _, s, v in r["val_curve"] if s <= t]
        return f"{seen[-1]:.3f}" if seen else "-"

    return _table(head, [[name, *(at(r, t) for t in marks)] for name, r in zip(_names(records), records)])


def verdict_lines(target: dict) -> list[str]:
    out = []
    for s in target.get("per_seed", []):
        met = "**met**" if s["met"] else "**not met**"
        best = (
            f"best {s['best_mode']}: {s['best_seconds']:.1f} s / {s['baseline_seconds']:.1f} s = {s['best_ratio']:.2f}"
            if s["best_mode"]
            else "no mode reached the target"
        )
        out.append(
            f"seed {s['seed']}: target val {s['target_val']:.4f} "
            f"(allreduce p = 0 best {s['baseline_best_val']:.4f} - 0.01); "
            f"{best} (<= {TARGET_RATIO}: {met}); not reached: {', '.join(s['not_reached']) or 'none'}"
        )
    return out


def delays_text(document: dict) -> str:
    delays, scaling = document["setting"]["delays"], document.get("delay_scale")
    if not scaling:
        return str(delays)
    return (
        f"{ {k: round(v * scaling['scale'], 3) for k, v in delays.items()} } "
        f"({delays} x {scaling['scale']:.3f}, --relative-delays: this machine "
        f"adds {scaling['measured_non_delay_s']:.3f} s per epoch to the delays, "
        f"the reference machine {scaling['reference_non_delay_s']:g} s)"
    )


def render(document: dict) -> str:
    setting = document["setting"]
    ok = [r for r in document["runs"] if "error" not in r]
    link = document.get("link")
    where = (
        f"{setting['nodes']} nodes x {setting['ranks_per_node']} ranks, "
        f"link {link['requested']} (measured {link['measured_gbit_s']:.2f} Gbit/s)"
        if setting["cluster"] and link
        else f"{setting['ranks']} ranks on loopback (--no-cluster)"
    )
    commands = "; ".join(f"`{c}`" for c in document.get("commands", []))
    out = [
        f"Preset `{document['preset']}`, {document['date']}, {document['machine']['cores']} cores; {where}; "
        f"graph `{setting['graph']}`; "
        f"delays per epoch {delays_text(document)}; commands: {commands}",
        "",
    ]
    if ok:
        out += [
            "Runs (training s: time.elapsed minus evaluation; "
            "time to target against allreduce p = 0 of the same seed):",
            "",
            run_table(ok),
            "",
            "Per rank over the run (seconds):",
            "",
            wait_table(ok),
            "",
            "Validation score against training seconds (the last evaluation by then):",
            "",
            curve_table(ok),
            "",
        ]
    out += [f"Failed: {r['name']}: {r['error']}" for r in document["runs"] if "error" in r]
    if document.get("target"):
        out += [f"Target: {TARGET_TEXT}:", ""] + [f"* {line}" for line in verdict_lines(document["target"])]
    if document.get("target_after_first_epoch"):
        out += ["", "The same, training seconds counted from the end of epoch 1:", ""]
        out += [f"* {line}" for line in verdict_lines(document["target_after_first_epoch"])]
    return "\n".join(out).rstrip()


def figure(document: dict, stem: Path) -> Path | None:
    """``<stem>-curves.png``: validation score against training seconds, one line per run."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print(f"note: {report.PLOTS_HINT}", file=sys.stderr)
        return None
    ok = [r for r in document["runs"] if "error" not in r and r["val_curve"]]
    if not ok:
        return None
    fig = Figure(figsize=(9, 5), layout="constrained")
    ax = fig.subplots()
    colours = [
        f"tab:{c}" for c in ("blue", "orange", "green", "red", "purple", "brown", "pink", "gray", "olive", "cyan")
    ] + ["black", "gold", "navy", "lime"]
    for i, r in enumerate(ok):
        xs, ys = [s for _, s, _ in r["val_curve"]], [v for _, _, v in r["val_curve"]]
        style = "-" if r["pool"] else "--"
        ax.plot(
            xs,
            ys,
            style,
            color=colours[i % len(colours)],
            marker="." if r["sync"] == "allreduce" else None,
            label=r["name"],
            linewidth=2.5 if r["label"] == BASELINE else 1.2,
        )
    targets = {r["time_to_accuracy"]["target"] for r in ok if r.get("time_to_accuracy")}
    for t in targets:
        ax.axhline(t, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("training seconds (time.elapsed minus evaluation)")
    ax.set_ylabel("validation score")
    ax.set_ylim(0, 1.02)
    ax.set_title(
        f"stragglers ({document['preset']}): dashed without the pool, solid with it; dotted: target", fontsize="small"
    )
    ax.legend(fontsize="x-small", ncol=2)
    path = stem.with_name(stem.name + "-curves.png")
    fig.savefig(path, dpi=100)
    return path


# ---------------------------------------------------------------------------- the command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.stragglers", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    parser.add_argument("--quick", action="store_true", help="tiny graph, 2 x 2 ranks, 10 epochs (a smoke test)")
    parser.add_argument(
        "--no-cluster",
        action="store_true",
        help="run each job as one bnsgcn-train --procs N on loopback (no namespaces, no root)",
    )
    parser.add_argument(
        "--relative-delays",
        action="store_true",
        help="scale the delays to this machine by a calibration job (see the module); default: the fixed seconds",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds (default 0)")
    parser.add_argument(
        "--only",
        action="append",
        metavar="LABEL",
        help="run only this label (repeatable); other records in --out are kept",
    )
    parser.add_argument(
        "--work",
        type=Path,
        help="partition sets, run directories, logs (default <tmp>/bnsgcn-stragglers-<preset>, reused)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="result JSON (default benchmarks/results/stragglers.json; --quick: <tmp>/bnsgcn-stragglers-quick.json)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the commands and run nothing")
    parser.add_argument(
        "--render", type=Path, metavar="RESULT", help="print the tables of a saved result, redraw its figure, and exit"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.render:
        return cluster.show_saved(args.render, render, figure)
    setting = QUICK if args.quick else FULL
    labels = [r.label for r in plan(setting, tuple(args.seeds))]
    unknown = set(args.only or ()) - set(labels)
    if unknown:
        print(
            f"error: --only {sorted(unknown)[0]} is not a run of the plan; labels: {', '.join(dict.fromkeys(labels))}",
            file=sys.stderr,
        )
        return 2
    chosen = lambda scale: [r for r in plan(setting, tuple(args.seeds), scale) if not args.only or r.label in args.only]  # noqa: E731
    runs = chosen(1.0)
    work = args.work or Path(tempfile.gettempdir()) / f"bnsgcn-stragglers-{setting.name}"
    out = args.out or (
        Path(tempfile.gettempdir()) / "bnsgcn-stragglers-quick.json"
        if args.quick
        else REPO / "benchmarks" / "results" / "stragglers.json"
    )
    if args.dry_run:
        for parts in dict.fromkeys(r.parts for r in runs):
            print(shlex.join(partition_command(work, setting, parts)))
        for run in runs:
            if args.no_cluster:
                print(shlex.join(loopback_command(work, setting, run)))
            else:
                made = cluster.Cluster(os.getpid(), setting.nodes)
                job = cluster_run(work, setting, run)
                print(f"# {run.name}: every node at once")
                for i in range(setting.nodes):
                    print(shlex.join(cluster.in_node(made, i, cluster.node_command(work, job, made, i))))
        return 0
    command = "python -m benchmarks.stragglers " + shlex.join(argv)
    document = cluster.on_cluster(
        lambda: benchmark(setting, chosen, work, out, command, not args.no_cluster, args.relative_delays),
        namespaces=not args.no_cluster,
    )
    if isinstance(document, int):
        return document
    print(render(document))
    path = figure(document, out.with_suffix(""))
    if path:
        print(f"wrote {path}", file=sys.stderr)
    return 1 if any("error" in r for r in document["runs"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
