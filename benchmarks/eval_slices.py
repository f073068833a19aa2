"""Peak memory per rank with evaluation in slices and without (``--eval-buffer-mib``), A/B.

Runs the same training job once per ``--eval-buffer-mib`` setting (0 = unsliced), the
settings alternating, ``--rounds`` times, each job started by ``bnsgcn-train`` (2 or more
local ranks, one thread each), and records per rank what its report holds: peak RSS, the
evaluation buffers and training's exchange buffers at their largest, the evaluation's
time and the test score::

    python benchmarks/eval_slices.py --parts-dir /tmp/ref-parts --procs 2 --p 0.1 \\
        --settings 0,32,4 --result benchmarks/results/eval_slices_ref.json

The settings of one round run back to back, so they see the same load on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

MIB = 2**20


def run_job(parts_dir: Path, procs: int, p: float, epochs: int, buffer_mib: float, out: Path, extra: list[str]) -> dict:
    """One job; its per-rank figures from report.json and the final scores."""
    command = [
        sys.executable,
        "-m",
        "bnsgcn.launch.cli",
        "--parts-dir",
        str(parts_dir),
        "--procs",
        str(procs),
        "--threads",
        "1",
        "--p",
        str(p),
        "--epochs",
        str(epochs),
        "--eval-every",
        "0",
        "--eval-buffer-mib",
        str(buffer_mib),
        "--out",
        str(out),
        *extra,
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"job failed ({' '.join(command)}):\n{done.stderr[-3000:]}")
    report = json.loads((out / "report.json").read_text())
    summary = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    return {
        "eval_buffer_mib": buffer_mib,
        "test_score": summary["test_score"],
        "ranks": [
            {
                "peak_rss_mib": r["peak_rss_bytes"] / MIB,
                "evaluation_buffer_mib": r["evaluation_buffer_bytes"] / MIB,
                "exchange_buffer_mib": r["exchange_buffer_bytes"] / MIB,
                "saved_activation_mib": r["saved_activation_bytes"] / MIB,
                "boundary_nodes": r["boundary_nodes"],
                "inner_nodes": r["inner_nodes"],
            }
            for r in report["ranks"]
        ],
        # the last epoch evaluates (--eval-every 0): its evaluation time, slowest rank
        "evaluation_s": max(
            float(line["time"]["evaluation"])
            for line in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "time" in line
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts-dir", type=Path, required=True)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--p", type=float, default=0.1)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--settings", default="0,32,4", help="--eval-buffer-mib values, comma-separated (0: unsliced)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--result", type=Path, help="write the records here (JSON)")
    parser.add_argument("extra", nargs="*", help="more bnsgcn-train flags, after --")
    args = parser.parse_args(argv)
    settings = [float(s) for s in args.settings.split(",")]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for mib in settings:
                load = os.getloadavg()[0]
                run = run_job(
                    args.parts_dir, args.procs, args.p, args.epochs, mib, Path(tmp) / f"{round_}-{mib}", args.extra
                )
                runs.append(run | {"round": round_, "load_average_1min": load})
                peaks = ", ".join(f"{r['peak_rss_mib']:.0f}" for r in run["ranks"])
                evals = ", ".join(f"{r['evaluation_buffer_mib']:.1f}" for r in run["ranks"])
                print(
                    f"round {round_} --eval-buffer-mib {mib:g}: peak RSS per rank {peaks} MiB; "
                    f"evaluation buffers {evals} MiB; "
                    f"evaluation {run['evaluation_s']:.2f} s; test {run['test_score']:.4f} (load {load:.1f})",
                    flush=True,
                )
    if args.result:
        info = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "parts_dir": str(args.parts_dir),
            "procs": args.procs,
            "p": args.p,
            "epochs": args.epochs,
            "extra": args.extra,
        }
        args.result.write_text(json.dumps({"info": info, "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
