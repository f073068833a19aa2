"""``bnsgcn.partition(graph, parts, out, ...)``: ``bnsgcn-partition`` called from Python.

The arguments become the command's flags and go through its parser and its code path
(:func:`bnsgcn.partition.cli.make_partition_set`): the same checks, the same one-line
messages (raised as :class:`~bnsgcn.errors.UserError`), the same reuse of a set made by the
same request. A graph given as an object rather than a dataset name is read by
:mod:`bnsgcn.partition.datasets.objects`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from bnsgcn.data.format import read_manifest
from bnsgcn.errors import UserError


@dataclass(frozen=True)
class PartitionSet:
    """A partition set on disk, as its manifest describes it (docs/partition-format.md).

    ``path`` its directory; ``parts`` K; ``num_nodes``, ``num_edges`` (directed, without
    self-loops), ``num_features``, ``num_classes`` of its graph; ``inner``, ``boundary`` and
    ``train``: per partition (tuples of K ints) its inner nodes, boundary nodes and training
    nodes; ``reused``: the set was there already, made by the same request; ``manifest``
    the whole manifest. Path-like: ``bnsgcn.train(parts)`` and ``Path(parts)`` take it.
    """

    path: Path
    parts: int
    num_nodes: int
    num_edges: int
    num_features: int
    num_classes: int
    inner: tuple[int, ...]
    boundary: tuple[int, ...]
    train: tuple[int, ...]
    reused: bool = False
    manifest: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def read(cls, path: str | os.PathLike, reused: bool = False) -> PartitionSet:
        """The set at ``path`` (:class:`UserError` when it is not a readable set)."""
        manifest = read_manifest(Path(path))
        dataset, partitions = manifest["dataset"], manifest["partitions"]
        return cls(
            path=Path(path),
            parts=manifest["parts"],
            num_nodes=dataset["num_nodes"],
            num_edges=dataset.get("num_edges", 0),
            num_features=dataset["num_features"],
            num_classes=dataset["num_classes"],
            inner=tuple(p["n_inner"] for p in partitions),
            boundary=tuple(p["n_boundary"] for p in partitions),
            train=tuple(p.get("train_nodes", 0) for p in partitions),
            reused=reused,
            manifest=manifest,
        )

    def __fspath__(self) -> str:
        return str(self.path)

    def report(self) -> str:
        """The partition report ``bnsgcn-partition`` prints: per partition its inner and boundary
        nodes, their ratio, local and cut edges and training nodes, then the totals."""
        from .writer import format_report  # with numba: imported on use, as the whole step

        return format_report(self.manifest["report"])


def partition(
    graph: object,
    parts: int = 2,
    out: str | os.PathLike | None = None,
    *,
    method: str = "metis",
    objective: str = "cut",
    seed: int = 0,
    node_order: str = "blocks",
    assignment: str | os.PathLike | None = None,
    memory_limit: int | str | None = None,
    num_classes: int | None = None,
    force: bool = False,
    data_dir: str | os.PathLike | None = None,
    download: bool = False,
    features: object = None,
    labels: object = None,
    split: Mapping | None = None,
    name: str | None = None,
    progress: bool = True,
) -> PartitionSet:
    """Split ``graph`` into ``parts`` partitions written to ``out``; return the set.

    ``graph``: a dataset name as ``bnsgcn-partition`` takes it (``"cora"``,
    ``"npz:path.npz"``, ``"synthetic:nodes=1000"``; files under ``data_dir``), or an object
    (:mod:`bnsgcn.partition.datasets.objects`): a PyG ``Data``, a DGL graph, an OGB
    node-property dataset, a sparse adjacency [N, N] (``tocsr()``) or an ``(indptr, indices)``
    pair, with ``features`` float [N, F], ``labels`` int [N] (or 0/1 [N, C]) and ``split``
    (``{"train", "val", "test"}``: bool masks [N] or node ids) where the object lacks them.
    ``name`` names such a graph in the manifest (default ``"graph"``). ``download`` fetches a
    named dataset's missing files into ``data_dir`` first (``--download``).

    The other arguments are the command's flags: ``out`` (default ``parts/<name>-<parts>``),
    ``method`` (metis, random, coarse, auto), ``objective`` (cut, vol), ``seed``,
    ``node_order`` (blocks, ids), ``assignment`` (a file of part ids), ``memory_limit``
    (bytes, or ``"8G"``), ``num_classes``, ``force``; ``~`` in paths is expanded. ``progress``
    shows progress on stderr.
    An existing set made by the same request is reused (``reused`` says so); a different one
    at ``out`` is refused unless ``force``. Bad input raises :class:`UserError` with the
    command's message.
    """
    # only the flags given: the parser supplies the command's defaults for the rest
    flags = {
        "--parts": parts,
        "--out": out,
        "--method": method,
        "--objective": objective,
        "--seed": seed,
        "--node-order": node_order,
        "--assignment": assignment,
        "--memory-limit": memory_limit,
        "--num-classes": num_classes,
        "--data-dir": data_dir,
    }
    for flag in ("--out", "--assignment", "--data-dir"):  # ~ as a shell expands it on the command line
        if flags[flag] is not None:
            flags[flag] = os.path.expanduser(os.fspath(flags[flag]))
    argv = [f"{flag}={value}" for flag, value in flags.items() if value is not None]
    argv += ["--force"] if force else []
    argv += ["--download"] if download else []
    in_memory = not isinstance(graph, str)
    if in_memory and (data_dir is not None or download):
        raise UserError(
            "data_dir= and download= are for a named dataset's files; a graph given as an object needs neither"
        )
    if not in_memory and any(v is not None for v in (features, labels, split)):
        raise UserError(f"features=, labels= and split= go with a graph given as an object, not with {graph!r}")
    from .cli import build_parser, make_partition_set

    parser = build_parser()
    parser.raises = True  # the command's one-line message, raised instead of printed with exit status 2
    # "--" first: a dataset spec is never read as a flag; "memory:" stands in until the graph is read
    args = parser.parse_args([*argv, "--", graph if not in_memory else "memory:"])
    source = None
    if in_memory:
        from .datasets.objects import graph_source

        source, args.dataset = graph_source(
            graph, features=features, labels=labels, split=split, name=name, progress=progress
        )
    _, reused, out_dir = make_partition_set(args, source, progress=progress)
    return PartitionSet.read(out_dir, reused=reused)
