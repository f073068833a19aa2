"""The training benchmark suite: one command, a quick and a full preset.

    python -m benchmarks.suite --preset quick --out benchmarks/results/suite-quick.json
    python -m benchmarks.suite --preset full --work /scratch/bnsgcn-suite --out benchmarks/results/suite-full.json
    python -m benchmarks.suite --preset target                 # the 200,000-node reference graph only
    python -m benchmarks.suite --preset quick --dry-run        # print the plan, run nothing
    python -m benchmarks.suite --render benchmarks/results/suite-quick.json   # tables again

Everything runs as subprocesses, as a user would run it: ``bnsgcn-partition`` (random
partitioning, so that most edges are cut) then ``bnsgcn-train`` with ``cores // ranks``
threads per rank (at least 1), and the one-process references with ``cores`` threads
(:mod:`benchmarks.pyg_reference`, :mod:`benchmarks.compute_bound`). Each training run's
``metrics.jsonl`` and ``report.json`` are read back. Groups of runs:

* ``scaling``: epoch time, peak memory per rank and bytes per epoch for every p of the
  preset, 2 and 4 ranks, growing synthetic graphs, GraphSAGE (3 x 128, first layer
  precomputed) and GAT (3 layers, 4 heads x 32);
* ``reference``: on the reference graph, one rank at p = 1, PyTorch Geometric (both of its
  aggregation paths) and the compute-only bound, all with the same threads;
* ``baseline``: the same commands on a tiny graph: the resident memory of the process
  itself (Python, torch, numba, gloo), subtracted to get the memory the graph costs;
* ``accuracy``: best validation and its test accuracy against p on a graph where the
  neighbourhood carries the label (noisy features, high homophily, random partitions).

Epoch time is the median over the epochs after the first (warm-up) that do not evaluate,
of the slowest rank's epoch. Bytes per epoch are the features, gradients and selections
sent by all ranks, averaged over the epochs. Every training run also gets its time to
accuracy (:mod:`benchmarks.accuracy`): epochs and training seconds until its validation
score reaches 99% of the best of the p = 1 run of the same group, graph, model and ranks
(null where it evaluated only once, as the scaling runs do). The suite's four targets are computed from one
invocation (:func:`targets`). Results go to ``--out`` as JSON (rewritten after every run,
so an interrupted suite keeps what it measured), figures next to it when matplotlib is
installed, and markdown tables to stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runnable from a checkout without installing the package
    sys.path.insert(0, str(REPO))

from benchmarks.accuracy import attach_time_to_accuracy, validation_curve  # noqa: E402
from bnsgcn.errors import UserError  # noqa: E402
from bnsgcn.metrics import report  # noqa: E402

# console script -> the module it runs (executed as ``python -m module``, so the suite
# needs no installed entry points)
COMMANDS = {"bnsgcn-partition": "bnsgcn.partition.cli", "bnsgcn-train": "bnsgcn.launch.cli"}
MODELS = {
    "graphsage": {"layers": 3, "hidden": 128},  # first layer precomputed (the engine's default)
    "gat": {"layers": 3, "hidden": 32, "heads": 4},
}
TINY = "synthetic:nodes=400,degree=4,classes=16,features=128"
TARGETS = {
    "one_rank_vs_pyg": "one rank at p = 1: epoch time / PyTorch Geometric's (best path) <= 1.0",
    "bytes_vs_p": "bytes per epoch (features + gradients + selections) / (p x the p = 1 volume) within 1 +- 0.05",
    "memory_p001_vs_p1": "peak memory per rank at p = 0.01 / at p = 1, graph with boundary/inner >= 1: <= 0.6",
    "sampling_share": "sampling and index bookkeeping / epoch time < 0.10",
}


@dataclass(frozen=True)
class Preset:
    """What one preset runs. ``graphs``: name -> synthetic spec; ``scaling``: model ->
    graph name (smallest first) -> rank counts, each run for every p of ``ps``."""

    name: str
    graphs: dict[str, str]
    scaling: dict[str, dict[str, tuple[int, ...]]]
    ps: tuple[float, ...]
    epochs: int
    reference: dict[str, str]  # model -> graph name of the one-process comparison
    accuracy_graph: str | None  # None: no accuracy runs
    accuracy_ranks: int
    accuracy_epochs: int
    accuracy_flags: tuple[str, ...]
    timeout_s: int


PS = (1.0, 0.1, 0.01, 0.0)
# 8 random parts: 7 of 8 neighbours are boundary nodes, so p = 0 keeps an eighth of every
# neighbourhood; 100 neighbours per node keep the 1/p estimator's variance workable at p = 0.1.
ACCURACY = "synthetic:nodes=6000,degree=100,classes=8,features=16,homophily=0.9,noise=100"
# Every layer aggregates every epoch (no precomputation), so sampling reaches all layers.
ACCURACY_FLAGS = ("--layers", "2", "--hidden", "64", "--dropout", "0.2", "--no-precompute", "--eval-every", "10")
PRESETS = {
    "quick": Preset(
        name="quick",
        graphs={
            "20k": "synthetic:nodes=20000,degree=20,classes=16,features=128",
            "50k": "synthetic:nodes=50000,degree=25,classes=16,features=128",
            "200k": "synthetic:nodes=200000,degree=25,classes=16,features=128",  # 5M directed edges
            "acc": ACCURACY,
        },
        # 4 ranks on the 50k graph only: each launch costs 5-10 s of start-up here. The
        # 200k graph in 8 parts (boundary/inner 6.7) is where the memory target is read.
        scaling={"graphsage": {"20k": (2,), "50k": (2, 4), "200k": (8,)}, "gat": {"20k": (2,)}},
        ps=PS,
        epochs=5,
        reference={"graphsage": "50k"},
        accuracy_graph="acc",
        accuracy_ranks=8,
        accuracy_epochs=100,
        accuracy_flags=ACCURACY_FLAGS,
        timeout_s=600,
    ),
    # The reference case alone: GraphSAGE 3 x 128 on the 200,000-node,
    # 5M-edge graph, 2 ranks at p = 1 and 0.1, against PyG and the compute-only bound.
    "target": Preset(
        name="target",
        graphs={"200k": "synthetic:nodes=200000,degree=25,classes=16,features=128"},
        scaling={"graphsage": {"200k": (2,)}},
        ps=(1.0, 0.1),
        epochs=5,
        reference={"graphsage": "200k"},
        accuracy_graph=None,
        accuracy_ranks=0,
        accuracy_epochs=0,
        accuracy_flags=(),
        timeout_s=1800,
    ),
    "full": Preset(
        name="full",
        graphs={
            "20k": "synthetic:nodes=20000,degree=20,classes=16,features=128",
            "50k": "synthetic:nodes=50000,degree=25,classes=16,features=128",
            "200k": "synthetic:nodes=200000,degree=25,classes=16,features=128",  # 5M directed edges
            "acc": ACCURACY,
        },
        scaling={model: {"20k": (2, 4), "50k": (2, 4), "200k": (2, 4)} for model in MODELS},
        ps=PS,
        epochs=8,
        reference={"graphsage": "200k", "gat": "50k"},
        accuracy_graph="acc",
        accuracy_ranks=8,
        accuracy_epochs=300,
        accuracy_flags=ACCURACY_FLAGS,
        timeout_s=3600,
    ),
}


@dataclass(frozen=True)
class Step:
    """One measured process. ``kind``: ``train`` (bnsgcn-train), ``pyg`` or ``bound``."""

    name: str
    kind: str
    group: str
    graph: str  # name in the preset
    spec: str  # synthetic spec
    ranks: int
    model: str
    p: float = 1.0
    threads: int = 1
    epochs: int = 5
    variant: str = ""
    flags: tuple[str, ...] = ()


def threads_per_rank(ranks: int, cores: int) -> int:
    return max(1, cores // ranks)


def size_flags(model: str) -> tuple[str, ...]:
    """``--layers L --hidden H [--heads K]`` of a model, for bnsgcn-train and the references alike."""
    return tuple(x for k, v in MODELS[model].items() for x in (f"--{k}", str(v)))


def plan(preset: Preset, cores: int = 2) -> list[Step]:
    """Every process of the suite, in the order it runs (baselines first, accuracy last)."""
    steps: list[Step] = []

    def train(
        group: str, graph: str, spec: str, ranks: int, model: str, p: float, epochs: int, flags: tuple[str, ...] = ()
    ) -> Step:
        name = f"{group}-{model}-{graph}-r{ranks}-p{p:g}"
        return Step(
            name,
            "train",
            group,
            graph,
            spec,
            ranks,
            model,
            p,
            threads_per_rank(ranks, cores),
            epochs,
            flags=flags or ("--model", model, *size_flags(model), "--eval-every", "0"),
        )

    used = {(m, r) for m, graphs in preset.scaling.items() for ranks in graphs.values() for r in ranks}
    steps += [train("baseline", "tiny", TINY, r, m, 1.0, 2) for m, r in sorted(used)]
    for model, graphs in preset.scaling.items():
        for graph, ranks_list in graphs.items():
            for ranks in ranks_list:
                steps += [
                    train("scaling", graph, preset.graphs[graph], ranks, model, p, preset.epochs) for p in preset.ps
                ]
    for model, graph in preset.reference.items():
        spec = preset.graphs[graph]
        steps.append(train("reference", graph, spec, 1, model, 1.0, preset.epochs))
        variants = ("csr", "edge_index") if model == "graphsage" else ("edge_index",)
        steps += [
            Step(
                f"reference-{model}-{graph}-pyg-{v}",
                "pyg",
                "reference",
                graph,
                spec,
                1,
                model,
                threads=cores,
                epochs=preset.epochs,
                variant=v,
            )
            for v in variants
        ]
        steps.append(
            Step(
                f"reference-{model}-{graph}-bound",
                "bound",
                "reference",
                graph,
                spec,
                1,
                model,
                threads=cores,
                epochs=preset.epochs,
            )
        )
    if preset.accuracy_graph is None:
        return steps
    spec = preset.graphs[preset.accuracy_graph]
    flags = ("--model", "graphsage") + preset.accuracy_flags
    steps += [
        train(
            "accuracy",
            preset.accuracy_graph,
            spec,
            preset.accuracy_ranks,
            "graphsage",
            p,
            preset.accuracy_epochs,
            flags,
        )
        for p in preset.ps
    ]
    return steps


def parts_dir(work: Path, step: Step) -> Path:
    key = hashlib.sha256(step.spec.encode()).hexdigest()[:8]
    return work / "parts" / f"{step.graph}-{key}-{step.ranks}"


def partition_command(work: Path, step: Step) -> list[str]:
    return [
        "bnsgcn-partition",
        step.spec,
        "--parts",
        str(step.ranks),
        "--method",
        "random",
        "--out",
        str(parts_dir(work, step)),
    ]


def step_command(work: Path, step: Step) -> list[str]:
    parts = str(parts_dir(work, step))
    if step.kind == "train":
        return [
            "bnsgcn-train",
            "--parts-dir",
            parts,
            "--procs",
            str(step.ranks),
            "--threads",
            str(step.threads),
            "--p",
            f"{step.p:g}",
            "--epochs",
            str(step.epochs),
            *step.flags,
            "--out",
            str(work / "runs" / step.name),
        ]
    module = "benchmarks.pyg_reference" if step.kind == "pyg" else "benchmarks.compute_bound"
    variant = ("--variant", step.variant) if step.variant else ()
    return [
        "python",
        "-m",
        module,
        "--parts-dir",
        parts,
        "--model",
        step.model,
        *size_flags(step.model),
        *variant,
        "--threads",
        str(step.threads),
        "--epochs",
        str(step.epochs),
        "--json",
        str(work / "runs" / f"{step.name}.json"),
    ]


def executable(command: list[str]) -> list[str]:
    """A printed command as it is run: console scripts through ``python -m`` of this interpreter."""
    head, *rest = command
    if head in COMMANDS:
        return [sys.executable, "-m", COMMANDS[head], *rest]
    return [sys.executable if head == "python" else head, *rest]


def execute(command: list[str], threads: int, timeout_s: int) -> tuple[float, str | None]:
    """Run a command; (wall seconds, None) or (wall seconds, the tail of its output on failure)."""
    env = os.environ | {
        "OMP_NUM_THREADS": str(threads),
        "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
    }
    start = time.perf_counter()
    try:
        done = subprocess.run(executable(command), cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return time.perf_counter() - start, f"timed out after {timeout_s} s"
    wall = time.perf_counter() - start
    if done.returncode != 0:
        return wall, "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
    return wall, None


def read_train_run(run_dir: Path) -> dict:
    """The figures of one bnsgcn-train run, from its metrics.jsonl and report.json."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    epochs = [line for line in lines if "time" in line]
    summary = next((line for line in lines if line.get("summary")), {})
    timed = [e for e in epochs[1:] if e["time"]["evaluation"] == 0] or epochs[1:] or epochs
    median = lambda key: statistics.median(e["time"][key] for e in timed)  # noqa: E731
    kinds = ("features", "gradients", "selections")
    by_kind = {k: statistics.fmean(e["bytes_sent_by_kind"][k] for e in epochs) for k in kinds}
    rep = report.load(run_dir)
    ranks = rep["ranks"]
    return {
        "epoch_time_s": median("epoch"),
        "time_s": {k: median(k) for k in ("sampling", "exchange", "compute", "reduction", "idle")},
        "sampling_share": statistics.median(e["time"]["sampling"] / e["time"]["epoch"] for e in timed),
        "bytes_per_epoch": sum(by_kind.values()),
        "bytes_per_epoch_by_kind": by_kind,
        "sampled_boundary_per_epoch": statistics.fmean(e["sampled_boundary"] for e in epochs),
        "boundary_nodes": sum(r["boundary_nodes"] for r in ranks),
        "boundary_inner_ratio": rep["summary"]["boundary_inner_ratio"],
        "peak_rss_bytes": [r["peak_rss_bytes"] for r in ranks],
        "partition_bytes": [r["partition_bytes"] for r in ranks],
        "saved_activation_bytes": [r["saved_activation_bytes"] for r in ranks],
        "best_val_score": summary.get("best_val_score"),
        "test_score": summary.get("test_score"),
        "epochs_timed": len(timed),
        "val_curve": validation_curve(epochs),
    }


def machine() -> dict:
    import torch

    try:
        with open("/proc/meminfo") as handle:
            memory_gib = int(handle.readline().split()[1]) / 2**20
    except OSError:
        memory_gib = None
    return {
        "cores": os.cpu_count(),
        "memory_gib": memory_gib,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def _max(values: list[float]) -> float:
    return max(values) if values else float("nan")


def attach_baselines(results: list[dict]) -> None:
    """Peak memory above the tiny-graph run of the same command (same model and ranks, so same threads)."""
    base = {
        (r["model"], r["ranks"]): _max(r["peak_rss_bytes"])
        for r in results
        if r["group"] == "baseline" and "peak_rss_bytes" in r
    }
    for r in results:
        if (
            r["kind"] == "train"
            and r["group"] != "baseline"
            and "peak_rss_bytes" in r
            and (r["model"], r["ranks"]) in base
        ):
            r["memory_above_baseline_bytes"] = _max(r["peak_rss_bytes"]) - base[(r["model"], r["ranks"])]


def targets(results: list[dict], preset: Preset) -> dict:
    """The four targets, each as a ratio from this invocation's runs."""
    ok = [r for r in results if "error" not in r and r["kind"] == "train"]
    find = lambda **kw: next((r for r in ok if all(r.get(k) == v for k, v in kw.items())), None)  # noqa: E731
    out: dict[str, dict] = {}

    graph = preset.reference.get("graphsage")
    engine = find(group="reference", model="graphsage")
    pyg = [r for r in results if r["kind"] == "pyg" and r["model"] == "graphsage" and "error" not in r]
    if engine and pyg:
        best = min(pyg, key=lambda r: r["epoch_time_s"])
        ratio = engine["epoch_time_s"] / best["epoch_time_s"]
        out["one_rank_vs_pyg"] = {
            "graph": graph,
            "ratio": ratio,
            "met": ratio <= 1.0,
            "engine_s": engine["epoch_time_s"],
            "pyg_s": best["epoch_time_s"],
            "pyg_variant": best["variant"],
        }

    sage = preset.scaling.get("graphsage", {})
    if sage:
        largest = list(sage)[-1]
        fewest, most = min(sage[largest]), max(sage[largest])
        full = find(group="scaling", model="graphsage", graph=largest, ranks=fewest, p=1.0)
        rows = []
        for p in (p for p in preset.ps if 0 < p < 1):
            run = find(group="scaling", model="graphsage", graph=largest, ranks=fewest, p=p)
            if full and run:
                exchanged = run["bytes_per_epoch"] - run["bytes_per_epoch_by_kind"]["selections"]
                realised = run["sampled_boundary_per_epoch"] / full["sampled_boundary_per_epoch"]
                rows.append(
                    {
                        "p": p,
                        "ratio": run["bytes_per_epoch"] / (p * full["bytes_per_epoch"]),
                        "ratio_without_selections": exchanged / (p * full["bytes_per_epoch"]),
                        "ratio_to_realised_sampling": exchanged / (realised * full["bytes_per_epoch"]),
                    }
                )
        if rows:
            out["bytes_vs_p"] = {
                "graph": largest,
                "ranks": fewest,
                "per_p": rows,
                "met": all(abs(r["ratio"] - 1) <= 0.05 for r in rows),
            }

        one, full = (find(group="scaling", model="graphsage", graph=largest, ranks=most, p=p) for p in (0.01, 1.0))
        if one and full:

            def measures(r: dict) -> dict[str, float]:
                m = {"peak_rss": _max(r["peak_rss_bytes"])}
                if "memory_above_baseline_bytes" in r:
                    m["above_baseline"] = r["memory_above_baseline_bytes"]
                m["partition_plus_activations"] = _max(
                    [a + b for a, b in zip(r["partition_bytes"], r["saved_activation_bytes"])]
                )
                m["saved_activations"] = _max(r["saved_activation_bytes"])
                return m

            low, high = measures(one), measures(full)
            ratios = {k: low[k] / high[k] for k in low if k in high and high[k] > 0}
            out["memory_p001_vs_p1"] = {
                "graph": largest,
                "ranks": most,
                "boundary_inner_max": full["boundary_inner_ratio"]["max"],
                "boundary_inner_min": full["boundary_inner_ratio"]["min"],
                "graph_qualifies": full["boundary_inner_ratio"]["min"] >= 1.0,
                "p001_bytes": low,
                "p1_bytes": high,
                "ratios": ratios,
                "met_by": [k for k, v in ratios.items() if v <= 0.6],
            }

    scaling = [r for r in ok if r["group"] == "scaling"]
    if scaling:
        worst = max(scaling, key=lambda r: r["sampling_share"])
        out["sampling_share"] = {
            "max": worst["sampling_share"],
            "at": worst["name"],
            "met": worst["sampling_share"] < 0.10,
            "per_p_max": {f"{p:g}": _max([r["sampling_share"] for r in scaling if r["p"] == p]) for p in preset.ps},
        }
    return out


def same_configuration(run: dict) -> tuple:
    """Everything of a training run but p: the runs whose p = 1 run sets the accuracy target."""
    return (run["group"], run["spec"], run["ranks"], run["model"], run["epochs"], tuple(run["flags"]))


def write_json(path: Path, document: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(document, indent=1) + "\n")
    os.replace(tmp, path)


MiB = 2**20


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def render(document: dict) -> str:
    """The markdown tables of a suite result."""
    results = [r for r in document["runs"] if "error" not in r]
    scaling = [r for r in results if r["group"] == "scaling"]
    out = [
        f"Preset `{document['preset']}`, {document['date']}, {document['machine']['cores']} cores, "
        f"{document['machine']['memory_gib']:.0f} GiB, GPU: {document['machine']['gpu'] or 'none'}; "
        f"command: `{document['command']}`",
        "",
    ]
    head = [
        "model",
        "graph",
        "ranks",
        "p",
        "epoch (s)",
        "sampling (s)",
        "exchange (s)",
        "compute (s)",
        "idle (s)",
        "MiB sent/epoch",
        "peak RSS/rank (MiB)",
        "above baseline (MiB)",
        "saved act. (MiB)",
        "bnd/inner",
    ]
    rows = [
        [
            r["model"],
            r["graph"],
            str(r["ranks"]),
            f"{r['p']:g}",
            f"{r['epoch_time_s']:.3f}",
            f"{r['time_s']['sampling']:.3f}",
            f"{r['time_s']['exchange']:.3f}",
            f"{r['time_s']['compute']:.3f}",
            f"{r['time_s']['idle']:.3f}",
            f"{r['bytes_per_epoch'] / MiB:.2f}",
            f"{_max(r['peak_rss_bytes']) / MiB:.0f}",
            f"{r.get('memory_above_baseline_bytes', float('nan')) / MiB:.0f}",
            f"{_max(r['saved_activation_bytes']) / MiB:.1f}",
            f"{r['boundary_inner_ratio']['max']:.2f}",
        ]
        for r in scaling
    ]
    out += ["Scaling (slowest rank's median epoch; bytes sent by all ranks):", "", _table(head, rows), ""]

    reference = [r for r in results if r["group"] == "reference"]
    rows = []
    for r in reference:
        what = {
            "train": f"bnsgcn, 1 rank, p = 1, {r['threads']} threads",
            "pyg": f"PyTorch Geometric ({r.get('variant')}), {r['threads']} threads",
            "bound": f"compute-only bound, {r['threads']} threads",
        }[r["kind"]]
        peak = _max(r["peak_rss_bytes"]) if r["kind"] == "train" else r.get("peak_rss_bytes")
        rows.append([r["model"], r["graph"], what, f"{r['epoch_time_s']:.3f}", f"{peak / MiB:.0f}" if peak else "-"])
    out += [
        "One process, same threads:",
        "",
        _table(["model", "graph", "run", "epoch (s)", "peak RSS (MiB)"], rows),
        "",
    ]

    accuracy = [r for r in results if r["group"] == "accuracy"]
    if accuracy:
        rows = [
            [
                f"{r['p']:g}",
                f"{r['best_val_score']:.4f}",
                f"{r['test_score']:.4f}",
                f"{r['epoch_time_s']:.3f}",
                time_to_accuracy_cell(r),
            ]
            for r in accuracy
        ]
        head = ["p", "best val", "test at best val", "epoch (s)", "to 99% of p = 1's best val: epochs / s"]
        out += ["Accuracy against p:", "", _table(head, rows), ""]

    rows = []
    t = document["targets"]
    if "one_rank_vs_pyg" in t:
        x = t["one_rank_vs_pyg"]
        rows.append(
            [
                TARGETS["one_rank_vs_pyg"],
                f"{x['ratio']:.2f} ({x['engine_s']:.3f} s vs {x['pyg_s']:.3f} s, PyG {x['pyg_variant']})",
                _met(x["met"]),
            ]
        )
    if "bytes_vs_p" in t:
        x = t["bytes_vs_p"]
        detail = "; ".join(
            f"p={r['p']:g}: {r['ratio']:.3f} (without selections {r['ratio_without_selections']:.3f})"
            for r in x["per_p"]
        )
        rows.append([TARGETS["bytes_vs_p"], detail, _met(x["met"])])
    if "memory_p001_vs_p1" in t:
        x = t["memory_p001_vs_p1"]
        detail = (
            "; ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in x["ratios"].items())
            + f" (boundary/inner {x['boundary_inner_min']:.2f}-{x['boundary_inner_max']:.2f})"
        )
        rows.append(
            [TARGETS["memory_p001_vs_p1"], detail, "met by " + ", ".join(x["met_by"]) if x["met_by"] else "missed"]
        )
    if "sampling_share" in t:
        x = t["sampling_share"]
        detail = f"max {x['max']:.3f} at {x['at']}; per p: " + ", ".join(
            f"{p}: {v:.3f}" for p, v in x["per_p_max"].items()
        )
        rows.append([TARGETS["sampling_share"], detail, _met(x["met"])])
    out += ["Targets:", "", _table(["target", "measured", ""], rows)]
    failed = [r["name"] for r in document["runs"] if "error" in r]
    if failed:
        out += ["", "Failed runs: " + ", ".join(failed)]
    return "\n".join(out)


def time_to_accuracy_cell(run: dict) -> str:
    """``epochs / seconds`` to the target, ``not reached``, or ``-`` (no target: see benchmarks.accuracy)."""
    reached = run.get("time_to_accuracy")
    if reached is None:
        return "-"
    if reached["epochs"] is None:
        return f"not reached ({reached['target']:.4f})"
    return f"{reached['epochs']} / {reached['seconds']:.2f}"


def _met(met: bool) -> str:
    return "met" if met else "missed"


def figures(document: dict, stem: Path) -> list[Path]:
    """``<stem>-scaling.png`` (epoch time, bytes, memory against p) and ``<stem>-accuracy.png``."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print(f"note: {report.PLOTS_HINT}", file=sys.stderr)
        return []
    results = [r for r in document["runs"] if "error" not in r]
    paths = []
    scaling = [r for r in results if r["group"] == "scaling"]
    if scaling:
        series: dict[str, list[dict]] = {}
        for r in scaling:
            series.setdefault(f"{r['model']} {r['graph']} x{r['ranks']}", []).append(r)
        fig = Figure(figsize=(14, 4.5), layout="constrained")
        axes = fig.subplots(1, 3)
        panels = (
            ("epoch time (s)", lambda r: r["epoch_time_s"]),
            ("MiB sent per epoch (symlog)", lambda r: r["bytes_per_epoch"] / MiB),
            (
                "peak RSS per rank above baseline (MiB)",
                lambda r: r.get("memory_above_baseline_bytes", float("nan")) / MiB,
            ),
        )
        ps = sorted({r["p"] for r in scaling}, reverse=True)
        for ax, (label, value) in zip(axes, panels):
            for name, runs in series.items():
                by_p = {r["p"]: value(r) for r in runs}
                ax.plot(range(len(ps)), [by_p.get(p, float("nan")) for p in ps], marker="o", label=name)
            ax.set_xticks(range(len(ps)), [f"{p:g}" for p in ps])
            ax.set_xlabel("p")
            ax.set_title(label)
        axes[1].set_yscale("symlog", linthresh=0.1)
        axes[1].set_ylim(bottom=0)
        axes[0].legend(fontsize="small")
        paths.append(stem.with_name(stem.name + "-scaling.png"))
        fig.savefig(paths[-1], dpi=100)
    accuracy = [r for r in results if r["group"] == "accuracy"]
    if accuracy:
        fig = Figure(figsize=(5, 3.5), layout="constrained")
        ax = fig.subplots()
        ax.bar([f"{r['p']:g}" for r in accuracy], [r["test_score"] for r in accuracy])
        ax.set_xlabel("p")
        ax.set_ylabel("test accuracy at best validation")
        low = min(r["test_score"] for r in accuracy)
        ax.set_ylim(max(0.0, low - 0.1), 1.0)
        paths.append(stem.with_name(stem.name + "-accuracy.png"))
        fig.savefig(paths[-1], dpi=100)
    return paths


def run_suite(preset: Preset, work: Path, out: Path, command: str, only: set[str]) -> dict:
    cores = os.cpu_count() or 1
    steps = [s for s in plan(preset, cores) if not only or s.group in only]
    document = {
        "preset": preset.name,
        "date": date.today().isoformat(),
        "command": command,
        "machine": machine(),
        "runs": [],
        "targets": {},
    }
    try:
        import torch_geometric

        document["machine"]["torch_geometric"] = torch_geometric.__version__
    except ImportError:
        print(
            "note: the PyTorch Geometric reference needs pip install bnsgcn[bench]; its runs will fail", file=sys.stderr
        )
    partitioned: dict[Path, str | None] = {}
    for i, step in enumerate(steps, 1):
        print(f"[{i}/{len(steps)}] {step.name}", file=sys.stderr, flush=True)
        entry = asdict(step)
        parts = parts_dir(work, step)
        if parts not in partitioned:
            partitioned[parts] = execute(partition_command(work, step), cores, preset.timeout_s)[1]
        error = partitioned[parts]
        if error is None:
            run = work / "runs" / step.name
            shutil.rmtree(run, ignore_errors=True)
            wall, error = execute(step_command(work, step), step.threads, preset.timeout_s)
            entry["wall_s"] = wall
            if error is None:
                entry |= (
                    read_train_run(run) if step.kind == "train" else json.loads(run.with_suffix(".json").read_text())
                )
        if error is not None:
            entry["error"] = error
            print(f"  failed: {error}", file=sys.stderr)
        document["runs"].append(entry)
        attach_baselines(document["runs"])
        attach_time_to_accuracy(document["runs"], same_configuration)
        document["targets"] = targets(document["runs"], preset)
        write_json(out, document)
    return document


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.suite", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    parser.add_argument("--out", type=Path, help="result JSON (default benchmarks/results/suite-<preset>.json)")
    parser.add_argument(
        "--work", type=Path, help="partition sets and run directories (default: <tmp>/bnsgcn-suite-<preset>, reused)"
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=("baseline", "scaling", "reference", "accuracy"),
        help="run only this group (repeatable)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the commands and run nothing")
    parser.add_argument(
        "--render", type=Path, metavar="RESULT", help="print the tables of a saved result, redraw its figures, and exit"
    )
    args = parser.parse_args(argv)
    if args.render:
        document = json.loads(args.render.read_text())
        print(render(document))
        for path in figures(document, args.render.with_suffix("")):
            print(f"wrote {path}", file=sys.stderr)
        return 0
    preset = PRESETS[args.preset]
    work = args.work or Path(tempfile.gettempdir()) / f"bnsgcn-suite-{preset.name}"
    out = args.out or REPO / "benchmarks" / "results" / f"suite-{preset.name}.json"
    cores = os.cpu_count() or 1
    if args.dry_run:
        seen = set()
        for step in plan(preset, cores):
            if args.only and step.group not in args.only:
                continue
            if parts_dir(work, step) not in seen:
                seen.add(parts_dir(work, step))
                print(shlex.join(partition_command(work, step)))
            print(shlex.join(step_command(work, step)))
        return 0
    command = "python -m benchmarks.suite " + shlex.join(argv if argv is not None else sys.argv[1:])
    try:
        document = run_suite(preset, work, out, command, set(args.only or ()))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(render(document))
    for path in figures(document, out.with_suffix("")):
        print(f"wrote {path}", file=sys.stderr)
    return 1 if any("error" in r for r in document["runs"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
