"""Time and memory of the partition step on a Reddit-sized graph.

Runs the three phases of ``bnsgcn-partition`` (load/generate, METIS, write) on a synthetic
graph with Reddit's shape (232,965 nodes, ~115M directed edges, 602 features, 41 classes)
and records the wall time of each phase, the process' peak resident memory after it and
that of its child processes (METIS runs in one) to ``benchmarks/results/partition_scale.json``::

    python benchmarks/partition_scale.py                     # Reddit-sized, 8 parts
    python benchmarks/partition_scale.py --spec synthetic:nodes=20000,degree=50 --parts 4

The partition set goes to a temporary directory that is deleted at the end (``--out``
keeps it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bnsgcn.format import load_partition  # noqa: E402
from bnsgcn.partition.datasets import load_dataset  # noqa: E402
from bnsgcn.partition.partitioner import assign, method_info  # noqa: E402
from bnsgcn.partition.writer import format_report, write_partition_set  # noqa: E402

REDDIT_SIZED = "synthetic:nodes=232965,degree=490,features=602,classes=41"
GIB = 1024**3


def reset_peak_rss() -> bool:
    """Restart the kernel's peak-RSS counter (Linux >= 4.0); False where that is impossible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak resident set size since the last reset (``VmHWM``), else since the start."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def measure(phases: list[dict], name: str, action):
    """Run ``action()``; append its wall time and peak RSS (of this phase where the kernel allows) to ``phases``."""
    print(f"[{time.strftime('%H:%M:%S')}] {name} ...", file=sys.stderr, flush=True)
    per_phase = reset_peak_rss()
    start = time.perf_counter()
    result = action()
    seconds = time.perf_counter() - start
    peak = peak_rss_bytes()
    # METIS runs in a forked child (partition/partitioner.py): its peak is the children's.
    child_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    phases.append({
        "phase": name,
        "seconds": round(seconds, 2),
        "peak_rss_gib": round(peak / GIB, 3),
        "peak_is_per_phase": per_phase,
        "child_peak_rss_gib": round(child_peak / GIB, 3),
        "rss_gib_after": round(psutil.Process().memory_info().rss / GIB, 3),
    })
    print(f"[{time.strftime('%H:%M:%S')}] {name} done in {seconds:.1f}s, peak RSS {peak / GIB:.2f} GiB"
          f" (child processes so far: {child_peak / GIB:.2f} GiB)", file=sys.stderr, flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default=REDDIT_SIZED, help=f"dataset spec (default {REDDIT_SIZED})")
    parser.add_argument("--parts", type=int, default=8)
    parser.add_argument("--method", default="metis", choices=("metis", "random"))
    parser.add_argument("--out", type=Path, help="keep the partition set here (default: a deleted temporary directory)")
    parser.add_argument("--result", type=Path, default=REPO / "benchmarks" / "results" / "partition_scale.json")
    args = parser.parse_args(argv)

    phases: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="partition-scale-") as scratch:
        out_dir = args.out if args.out is not None else Path(scratch) / "set"
        graph = measure(phases, "load", lambda: load_dataset(args.spec, None, progress=True))
        assignment = measure(phases, f"assign ({args.method})", lambda: assign(graph, args.parts, args.method, "cut", 0))
        manifest = measure(phases, "write", lambda: write_partition_set(
            graph, assignment, out_dir, parts=args.parts, method_info=method_info(args.method, "cut", 0),
            dataset_spec=args.spec, force=True))
        measure(phases, "verify checksums", lambda: [load_partition(out_dir, k, verify=True) for k in range(args.parts)])
        set_bytes = sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file())
    print(format_report(manifest["report"]))

    result = {
        "benchmark": "partition_scale",
        "date": date.today().isoformat(),
        "command": "python " + " ".join([str(Path(sys.argv[0]))] + (sys.argv[1:] if argv is None else argv)),
        "machine": {
            "cpus": os.cpu_count(),
            "memory_gib": round(psutil.virtual_memory().total / GIB, 1),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "numpy": np.__version__,
        },
        "spec": args.spec,
        "parts": args.parts,
        "method": args.method,
        "graph": {"nodes": graph.num_nodes, "directed_edges": graph.num_edges, "features": int(graph.features.shape[1])},
        "phases": phases,
        "total_seconds": round(sum(p["seconds"] for p in phases), 2),
        "peak_rss_gib": max(p["peak_rss_gib"] for p in phases),
        "set_bytes": set_bytes,
        "report_totals": manifest["report"]["totals"],
    }
    args.result.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.result.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, args.result)
    print(json.dumps({k: result[k] for k in ("phases", "total_seconds", "peak_rss_gib")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
