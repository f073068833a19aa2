"""Accuracy of compressed and stale boundary messages: test accuracy at the best validation
epoch, mean of several seeds, for every wire format, p and staleness, against uncompressed
messages and against the exact (staleness 0) exchange.

    python -m benchmarks.compression --data-dir ~/data/planetoid --out benchmarks/results/compression.json
    python -m benchmarks.compression --graphs acc --formats none fp16 int8 --staleness 0 1 --seeds 0 1 2
    python -m benchmarks.compression --render benchmarks/results/compression.json

Graphs: ``cora`` (public split, METIS into 4 parts, GraphSAGE 2 x 16 as in
tests/test_cora.py: no norm, dropout 0.5, weight decay 5e-4, 200 epochs, evaluated every 2)
and ``acc`` (the suite's accuracy graph, where the label lives in the neighbourhood: 8
random parts, GraphSAGE 2 x 64, no precomputation, 100 epochs, evaluated every 10). Every
run is ``bnsgcn-train`` on one machine (``--procs``); only the wire format, p and the seed
change. Targets: int8 and fp16 within 0.5 points of none
(same staleness); staleness 1 within 1 point of staleness 0 (same format).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runnable from a checkout without installing the package
    sys.path.insert(0, str(REPO))

from benchmarks.suite import (  # noqa: E402
    ACCURACY,
    ACCURACY_FLAGS,
    _table,
    execute,
    machine,
    threads_per_rank,
    write_json,
)
from bnsgcn.comm.wire import FORMATS  # noqa: E402

# name -> (dataset spec, parts, partitioner, training flags)
GRAPHS = {
    "cora": (
        "cora",
        4,
        "metis",
        (
            "--model",
            "graphsage",
            "--layers",
            "2",
            "--hidden",
            "16",
            "--norm",
            "none",
            "--dropout",
            "0.5",
            "--weight-decay",
            "5e-4",
            "--epochs",
            "200",
            "--eval-every",
            "2",
        ),
    ),
    "acc": (ACCURACY, 8, "random", ("--model", "graphsage", *ACCURACY_FLAGS, "--epochs", "100")),
}
TARGET_POINTS = 0.5
STALE_TARGET_POINTS = 1.0


def run_one(
    work: Path, graph: str, data_dir: str | None, fmt: str, p: float, staleness: int, smoothing: float | None, seed: int
) -> dict:
    spec, parts, method, flags = GRAPHS[graph]
    parts_dir = work / "parts" / f"{graph}-{parts}"
    data = ["--data-dir", data_dir] if data_dir and graph == "cora" else []
    error = execute(
        ["bnsgcn-partition", spec, "--parts", str(parts), "--method", method, *data, "--out", str(parts_dir)],
        os.cpu_count() or 1,
        600,
    )[1]
    record = {"graph": graph, "format": fmt, "p": p, "staleness": staleness, "smoothing": smoothing, "seed": seed}
    if error:
        return record | {"error": error}
    run_dir = (
        work / "runs" / f"{graph}-{fmt}-p{p:g}-stale{staleness}{f'-smooth{smoothing:g}' if smoothing else ''}-s{seed}"
    )
    smoothing_flags = ["--stale-smoothing", f"{smoothing:g}"] if smoothing else []
    threads = threads_per_rank(parts, os.cpu_count() or 1)
    command = [
        "bnsgcn-train",
        "--parts-dir",
        str(parts_dir),
        "--procs",
        str(parts),
        "--threads",
        str(threads),
        "--p",
        f"{p:g}",
        "--compress",
        fmt,
        "--staleness",
        str(staleness),
        *smoothing_flags,
        "--seed",
        str(seed),
        *flags,
        "--out",
        str(run_dir),
    ]
    shutil.rmtree(run_dir, ignore_errors=True)  # a --work kept from an earlier invocation: bnsgcn-train refuses it
    wall, error = execute(command, threads, 1800)
    if error:
        return record | {"error": error}
    summary = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    return record | {"wall_s": wall, "best_val_score": summary["best_val_score"], "test_score": summary["test_score"]}


def summarise(runs: list[dict]) -> list[dict]:
    """Mean test accuracy per graph, format, p and staleness; its difference in points from
    none (same staleness) and from staleness 0 (same format)."""
    groups: dict[tuple, list[float]] = {}
    for r in runs:
        if "error" not in r:
            groups.setdefault((r["graph"], r["format"], r["p"], r.get("staleness", 0), r.get("smoothing")), []).append(
                r["test_score"]
            )
    mean = lambda key: statistics.fmean(groups[key]) if key in groups else None  # noqa: E731
    rows = []
    for (graph, fmt, p, staleness, smoothing), scores in groups.items():
        here = statistics.fmean(scores)
        none, exact = mean((graph, "none", p, staleness, smoothing)), mean((graph, fmt, p, 0, None))
        vs_none = None if none is None else 100 * (here - none)
        vs_exact = None if exact is None or staleness == 0 else 100 * (here - exact)
        rows.append(
            {
                "graph": graph,
                "format": fmt,
                "p": p,
                "staleness": staleness,
                "smoothing": smoothing,
                "seeds": len(scores),
                "test_mean": here,
                "test_scores": scores,
                "points_vs_none": vs_none,
                "met": None if vs_none is None or fmt not in ("int8", "fp16") else vs_none >= -TARGET_POINTS - 1e-9,
                "points_vs_staleness_0": vs_exact,
                "stale_met": None if vs_exact is None else vs_exact >= -STALE_TARGET_POINTS - 1e-9,
            }
        )
    return rows


def render(document: dict) -> str:
    head = [
        "graph",
        "p",
        "format",
        "staleness",
        "seeds",
        "test accuracy (mean)",
        "per seed",
        "points vs none",
        f"within {TARGET_POINTS} (int8, fp16)",
        "points vs staleness 0",
        f"within {STALE_TARGET_POINTS:g}",
    ]
    verdict = lambda met: {True: "met", False: "missed"}.get(met, "-")  # noqa: E731
    points = lambda value: "-" if value is None else f"{value:+.2f}"  # noqa: E731
    stale = lambda r: str(r.get("staleness", 0)) + (f" (smoothing {r['smoothing']:g})" if r.get("smoothing") else "")  # noqa: E731
    rows = [
        [
            r["graph"],
            f"{r['p']:g}",
            r["format"],
            stale(r),
            str(r["seeds"]),
            f"{100 * r['test_mean']:.2f}",
            " / ".join(f"{100 * s:.1f}" for s in r["test_scores"]),
            points(r["points_vs_none"]),
            verdict(r["met"]),
            points(r.get("points_vs_staleness_0")),
            verdict(r.get("stale_met")),
        ]
        for r in sorted(
            document["summary"],
            key=lambda r: (
                r["graph"],
                -r["p"],
                r.get("staleness", 0),
                r.get("smoothing") or 0,
                FORMATS.index(r["format"]),
            ),
        )
    ]
    failed = [
        f"failed: {r['graph']} {r['format']} p={r['p']:g} staleness {r.get('staleness', 0)} seed {r['seed']}: "
        f"{r['error']}"
        for r in document["runs"]
        if "error" in r
    ]
    commands = "; ".join(f"`{c}`" for c in document.get("commands", [document["command"]]))
    return "\n".join(
        [
            f"{document['date']}, {document['machine']['cores']} cores; commands: {commands}",
            "",
            _table(head, rows),
            *failed,
        ]
    )


def _load(out: Path) -> dict:
    try:
        return json.loads(out.read_text())
    except (OSError, ValueError):
        return {"runs": []}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compression", description=__doc__.split("\n\n")[0])
    parser.add_argument("--graphs", nargs="+", choices=sorted(GRAPHS), default=["cora", "acc"])
    parser.add_argument("--data-dir", help="where the Planetoid files of cora are")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--p", nargs="+", type=float, default=[1.0, 0.1])
    parser.add_argument("--staleness", nargs="+", type=int, choices=(0, 1), default=[0])
    parser.add_argument(
        "--stale-smoothing", type=float, help="--stale-smoothing of the staleness 1 runs (default: off)"
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument(
        "--work", type=Path, default=Path("/tmp/bnsgcn-compression"), help="partition sets and run directories"
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "compression.json")
    parser.add_argument("--render", type=Path, metavar="RESULT", help="print the table of a saved result and exit")
    args = parser.parse_args(argv)
    if args.render:
        print(render(json.loads(args.render.read_text())))
        return 0
    command = "python -m benchmarks.compression " + " ".join(argv or sys.argv[1:])
    # Runs already in --out are kept (a run of the same settings and seed is replaced), so
    # a grid can be extended; every command that contributed is listed.
    document = _load(args.out) | {"date": date.today().isoformat(), "machine": machine()}
    document["commands"] = [*document.get("commands", [document["command"]] if "command" in document else []), command]
    document["command"] = command
    grid = [
        (g, f, p, st, s)
        for g in args.graphs
        for p in args.p
        for s in args.seeds
        for st in args.staleness
        for f in args.formats
    ]
    for i, (graph, fmt, p, staleness, seed) in enumerate(grid, 1):
        smoothing = args.stale_smoothing if staleness else None
        print(
            f"[{i}/{len(grid)}] {graph} {fmt} p={p:g} staleness {staleness} smoothing {smoothing} seed {seed}",
            file=sys.stderr,
            flush=True,
        )
        record = run_one(args.work, graph, args.data_dir, fmt, p, staleness, smoothing, seed)
        key = lambda r: (r["graph"], r["format"], r["p"], r.get("staleness", 0), r.get("smoothing"), r["seed"])  # noqa: E731
        document["runs"] = [r for r in document["runs"] if key(r) != key(record)] + [record]
        document["summary"] = summarise(document["runs"])
        write_json(args.out, document)
    print(render(document))
    return 1 if any("error" in r for r in document["runs"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
