"""Time and memory of the partition step, per phase, for one or several partitioners side by side.

Runs the phases of ``bnsgcn-partition`` (load or generate, assign, order, write, verify) on a
synthetic graph and records, per phase, the wall time, the process' peak resident memory
(``VmHWM``: includes pages of memory-mapped input files, which the kernel can drop at
will), the peak *anonymous* memory of this process and its children sampled every 0.2 s
(proportional set size, so METIS' forked child is not counted twice; this is the memory
that must fit in RAM), and the edge cut of each partitioner::

    python benchmarks/partition_scale.py                     # Reddit-sized, 8 parts, METIS, in memory
    python benchmarks/partition_scale.py --spec synthetic:nodes=20000,degree=50 --parts 4
    # the reference graph's family (16 classes, 128 features, homophily 0.7), 50M edges,
    # streamed to disk, memory-mapped, coarse and METIS side by side:
    python benchmarks/partition_scale.py --csr-dir /tmp/g50m --method coarse,metis --parts 4 \\
        --spec synthetic:nodes=1000000,degree=50,classes=16,features=128,homophily=0.7 \\
        --result benchmarks/results/partition_scale_50m.json

With ``--csr-dir DIR`` the graph of ``--spec`` is first written to ``DIR`` in the ``csr:``
layout (``write_synthetic_csr``: edges streamed through bucket files, features into a
memory map; skipped when ``DIR`` already holds that spec) and then opened memory-mapped,
as ``bnsgcn-partition csr:DIR`` does; without it the graph is generated in memory. Each
partition set goes to a temporary directory deleted after its method (``--out`` keeps the
last one).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path

import numpy as np
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bnsgcn.data.format import load_partition  # noqa: E402
from bnsgcn.partition.datasets import Progress, load_dataset  # noqa: E402
from bnsgcn.partition.datasets.csr import META, write_synthetic_csr  # noqa: E402
from bnsgcn.partition.datasets.synthetic import parse_synthetic_spec  # noqa: E402
from bnsgcn.partition.order import ORDERS, block_positions  # noqa: E402
from bnsgcn.partition.partitioner import METHODS, assign, method_info, resolve_method  # noqa: E402
from bnsgcn.partition.writer import format_report, write_partition_set  # noqa: E402

REDDIT_SIZED = "synthetic:nodes=232965,degree=490,features=602,classes=41"
GIB = 1024**3
SAMPLE_S = 0.2


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


def anonymous_pss(pid: int) -> int:
    """Proportional anonymous memory of ``pid`` (``Pss_Anon`` of smaps_rollup), 0 if unreadable."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss_Anon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class AnonymousPeak:
    """Samples this process' and its children's anonymous PSS every :data:`SAMPLE_S` seconds; keeps the peak."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory sampler", daemon=True)

    def _sample(self) -> None:
        me = psutil.Process()
        pids = [me.pid] + [child.pid for child in me.children(recursive=True)]
        self.peak = max(self.peak, sum(anonymous_pss(pid) for pid in pids))

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._sample()

    def __enter__(self) -> AnonymousPeak:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def measure(phases: list[dict], name: str, action: Callable[[], object]) -> object:
    """Run ``action()``; append its wall time and peak memory to ``phases``."""
    print(f"[{time.strftime('%H:%M:%S')}] {name} ...", file=sys.stderr, flush=True)
    per_phase = reset_peak_rss()
    start = time.perf_counter()
    with AnonymousPeak() as anonymous:
        result = action()
    seconds = time.perf_counter() - start
    peak = peak_rss_bytes()
    # METIS runs in a forked child (partition/partitioner.py): its peak is the children's.
    child_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    phases.append(
        {
            "phase": name,
            "seconds": round(seconds, 2),
            "peak_anon_gib": round(anonymous.peak / GIB, 3),
            "peak_rss_gib": round(peak / GIB, 3),
            "peak_is_per_phase": per_phase,
            "child_peak_rss_gib": round(child_peak / GIB, 3),
            "rss_gib_after": round(psutil.Process().memory_info().rss / GIB, 3),
        }
    )
    print(
        f"[{time.strftime('%H:%M:%S')}] {name} done in {seconds:.1f}s, peak anonymous {anonymous.peak / GIB:.2f} GiB "
        f"(this process and children), peak RSS {peak / GIB:.2f} GiB incl. mapped files "
        f"(child processes so far: {child_peak / GIB:.2f} GiB)",
        file=sys.stderr,
        flush=True,
    )
    return result


def prepare_csr(spec: str, directory: Path) -> bool:
    """Write the graph of ``spec`` to ``directory`` unless it already holds it; True if written."""
    config = parse_synthetic_spec(spec.partition(":")[2])
    meta = directory / META
    if meta.is_file() and json.loads(meta.read_text()).get("spec") == config.spec():
        print(f"{directory} already holds {config.spec()}", file=sys.stderr)
        return False
    if directory.exists():
        raise SystemExit(f"error: {directory} exists and holds another graph; remove it or choose another --csr-dir")
    write_synthetic_csr(config, directory, Progress(directory.name))
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default=REDDIT_SIZED, help=f"dataset spec (default {REDDIT_SIZED})")
    parser.add_argument("--parts", type=int, default=8)
    parser.add_argument(
        "--method",
        default="metis",
        help=f"partitioner, or several comma-separated to run side by side ({', '.join(METHODS)}; default metis)",
    )
    parser.add_argument(
        "--csr-dir", type=Path, help="stream the synthetic --spec to this csr: directory and partition it memory-mapped"
    )
    parser.add_argument("--node-order", choices=ORDERS, default="blocks", help="as bnsgcn-partition's (default blocks)")
    parser.add_argument(
        "--memory-limit-gib", type=float, help="memory the partitioners may assume (default: available)"
    )
    parser.add_argument(
        "--out", type=Path, help="keep the last partition set here (default: a deleted temporary directory)"
    )
    parser.add_argument("--result", type=Path, default=REPO / "benchmarks" / "results" / "partition_scale.json")
    args = parser.parse_args(argv)
    methods = [m.strip() for m in args.method.split(",") if m.strip()]
    if not methods or any(m not in METHODS for m in methods):
        parser.error(f"--method takes {', '.join(METHODS)}, comma-separated")
    limit = int(args.memory_limit_gib * GIB) if args.memory_limit_gib else None

    phases: list[dict] = []
    runs: list[dict] = []
    spec = args.spec
    if args.csr_dir is not None:
        measure(phases, "generate (streamed to disk)", lambda: prepare_csr(args.spec, args.csr_dir))
        spec = f"csr:{args.csr_dir}"
    graph = measure(
        phases,
        "load" + (" (memory-mapped, checked)" if args.csr_dir else ""),
        lambda: load_dataset(spec, None, progress=True),
    )
    for method in methods:
        resolved = resolve_method(method, graph.num_nodes, graph.num_edges, limit)
        run_phases: list[dict] = []
        with tempfile.TemporaryDirectory(prefix="partition-scale-") as scratch:
            out_dir = args.out if args.out is not None and method == methods[-1] else Path(scratch) / "set"
            assignment = measure(
                run_phases,
                f"assign ({resolved})",
                lambda: assign(graph, args.parts, resolved, "cut", 0, memory_limit=limit, progress=True),
            )
            position, blocks = None, None
            if args.node_order == "blocks":
                position, blocks = measure(
                    run_phases,
                    "order (blocks)",
                    lambda: block_positions(graph, assignment, args.parts, memory_limit=limit),
                )
            info = (
                method_info(resolved, "cut", 0)
                | {"node_order": args.node_order}
                | ({"blocks_by": blocks} if blocks else {})
            )
            manifest = measure(
                run_phases,
                "write",
                lambda: write_partition_set(
                    graph,
                    assignment,
                    out_dir,
                    parts=args.parts,
                    method_info=info,
                    dataset_spec=spec,
                    force=True,
                    position=position,
                ),
            )
            # drop the node order before verifying, so that phase's peak memory does not count it
            position = None
            measure(
                run_phases,
                "verify checksums",
                lambda: [load_partition(out_dir, k, verify=True) for k in range(args.parts)],
            )
            set_bytes = sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file())
        print(f"{method} ({resolved}):\n{format_report(manifest['report'])}")
        runs.append(
            {
                "method": method,
                "resolved": resolved,
                "node_order": args.node_order,
                "blocks_by": blocks,
                "phases": run_phases,
                "seconds": round(sum(p["seconds"] for p in run_phases), 2),
                "peak_anon_gib": max(p["peak_anon_gib"] for p in run_phases),
                "cut_edges": manifest["report"]["totals"]["cut_edges"],
                "cut_fraction": round(manifest["report"]["totals"]["cut_edges"] / max(1, graph.num_edges), 4),
                "set_bytes": set_bytes,
                "report_totals": manifest["report"]["totals"],
            }
        )
        phases.extend({**p, "phase": f"{method}: {p['phase']}"} for p in run_phases)

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
        "input": "memory-mapped csr" if args.csr_dir else "in memory",
        "parts": args.parts,
        "graph": {
            "nodes": graph.num_nodes,
            "directed_edges": graph.num_edges,
            "features": int(graph.features.shape[1]),
        },
        "phases": phases,
        "runs": runs,
        "total_seconds": round(sum(p["seconds"] for p in phases), 2),
        "peak_anon_gib": max(p["peak_anon_gib"] for p in phases),
        "peak_rss_gib": max(p["peak_rss_gib"] for p in phases),
    }
    args.result.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.result.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, args.result)
    print(
        json.dumps(
            {k: result[k] for k in ("total_seconds", "peak_anon_gib", "peak_rss_gib")}
            | {
                "runs": [
                    {k: r[k] for k in ("method", "resolved", "seconds", "peak_anon_gib", "cut_edges")} for r in runs
                ]
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
