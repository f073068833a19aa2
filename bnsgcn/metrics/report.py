"""The memory-balance report: per-rank figures, their spread, figures, and runs side by side.

``report.json`` holds, per rank, the static figures of :func:`bnsgcn.metrics.accounting.static_figures`,
the per-epoch means of :data:`bnsgcn.metrics.accounting.COLUMNS` and what follows from them (bytes
sent and received, the time split); ``summary`` gives, for each figure of :data:`BALANCE`,
max / mean / min, the imbalance ratio (max / mean) and the straggler (the rank holding the
max). Where matplotlib is installed, :func:`write_figures` draws per-rank memory bars,
boundary/inner ratios and the time split as PNGs next to ``report.json``.

``bnsgcn-report RUN_DIR [RUN_DIR ...] [--figures] [--target-accuracy T]`` re-renders saved runs
and compares them with the first, in percent, with what each reached (:func:`load_outcome`:
best validation and test scores, training wall time, time to a validation score).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from bnsgcn.cli import Parser
from bnsgcn.errors import UserError
from bnsgcn.files import atomic, write_bytes
from bnsgcn.metrics.memory import HOLDERS

if TYPE_CHECKING:
    import torch

REPORT_NAME = "report.json"
METRICS_NAME = "metrics.jsonl"
FIGURES = ("memory.png", "boundary.png", "time.png")  # what write_figures draws
PLOTS_HINT = "figures need matplotlib: pip install bnsgcn[plots]"
MiB = 2**20
# figure -> (label, unit) in the table, in this order; a figure no rank reports is left out
BALANCE = {
    "peak_memory_bytes": ("peak memory", "MiB"),
    "peak_rss_bytes": ("peak host RSS", "MiB"),
    "peak_cuda_allocated_bytes": ("peak device allocated", "MiB"),
    "peak_cuda_reserved_bytes": ("peak device reserved", "MiB"),
    "memory_above_baseline_bytes": ("peak above process baseline", "MiB"),
    # the largest holders of a rank's memory, then what backward keeps
    **{key: (label, "MiB") for key, label in HOLDERS.items()},
    "saved_activation_bytes": ("saved activations", "MiB"),
    "inner_nodes": ("inner nodes", ""),
    "boundary_nodes": ("boundary nodes", ""),
    "boundary_inner_ratio": ("boundary/inner", ""),
    "sampled_boundary": ("sampled boundary/epoch", ""),
    "bytes_sent": ("sent/epoch", "MiB"),
    "bytes_received": ("received/epoch", "MiB"),
    "bytes_intra_node": ("sent in node/epoch", "MiB"),
    "bytes_inter_node": ("sent across nodes/epoch", "MiB"),
    "epoch_time": ("epoch time", "s"),
    "time_sampling": ("sampling time", "s"),
    "time_exchange": ("exchange time", "s"),
    "time_idle": ("idle time", "s"),
    # when some ranks are slower: --inject-delay's sleep, waits on other ranks while
    # averaging parameters (--sync), and the optimizer steps each rank took in the run
    "time_injected_delay": ("injected delay", "s"),
    "time_sync": ("waits in parameter sync", "s"),
    "steps": ("steps done", ""),
    # --max-lag: epochs behind of the oldest rows or gradients a rank used (per-epoch
    # median; 1 is --staleness 1), and its waits because they would have been older
    "lag": ("lag used (epochs)", ""),
    "time_lag_wait": ("waits for lagging ranks", "s"),
}
# Where an epoch's time goes, in stacking order. Feature and gradient exchange times are
# measured inside the forward and backward passes, so compute = pass - exchange; "other"
# is what epoch_time holds beyond the measured parts (loss, optimizer step); idle is
# waited after the epoch.
TIME_SPLIT = (
    "sampling",
    "exchange_selections",
    "compute_forward",
    "exchange_forward",
    "compute_backward",
    "exchange_backward",
    "reduction",
    "injected_delay",
    "sync",
    "evaluation",
    "other",
    "idle",
)
# parts of the epoch measured one after the other (reports written before selections were
# timed apart lack that column: it counts as 0 there)
_SEQUENTIAL = (
    "sampling",
    "exchange_selections",
    "forward",
    "backward",
    "reduction",
    "evaluation",
    "injected_delay",
    "sync",
)
# Device memory: measured on CUDA only; elsewhere None ("-" in the table), never 0.
DEVICE_MEMORY = ("peak_cuda_allocated_bytes", "peak_cuda_reserved_bytes")
# The first epochs of a run compile kernels (numba, CUDA) and warm allocators: the report's
# per-epoch figures are medians over the epochs after them.
WARMUP_EPOCHS = 2


def steady_state(
    tables: list[torch.Tensor], columns: tuple[str, ...], warmup: int = WARMUP_EPOCHS
) -> tuple[list[dict[str, float]], dict]:
    """Per rank, each figure's median over the steady epochs of ``tables`` (one float64
    [world, len(columns)] per epoch run): the first ``min(warmup, epochs - 1)`` epochs are
    left out (a run of one epoch keeps it). Returns one dict per rank, ``columns`` plus
    ``time_other`` (what each epoch's time holds beyond its measured parts, per epoch, then
    the median: an epoch that also evaluates, or a slow epoch, then moves it no more than
    any other figure), and what the medians cover."""
    import torch  # here: bnsgcn-report only reads report.json, and torch takes seconds to import

    left_out = max(min(warmup, len(tables) - 1), 0)
    steady = torch.stack(tables[left_out:])  # [epochs, world, columns]
    index = {name: i for i, name in enumerate(columns)}
    parts = steady[..., [index[f"time_{t}"] for t in _SEQUENTIAL]].sum(-1)
    other = (steady[..., index["epoch_time"]] - parts).clamp(min=0.0)
    medians = torch.cat([steady, other.unsqueeze(-1)], dim=-1).quantile(0.5, dim=0)
    per_rank = [dict(zip((*columns, "time_other"), row)) for row in medians.tolist()]
    return per_rank, {
        "epochs_run": len(tables),
        "warmup_epochs_left_out": left_out,
        "median_over_epochs": len(tables) - left_out,
    }


def time_split(means: dict[str, float]) -> dict[str, float]:
    """Seconds per epoch of each part of :data:`TIME_SPLIT` from a rank's per-epoch means."""
    measured = sum(means.get(f"time_{t}", 0.0) for t in _SEQUENTIAL)
    return {
        "sampling": means["time_sampling"],
        "exchange_selections": means.get("time_exchange_selections", 0.0),
        "compute_forward": max(means["time_forward"] - means["time_exchange_forward"], 0.0),
        "exchange_forward": means["time_exchange_forward"],
        "compute_backward": max(means["time_backward"] - means["time_exchange_backward"], 0.0),
        "exchange_backward": means["time_exchange_backward"],
        "reduction": means["time_reduction"],
        "injected_delay": means.get("time_injected_delay", 0.0),
        "sync": means.get("time_sync", 0.0),
        "evaluation": means["time_evaluation"],
        # reports written before the per-epoch figure: the median epoch less the parts' medians
        "other": means["time_other"] if "time_other" in means else max(means["epoch_time"] - measured, 0.0),
        "idle": means["time_idle"],
    }


def peak_memory_of(figures: dict) -> int:
    """A rank's "peak memory" from its :func:`bnsgcn.metrics.accounting.peak_memory` figures:
    the device's allocated peak on CUDA, the resident set's on CPU."""
    cuda = figures.get("peak_cuda_allocated_bytes")
    return cuda if cuda is not None else figures["peak_rss_bytes"]


def build(static: list[dict], per_epoch: list[dict[str, float]], info: dict) -> dict:
    """The report of a job.

    ``static``: one dict per rank (:func:`bnsgcn.metrics.accounting.static_figures`; a
    ``baseline_rss_bytes``, the resident memory before the shard is loaded, adds the peak
    above it); ``per_epoch``: one dict per rank, its per-epoch figures
    (:func:`steady_state`'s medians).
    """
    ranks = []
    for figures, means in zip(static, per_epoch):
        rank = {key: None for key in DEVICE_MEMORY} | dict(figures)
        rank["peak_memory_bytes"] = peak_memory_of(rank)
        if "baseline_rss_bytes" in figures:
            rank["memory_above_baseline_bytes"] = figures["peak_rss_bytes"] - figures["baseline_rss_bytes"]
        rank["boundary_inner_ratio"] = figures["boundary_nodes"] / max(figures["inner_nodes"], 1)
        rank["per_epoch"] = means
        rank["time_split"] = time_split(means)
        rank["sampled_boundary"] = means["sampled_boundary"]
        rank["bytes_sent"] = sum(v for k, v in means.items() if k.startswith("sent_"))
        rank["bytes_received"] = sum(v for k, v in means.items() if k.startswith("received_"))
        rank["bytes_intra_node"] = sum(v for k, v in means.items() if k.startswith("intra_node_"))
        rank["bytes_inter_node"] = sum(v for k, v in means.items() if k.startswith("inter_node_"))
        rank["epoch_time"] = means["epoch_time"]
        rank["time_sampling"] = means["time_sampling"]
        rank["time_exchange"] = sum(means.get(f"time_exchange_{d}", 0.0) for d in ("selections", "forward", "backward"))
        rank["time_idle"] = means["time_idle"]
        if "time_sync" in means:  # reports of older releases lack these
            rank["time_injected_delay"], rank["time_sync"] = means["time_injected_delay"], means["time_sync"]
        if "steps_total" in figures or "steps" in means:  # the run's total; else the per-epoch median
            rank["steps"] = figures.get("steps_total", means.get("steps"))
        if "lag" in means and (info.get("config") or {}).get("max_lag"):  # --max-lag runs only
            rank["lag"], rank["time_lag_wait"] = means["lag"], means["time_lag_wait"]
        rank["saved_activation_bytes"] = means["saved_activation_bytes"]
        ranks.append(rank)
    summary = {}
    for key in BALANCE:
        if all(key in r for r in ranks):  # reports of older releases may lack a figure
            measured = [r[key] for r in ranks if r[key] is not None]
            summary[key] = spread(measured) if measured else None  # None: not measured (CPU)
    return {"info": info, "ranks": ranks, "summary": summary}


def spread(values: list[float]) -> dict:
    """max / mean / min, imbalance (max / mean) and the straggler's rank."""
    mean = sum(values) / len(values)
    top = max(range(len(values)), key=values.__getitem__)
    return {
        "max": values[top],
        "mean": mean,
        "min": min(values),
        "imbalance": values[top] / mean if mean else 1.0,
        "straggler": top,
    }


def write(run_dir: Path, report: dict, figures: bool = True) -> Path:
    """Write ``report.json`` atomically, print the table and (``figures``) draw the PNGs."""
    path = Path(run_dir) / REPORT_NAME
    write_bytes(path, (json.dumps(report, indent=1) + "\n").encode())  # ASCII: json.dumps escapes the rest
    print(render_table(report), file=sys.stderr)
    if figures:
        write_figures(report, Path(run_dir))
    return path


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "MiB":
        return f"{value / MiB:.1f}"
    if unit == "s":
        return f"{value:.3f}"
    return f"{value:.2f}" if isinstance(value, float) and not float(value).is_integer() else f"{int(value)}"


def _label(key: str) -> str:
    label, unit = BALANCE[key]
    return label + (f" ({unit})" if unit else "")


def _layout(rows: list[list[str]]) -> str:
    """Align a table (first row the header): first column left, the others right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))) for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render_table(report: dict) -> str:
    """Per rank, then max / mean / min / imbalance / straggler, one row per figure, under a
    row of the device each rank trained on (``cuda:0`` on each rank that shared GPU 0)."""
    ranks = report["ranks"]
    rows = [["figure"] + [f"rank {r['rank']}" for r in ranks] + ["max", "mean", "min", "max/mean", "straggler"]]
    rows.append(["device"] + [r.get("device", "-") for r in ranks] + [""] * 5)
    for key in (k for k in BALANCE if k in report["summary"]):
        s, unit = report["summary"][key], BALANCE[key][1]
        if s is None:  # not measured on this device
            rows.append([_label(key)] + ["-"] * (len(ranks) + 5))
            continue
        rows.append(
            [_label(key)]
            + [_fmt(r[key], unit) for r in ranks]
            + [
                _fmt(s["max"], unit),
                _fmt(s["mean"], unit),
                _fmt(s["min"], unit),
                f"{s['imbalance']:.2f}",
                f"rank {s['straggler']}",
            ]
        )
    return _layout(rows) + _steady_note(report["info"])


def _steady_note(info: dict) -> str:
    """The line under the table saying which epochs the per-epoch figures are medians of."""
    steady = info.get("steady_state")
    if not steady:
        return ""
    left_out, epochs = steady["warmup_epochs_left_out"], steady["epochs_run"]
    return (
        f"\nper-epoch figures: medians over {steady['median_over_epochs']} of {epochs} epochs run, "
        f"the first {left_out} left out as warm-up (kernel compilation, allocator)"
    )


def compare(
    reports: list[tuple[str, dict]], outcomes: list[dict | None] | None = None, target: float | None = None
) -> str:
    """Each run's setting and what it reached (``outcomes``, :func:`load_outcome`, one per run,
    None where unknown), then, per figure, its max over ranks, each with the change against the
    first run. ``target``: add the time to that validation score.

    A negative change is a saving: ``(-42%)`` means 42% less than the first run.
    """
    rows = [["figure (max over ranks)"] + [name for name, _ in reports]]
    settings = [
        (label, lambda info, k=k: info.get("config", {}).get(k, "?"))
        for label, k in (("model", "model"), ("p", "p"), ("precision", "precision"))
    ]
    settings.append(("ranks", lambda info: info.get("world_size", "?")))
    for label, get in settings:
        rows.append([label] + [str(get(rep["info"])) for _, rep in reports])
    if outcomes is not None:
        rows += outcome_rows(outcomes, target)
    base = reports[0][1]["summary"]
    for key in BALANCE:
        if not all(rep["summary"].get(key) is not None for _, rep in reports):
            continue
        unit, first = BALANCE[key][1], base[key]["max"]
        cells = [_label(key)]
        for i, (_, rep) in enumerate(reports):
            value = rep["summary"][key]["max"]
            cells.append(_fmt(value, unit) + (_change(value, first) if i else ""))
        rows.append(cells)
    return _layout(rows) + (_target_note(target) if outcomes is not None and target is not None else "")


def _change(value: float, first: float) -> str:
    return f" ({round((value - first) / first * 100):+d}%)" if first else ""


def outcome_rows(outcomes: list[dict | None], target: float | None) -> list[list[str]]:
    """The comparison's rows of what each run reached: its best validation score and epoch, the
    test score of that epoch, the time to ``target`` (when given) and the training wall time
    (times with their change against the first run); ``-`` where a run has no record."""

    def score(o: dict | None, key: str) -> str:
        if o is None or o[key] is None:
            return "-"
        return f"{o[key]:.4f}" + (f" at epoch {o['best_epoch']}" if key == "best_val_score" else "")

    def seconds(value: float | None, first: float | None, i: int) -> str:
        if value is None:
            return "-"
        return f"{value:.3f}" + (_change(value, first) if i and first is not None else "")

    rows = [
        ["best val score"] + [score(o, "best_val_score") for o in outcomes],
        ["test score at best val"] + [score(o, "test_score") for o in outcomes],
    ]
    if target is not None:
        reached = [None if o is None else time_to(o, target) for o in outcomes]
        first = reached[0][1] if reached[0] else None
        cells = []
        for i, (o, r) in enumerate(zip(outcomes, reached)):
            if r is not None:
                cells.append(f"{r[1]:.3f} at epoch {r[0]}" + (_change(r[1], first) if i and first is not None else ""))
            else:
                cells.append("-" if o is None else "not reached")
        rows.append([f"time to val >= {target:g} (s)"] + cells)
    walls = [None if o is None else o["wall_s"] for o in outcomes]
    rows.append(["training wall time (s)"] + [seconds(w, walls[0], i) for i, w in enumerate(walls)])
    return rows


def _target_note(target: float) -> str:
    return (
        f"\ntime to val >= {target:g}: wall seconds from the first epoch's start to the end of the first epoch "
        "evaluated at or above it; not reached: no evaluated epoch got there"
    )


def time_to(outcome: dict, target: float) -> tuple[int, float] | None:
    """(epoch, wall seconds) of the first evaluated epoch whose validation score reached
    ``target``; None when none did."""
    return next(((e, t) for e, score, t in outcome["evaluated"] if score >= target), None)


def load_outcome(run_dir: Path) -> dict | None:
    """What a run reached, from its ``metrics.jsonl`` (None without one): ``best_val_score``,
    ``best_epoch`` and ``test_score`` (of the summary line, else of the best evaluated epoch),
    ``wall_s`` (training wall time: from the first epoch's start to the last epoch's end,
    evaluations included; a resumed run's parts added up) and ``evaluated``: (epoch,
    validation score, wall seconds so far) per evaluated epoch."""
    path = Path(run_dir) / METRICS_NAME
    if not path.is_file():
        return None
    evaluated: list[tuple[int, float, float]] = []
    tests: dict[int, float | None] = {}
    summary = None
    wall: float | None = None
    offset = previous = 0.0
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if record.get("summary"):
                summary = record
                continue
            times = record.get("time", {})
            if "elapsed" in times:
                elapsed = float(times["elapsed"])
                if elapsed < previous:  # a resumed run: its clock starts again
                    offset += previous
                previous, wall = elapsed, offset + elapsed
            else:  # records of older releases: the epochs' times add up
                wall = (wall or 0.0) + float(times.get("epoch", 0.0))
            if record.get("val_score") is not None:
                evaluated.append((int(record["epoch"]), float(record["val_score"]), wall))
                tests[int(record["epoch"])] = record.get("test_score")
        except (ValueError, TypeError, AttributeError, KeyError) as exc:
            raise UserError(f"{path}:{number} is not a bnsgcn metrics record ({exc}); re-run the training") from None
    best_val = best_epoch = test = None
    if summary is not None and summary.get("best_epoch", -1) >= 1:
        best_val, best_epoch, test = summary["best_val_score"], summary["best_epoch"], summary.get("test_score")
    elif evaluated:
        best_epoch, best_val, _ = max(evaluated, key=lambda e: e[1])  # the first of equals, as training keeps it
        test = tests[best_epoch]
    return {
        "best_val_score": best_val,
        "best_epoch": best_epoch,
        "test_score": test,
        "wall_s": wall,
        "evaluated": evaluated,
    }


@functools.cache
def _hint_plots() -> None:
    """Say once per process that figures need matplotlib."""
    print(f"note: {PLOTS_HINT}", file=sys.stderr)


def write_figures(report: dict, out_dir: Path) -> list[Path]:
    """Draw ``memory.png``, ``boundary.png`` and ``time.png`` into ``out_dir``; return their paths.

    Without matplotlib nothing is drawn (and a note says how to install it).
    """
    try:
        from matplotlib.figure import Figure  # optional extra: bnsgcn[plots]
    except ImportError:
        _hint_plots()
        return []
    ranks = report["ranks"]
    names = [f"rank {r['rank']}" for r in ranks]
    positions = list(range(len(ranks)))

    def grouped_bars(ax, series: dict[str, list[float]], ylabel: str) -> None:
        width = 0.8 / len(series)
        for i, (label, values) in enumerate(series.items()):
            ax.bar([x + (i - (len(series) - 1) / 2) * width for x in positions], values, width, label=label)
        ax.set_xticks(positions, names)
        ax.set_ylabel(ylabel)
        ax.margins(y=0.3)  # room for the legend above the bars
        ax.legend(fontsize="small", loc="upper right")

    def memory(fig) -> None:
        keys = [
            k
            for k in (
                "peak_rss_bytes",
                *DEVICE_MEMORY,
                "memory_above_baseline_bytes",
                "partition_bytes",
                "saved_activation_bytes",
            )
            if report["summary"].get(k) is not None
        ]
        ax = fig.subplots()
        grouped_bars(ax, {BALANCE[k][0]: [r[k] / MiB for r in ranks] for k in keys}, "MiB")
        peak = report["summary"]["peak_memory_bytes"]
        ax.set_title(f"memory per rank (peak imbalance {peak['imbalance']:.2f}, straggler rank {peak['straggler']})")

    def boundary(fig) -> None:
        counts, ratios = fig.subplots(1, 2)
        grouped_bars(
            counts,
            {BALANCE[k][0]: [r[k] for r in ranks] for k in ("inner_nodes", "boundary_nodes", "sampled_boundary")},
            "nodes",
        )
        counts.set_title("nodes per rank")
        grouped_bars(
            ratios,
            {
                "boundary/inner": [r["boundary_inner_ratio"] for r in ranks],
                "sampled/inner": [r["sampled_boundary"] / max(r["inner_nodes"], 1) for r in ranks],
            },
            "ratio",
        )
        ratios.set_title("boundary/inner per rank")

    def time(fig) -> None:
        ax = fig.subplots()
        bottom = [0.0] * len(ranks)
        for part in TIME_SPLIT:
            values = [time_split(r["per_epoch"])[part] for r in ranks]
            ax.bar(positions, values, 0.6, bottom=bottom, label=part.replace("_", " "))
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_xticks(positions, names)
        ax.set_ylabel("seconds per epoch")
        ax.set_title("time split per rank")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))

    drawings: list[tuple[Callable, tuple[float, float]]] = [(memory, (7, 4)), (boundary, (11, 4)), (time, (8, 4.5))]
    paths = []
    for name, (draw, size) in zip(FIGURES, drawings, strict=True):
        fig = Figure(figsize=size, layout="constrained")
        draw(fig)
        path = Path(out_dir) / name
        with atomic(path) as sink:
            fig.savefig(sink, format="png", dpi=100)
        paths.append(path)
    return paths


def load(run_dir: Path) -> dict:
    """The report of a saved run, or :class:`UserError` naming what is wrong with ``run_dir``."""
    path = Path(run_dir) / REPORT_NAME
    if not path.is_file():
        raise UserError(
            f"{path} not found: {run_dir} is not a finished bnsgcn run; pass a run directory written by bnsgcn-train"
        )
    try:
        report = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is not valid JSON ({exc}); re-run the training") from None
    if not isinstance(report, dict) or not {"info", "ranks", "summary"} <= report.keys():
        raise UserError(
            f"{path} is not a bnsgcn report (no info/ranks/summary); pass a run directory written by bnsgcn-train"
        )
    return report


DESCRIPTION = (
    "Show where memory, time and bytes go on every rank of a run written by bnsgcn-train. With several runs, "
    "compare them with the first: model, p and ranks, best validation score and the test score of that epoch, "
    "training wall time, time to --target-accuracy, and each figure's maximum over ranks with its change in percent."
)


def target_accuracy(text: str) -> float:
    """``--target-accuracy``: a validation score, in (0, 1] as metrics.jsonl records it."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(
            f"{text} is not a validation score in (0, 1]; pass a fraction, e.g. --target-accuracy 0.95 for 95%"
        )
    return value


def build_parser() -> Parser:
    parser = Parser(
        prog="bnsgcn-report",
        description=DESCRIPTION,
        epilog="Every flag may also be written with underscores (--target_accuracy). See docs/cli.md.",
    )
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories written by bnsgcn-train")
    parser.add_argument(
        "--figures",
        action="store_true",
        help="also draw memory.png, boundary.png and time.png into each run directory (needs matplotlib)",
    )
    parser.add_argument(
        "--target-accuracy",
        type=target_accuracy,
        metavar="T",
        help="also show the wall time until the validation score first reached T (a fraction, e.g. 0.95), from each "
        "run's metrics.jsonl; 'not reached' when no evaluation got there",
    )
    return parser


def _precision_line(info: dict) -> str:
    """The run's ``--precision`` and the wire formats it resolved to (one run shown; reports of older
    releases lack them)."""
    config = info.get("config") or {}
    if "precision" not in config:
        return ""
    return (
        f"\nprecision {config['precision']}, wire formats: rows {config['compress']}, "
        f"gradients {config['compress_grad']}"
    )


def _summary_lines(outcome: dict, target: float | None) -> str:
    """A run's outcome under its table (one run shown)."""
    lines = []
    if outcome["best_val_score"] is not None:
        test = "-" if outcome["test_score"] is None else f"{outcome['test_score']:.4f}"
        lines.append(f"best val score {outcome['best_val_score']:.4f} at epoch {outcome['best_epoch']}, test {test}")
    if outcome["wall_s"] is not None:
        lines.append(f"training wall time {outcome['wall_s']:.3f} s")
    if target is not None:
        reached = time_to(outcome, target)
        lines.append(
            f"time to val >= {target:g}: "
            + (
                "not reached (no evaluated epoch got there)"
                if reached is None
                else f"{reached[1]:.3f} s (epoch {reached[0]})"
            )
        )
    return "".join("\n" + line for line in lines)


def main(argv: list[str] | None = None) -> int:
    """``bnsgcn-report RUN_DIR [RUN_DIR ...]``: re-render one run, or compare several with the first."""
    args = build_parser().parse_args(argv)
    try:
        reports = [(str(r), load(r)) for r in args.runs]
        outcomes = [load_outcome(r) for r in args.runs]
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if len(reports) == 1:
        print(
            render_table(reports[0][1])
            + _precision_line(reports[0][1]["info"])
            + ("" if outcomes[0] is None else _summary_lines(outcomes[0], args.target_accuracy))
        )
    else:
        print(compare(reports, outcomes, args.target_accuracy))
    if args.figures:
        for run, (_, report) in zip(args.runs, reports):
            try:
                paths = write_figures(report, run)
            except UserError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            for path in paths:
                print(f"wrote {path}")
    return 0
