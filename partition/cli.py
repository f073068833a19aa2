"""``bnsgcn-partition``: load a dataset, partition it, write a partition set.

    bnsgcn-partition [--parts K] DATASET [--data-dir DIR] [--download] [--out DIR]
                     [--method metis|random|coarse|auto] [--objective cut|vol] [--assignment FILE]
                     [--memory-limit SIZE] [--node-order blocks|ids] [--num-classes N] [--seed N]
                     [--force] [--debug]

Bad input ends with ``error: <message>`` on one line of stderr and exit status 2, and
leaves no output directory behind; so does an interruption (Ctrl-C: status 130, SIGTERM:
status 143), running out of memory (the line names the phase and the memory it
needs) and a full disk (the line names the file). Progress goes to stderr; the location
of the set and its partition report go to stdout.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import re
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bnsgcn.cli import Parser
from bnsgcn.config.original import PARTITION, add_original_flags, aliases_epilog, elsewhere
from bnsgcn.errors import UserError
from bnsgcn.metrics.progress import step

from . import Terminated
from .coarse import coarse_bytes, format_bytes, metis_bytes
from .datasets import CLASS_COUNT_FLOOR, CLASS_COUNT_RATIO, DatasetSource, resolve_dataset, with_class_count
from .datasets.download import DOWNLOADS, MIRROR_VARIABLE, resolve_or_download
from .order import ORDERS, block_positions, order_bytes
from .partitioner import (
    METHODS,
    OBJECTIVES,
    assign,
    available_memory,
    method_info,
    resolve_method,
    validate_parts,
)
from .writer import (
    find_reusable,
    format_report,
    input_entries,
    probe_writable,
    remove_stale_temporaries,
    write_partition_set,
    writer_bytes,
)

DEFAULT_PARTS = 2
DEFAULT_DATASET = "synthetic"
PARTS_ROOT = Path("parts")


def default_out_dir(spec: str, parts: int, root: Path = PARTS_ROOT) -> Path:
    """``<root>/<name>-<K>`` (``root``: ``parts``) with a file-system-safe ``name`` derived from
    the dataset spec.

    A plain name is kept (``reddit`` -> ``parts/reddit-4``). A spec with arguments gets a
    short hash of them, so different synthetic graphs never share a directory
    (``synthetic:nodes=1000`` -> ``parts/synthetic-bd837c09-4``); for ``npz:`` and ``saint:``
    the file or directory name is kept as well (``npz-cora-<hash>-4``).
    """
    kind, _, argument = spec.partition(":")
    pieces = [kind]
    if argument:
        if kind in ("npz", "saint", "csr"):
            pieces.append(Path(argument).stem)
        pieces.append(hashlib.sha256(argument.encode()).hexdigest()[:8])
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", "-".join(pieces)).strip("-.") or "dataset"
    return Path(root) / f"{name}-{parts}"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="bnsgcn-partition",
        description="Partition a graph dataset for partition-parallel training (bnsgcn-train).",
        epilog=aliases_epilog(PARTITION, example="--data_dir"),
        elsewhere=elsewhere("bnsgcn-partition"),
    )
    parser.add_argument(
        "dataset",
        nargs="?",
        default=None,  # DEFAULT_DATASET, unless the original's --dataset names one (settle)
        help="reddit, ogbn-products, ogbn-arxiv, ogbn-papers100M, yelp, saint:<dir>, cora, citeseer, "
        "pubmed, npz:<path>, csr:<dir> (memory-mapped) or synthetic[:key=value,...] (default: synthetic)",
    )
    parser.add_argument(
        "--parts",
        type=int,
        default=DEFAULT_PARTS,
        help=f"number of partitions = training ranks (default {DEFAULT_PARTS})",
    )
    parser.add_argument("--data-dir", type=Path, help="directory holding the dataset files (default ./data)")
    parser.add_argument(
        "--download",
        action="store_true",
        help=f"fetch the dataset's files into --data-dir when they are missing ({', '.join(DOWNLOADS)}); "
        f"${MIRROR_VARIABLE} replaces the sources' URLs",
    )
    parser.add_argument("--out", type=Path, help="output directory (default parts/<dataset>-<K>)")
    parser.add_argument(
        "--method",
        choices=METHODS,
        default="metis",
        help="partitioner: metis, random, coarse (METIS on a coarsened graph, for graphs METIS cannot hold) "
        "or auto (metis when its estimated memory fits, else coarse); default metis",
    )
    parser.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="cut",
        help="METIS objective: edge cut or communication volume (default cut)",
    )
    parser.add_argument(
        "--assignment",
        type=Path,
        help="use this assignment instead (.npy or text, one part id per node), e.g. from ParMETIS",
    )
    parser.add_argument(
        "--memory-limit",
        type=parse_size,
        metavar="SIZE",
        help="memory the step may use, e.g. 8G or 500M (default: what the system reports available); "
        "decides --method auto and bounds coarse",
    )
    parser.add_argument(
        "--node-order",
        choices=ORDERS,
        default="blocks",
        help="order of the nodes within a partition: blocks of nodes that share neighbours, which "
        "makes training's sparse products faster (METIS on each partition), or ascending global "
        "ids (default blocks)",
    )
    parser.add_argument(
        "--num-classes",
        type=positive_int,
        metavar="N",
        help="the number of classes, when it is far above the distinct labels (over "
        f"{CLASS_COUNT_FLOOR} and over {CLASS_COUNT_RATIO}x them, refused otherwise as a likely stray label); "
        "default: the largest label + 1",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of METIS / random partitioning and of the node order (default 0)"
    )
    parser.add_argument("--force", action="store_true", help="replace an existing partition set at --out")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    add_original_flags(parser, PARTITION)
    return parser


def settle(args: argparse.Namespace) -> argparse.Namespace:
    """The arguments as :func:`run` takes them: the original BNS-GCN's ``--dataset``,
    ``--part-path`` and ``--graph-name`` (:mod:`bnsgcn.config.original`) resolved into
    DATASET and ``--out``, and the dataset's default filled in."""
    settled = argparse.Namespace(**vars(args))
    option, part_path, graph_name = (settled.__dict__.pop(k) for k in ("dataset_option", "part_path", "graph_name"))
    if option is not None:
        if settled.dataset is not None and settled.dataset != option:
            raise UserError(f"DATASET {settled.dataset} and --dataset {option} disagree; pass the dataset once")
        settled.dataset = option
    if settled.dataset is None:
        settled.dataset = DEFAULT_DATASET
    if part_path is not None or graph_name is not None:
        if settled.out is not None:
            raise UserError(
                f"--out {settled.out} and --part-path/--graph-name both name the set's directory; pass one of them"
            )
        root = PARTS_ROOT if part_path is None else part_path
        settled.out = root / graph_name if graph_name else default_out_dir(settled.dataset, settled.parts, root)
    return settled


SIZE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
RANDOM_BYTES_PER_NODE = 32  # the shuffled order and the assignment, int64 each, with temporaries


def positive_int(text: str) -> int:
    """A count given on the command line, at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}; pass a positive integer")
    return value


def parse_size(text: str) -> int:
    """``8G``, ``500M``, ``1.5GiB``, ``1024`` -> bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not match or float(match[1]) <= 0:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}; write e.g. 8G, 500M or a number of bytes")
    return int(float(match[1]) * SIZE_UNITS[match[2].upper()])


@contextmanager
def phase(desc: str, need: int | None, memory_limit: int | None, enabled: bool = True) -> Iterator[None]:
    """Run one phase as a progress :func:`step` (shown when ``enabled``); running out of memory
    in it becomes one :class:`UserError` naming the phase, the allocation that failed and
    ``need`` (bytes, estimated)."""
    try:
        with step(desc, enabled=enabled):
            yield
    except MemoryError as exc:
        failed = getattr(exc, "_total_size", None)  # numpy's _ArrayMemoryError knows the request
        what = f"allocating {format_bytes(failed)} failed" if failed else "an allocation failed"
        needs = f"it needs about {format_bytes(need)}, " if need is not None else ""
        raise UserError(
            f"out of memory while {desc} ({what}; {needs}{format_bytes(available_memory(memory_limit))} available); "
            "free memory, use a larger machine, or pass more --parts or --method coarse"
        ) from None


def run(args: argparse.Namespace) -> int:
    manifest, reused, out_dir = make_partition_set(args)
    if reused:
        print(
            f"reusing the partition set at {out_dir} (same dataset files, parts and partitioner); "
            "pass --force to rewrite it"
        )
    else:
        print(f"partition set written to {out_dir}")
    print(format_report(manifest["report"]))
    return 0


def make_partition_set(
    args: argparse.Namespace, source: DatasetSource | None = None, progress: bool = True
) -> tuple[dict, bool, Path]:
    """Everything ``bnsgcn-partition`` does for the parsed flags ``args`` but print the result:
    check, load, partition, order and write the set, or find it made already.

    ``source`` is a graph handed over in Python (``bnsgcn.partition``), ``args.dataset`` then
    being its spec; None loads the dataset ``args.dataset`` names from ``args.data_dir``,
    downloading its files first when they are missing and ``args.download`` is set.
    ``progress`` shows the progress lines on stderr. Returns the manifest, whether an
    existing set was reused, and the set's directory.
    """
    args = settle(args)
    validate_parts(args.parts)
    out_dir = args.out if args.out is not None else default_out_dir(args.dataset, args.parts)
    partitioner = method_info(args.method, args.objective, args.seed, args.assignment) | {"node_order": args.node_order}
    if source is None and args.download:
        source = resolve_or_download(args.dataset, args.data_dir, progress)
    elif source is None:
        source = resolve_dataset(args.dataset, args.data_dir)
    inputs = input_entries(source.files)
    try:
        manifest = find_reusable(
            out_dir,
            args.dataset,
            args.parts,
            partitioner,
            args.force,
            inputs=inputs,
            num_classes_given=args.num_classes,
        )
        if manifest is None:
            remove_stale_temporaries(out_dir)
            probe_writable(out_dir)  # fail before a long load, not after it
    except OSError as exc:
        raise _unwritable(out_dir, exc) from exc
    if manifest is not None:
        return manifest, True, out_dir
    limit = args.memory_limit
    with phase(f"loading {args.dataset}", None, limit, progress):
        graph = with_class_count(source.load(progress=progress), args.num_classes, args.dataset)
    validate_parts(args.parts, graph.num_nodes)
    if args.assignment is not None:
        method, need = "assignment file", None
    else:
        method = resolve_method(args.method, graph.num_nodes, graph.num_edges, limit)
        need = {
            "metis": metis_bytes(graph.num_nodes, graph.num_edges),
            "coarse": coarse_bytes(graph.num_nodes),
            "random": RANDOM_BYTES_PER_NODE * graph.num_nodes,
        }[method]
        if args.method == "auto":
            partitioner = {**partitioner, "resolved": method}
            print(
                f"--method auto: {method} (METIS needs about "
                f"{format_bytes(metis_bytes(graph.num_nodes, graph.num_edges))}, "
                f"{format_bytes(available_memory(limit))} available)",
                file=sys.stderr,
            )
        elif method == "metis" and need > available_memory(limit):
            print(
                f"warning: METIS needs about {format_bytes(need)} but {format_bytes(available_memory(limit))} are "
                "available; "
                "it may be killed, --method coarse fits in less",
                file=sys.stderr,
            )
    with phase(f"partitioning {graph.num_nodes:,} nodes into {args.parts} parts ({method})", need, limit, progress):
        assignment = assign(
            graph, args.parts, method, args.objective, args.seed, args.assignment, memory_limit=limit, progress=progress
        )
    position = None
    if args.node_order == "blocks":
        with phase("ordering nodes into blocks", order_bytes(graph, assignment, args.parts), limit, progress):
            position, blocks = block_positions(
                graph, assignment, args.parts, seed=args.seed, memory_limit=limit, progress=progress
            )
        partitioner = {**partitioner, "blocks_by": blocks}
    try:
        with phase("writing partitions", writer_bytes(graph, assignment, args.parts), limit, progress):
            manifest = write_partition_set(
                graph,
                assignment,
                out_dir,
                parts=args.parts,
                method_info=partitioner,
                dataset_spec=args.dataset,
                inputs=inputs,
                force=args.force,
                progress=progress,
                position=position,
                num_classes_given=args.num_classes,
            )
    except OSError as exc:
        raise _unwritable(out_dir, exc) from exc
    return manifest, False, out_dir


def _unwritable(out_dir: Path, exc: OSError) -> UserError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return UserError(
            f"{exc.filename or out_dir}: the disk is full ({exc.strerror}); free space there or choose an --out on "
            "another file system (no partition set was written)"
        )
    return UserError(f"cannot write the partition set to {out_dir} ({exc.strerror or exc}); choose a writable --out")


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Without a handler SIGTERM ends the process at once, leaving <out>.tmp-<host>-<pid>-<random> behind.
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
