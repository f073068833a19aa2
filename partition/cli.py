"""``bnsgcn-partition``: load a dataset, partition it, write a partition set.

    bnsgcn-partition [--parts K] DATASET [--data-dir DIR] [--out DIR]
                     [--method metis|random] [--objective cut|vol] [--assignment FILE]
                     [--seed N] [--force] [--debug]

Bad input ends with ``error: <message>`` on one line of stderr and exit status 2, and
leaves no output directory behind; so does an interruption (Ctrl-C: status 130, SIGTERM:
status 143). Progress goes to stderr; the location of the set and its partition report go
to stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import signal
import sys
from pathlib import Path

from bnsgcn.errors import UserError
from bnsgcn.progress import step

from . import Terminated
from .partitioner import METHODS, OBJECTIVES, assign, method_info, validate_parts
from .writer import find_reusable, format_report, input_entries, probe_writable, remove_stale_temporaries, write_partition_set

DEFAULT_PARTS = 2
DEFAULT_DATASET = "synthetic"
PARTS_ROOT = Path("parts")


def default_out_dir(spec: str, parts: int) -> Path:
    """``parts/<name>-<K>`` with a file-system-safe ``name`` derived from the dataset spec.

    A plain name is kept (``reddit`` -> ``parts/reddit-4``). A spec with arguments gets a
    short hash of them, so different synthetic graphs never share a directory
    (``synthetic:nodes=1000`` -> ``parts/synthetic-bd837c09-4``); for ``npz:`` and ``saint:``
    the file or directory name is kept as well (``npz-cora-<hash>-4``).
    """
    kind, _, argument = spec.partition(":")
    pieces = [kind]
    if argument:
        if kind in ("npz", "saint"):
            pieces.append(Path(argument).stem)
        pieces.append(hashlib.sha256(argument.encode()).hexdigest()[:8])
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", "-".join(pieces)).strip("-.") or "dataset"
    return PARTS_ROOT / f"{name}-{parts}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bnsgcn-partition",
        description="Partition a graph dataset for partition-parallel training (bnsgcn-train).",
    )
    parser.add_argument("dataset", nargs="?", default=DEFAULT_DATASET,
                        help="reddit, ogbn-products, ogbn-arxiv, ogbn-papers100M, yelp, saint:<dir>, cora, citeseer, "
                             "pubmed, npz:<path> or synthetic[:key=value,...] (default: synthetic)")
    parser.add_argument("--parts", type=int, default=DEFAULT_PARTS,
                        help=f"number of partitions = training ranks (default {DEFAULT_PARTS})")
    parser.add_argument("--data-dir", type=Path, help="directory holding the dataset files (default ./data)")
    parser.add_argument("--out", type=Path, help="output directory (default parts/<dataset>-<K>)")
    parser.add_argument("--method", choices=METHODS, default="metis", help="partitioner (default metis)")
    parser.add_argument("--objective", choices=OBJECTIVES, default="cut",
                        help="METIS objective: edge cut or communication volume (default cut)")
    parser.add_argument("--assignment", type=Path,
                        help="use this assignment instead (.npy or text, one part id per node), e.g. from ParMETIS")
    parser.add_argument("--seed", type=int, default=0, help="seed of METIS / random partitioning (default 0)")
    parser.add_argument("--force", action="store_true", help="replace an existing partition set at --out")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser


def run(args: argparse.Namespace) -> int:
    validate_parts(args.parts)
    out_dir = args.out if args.out is not None else default_out_dir(args.dataset, args.parts)
    partitioner = method_info(args.method, args.objective, args.seed, args.assignment)
    from .datasets import resolve_dataset  # imported late: loaders pull in heavy modules

    source = resolve_dataset(args.dataset, args.data_dir)
    inputs = input_entries(source.files)
    try:
        manifest = find_reusable(out_dir, args.dataset, args.parts, partitioner, args.force, inputs=inputs)
        if manifest is None:
            remove_stale_temporaries(out_dir)
            probe_writable(out_dir)  # fail before a long load, not after it
    except OSError as exc:
        raise _unwritable(out_dir, exc) from exc
    if manifest is not None:
        print(f"reusing the partition set at {out_dir} (same dataset files, parts and partitioner); "
              "pass --force to rewrite it")
    else:
        with step(f"loading {args.dataset}"):
            graph = source.load(progress=True)
        validate_parts(args.parts, graph.num_nodes)
        method = "assignment file" if args.assignment is not None else args.method
        with step(f"partitioning {graph.num_nodes:,} nodes into {args.parts} parts ({method})"):
            assignment = assign(graph, args.parts, args.method, args.objective, args.seed, args.assignment)
        try:
            manifest = write_partition_set(graph, assignment, out_dir, parts=args.parts, method_info=partitioner,
                                           dataset_spec=args.dataset, inputs=inputs, force=args.force)
        except OSError as exc:
            raise _unwritable(out_dir, exc) from exc
        print(f"partition set written to {out_dir}")
    print(format_report(manifest["report"]))
    return 0


def _unwritable(out_dir: Path, exc: OSError) -> UserError:
    return UserError(f"cannot write the partition set to {out_dir} ({exc.strerror or exc}); choose a writable --out")


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Without a handler SIGTERM ends the process at once, leaving <out>.tmp-<host>-<pid> behind.
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return run(args)
    except UserError as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Terminated:
        print("error: terminated (SIGTERM); no partition set was written", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("error: interrupted; no partition set was written", file=sys.stderr)
        return 128 + signal.SIGINT
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
