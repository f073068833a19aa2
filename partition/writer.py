"""Write a partition set: per-partition arrays, send lists, manifest and report.

For an assignment ``a`` (``a[v]`` = owner of node ``v``) partition ``k`` holds

* inner nodes ``I_k = {v : a[v] = k}``, ascending by ``position[v]`` (the node order of
  :mod:`~bnsgcn.partition.order`), by global id without one;
* boundary nodes ``B_k = {u : (u -> v) in E, v in I_k, a[u] != k}``, grouped by owner
  ascending, then in the same order (an owner's boundary nodes in the order of its own
  inner nodes);
* the in-edges of its inner nodes plus one self-loop per inner node, as CSR over local
  columns ``[0, |I_k|)`` = inner, ``[|I_k|, |I_k| + |B_k|)`` = boundary, with ascending
  columns in every row;
* ``degree[c] = deg_in(c) + 1`` (full graph, self-loop included) for every local column;
* send lists: for each other partition ``q``, the local inner indices of ``B_q ∩ I_k``
  in the order they appear in ``B_q``, so the rows a rank sends line up with the rows its
  peer expects.

The graph itself carries no self-loops (:class:`~bnsgcn.partition.graph.Graph`); adding exactly
one per node here is the project's one self-loop convention.

Memory is ``O(N + E_k)`` on top of the graph (``E_k``: in-edges of partition ``k``), one
partition at a time: a few ``N``-sized index arrays shared by all partitions, and per
partition only its own arrays (``E_k + n_k`` int32 adjacency entries, its features); no
``N x K`` or ``E x K`` arrays, no copy of the CSR. The graph's CSR is only read, row by
row (numba), so it may be memory-mapped. Everything is written to a new temporary
sibling directory ``<out>.tmp-<host>-<pid>-<random>`` and renamed into place at the end,
so an interrupted run leaves nothing that looks like a valid set; one killed outright
leaves its temporary directory, which the next run on the same machine for the same
``<out>`` deletes. The set's id (:func:`bnsgcn.data.format.set_id`) is known once every
array is written: it goes into each partition's ``partition.json``, then the manifest.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
from collections.abc import Iterable, Sequence
from pathlib import Path

import numba
import numpy as np

import bnsgcn
from bnsgcn.data.format import (
    MANIFEST_NAME,
    PART_ARRAYS,
    PART_META_NAME,
    part_dir_name,
    read_manifest,
    set_id,
    write_array,
    write_manifest,
    write_part_meta,
)
from bnsgcn.errors import UserError
from bnsgcn.metrics.progress import Progress

from .graph import Graph

REPORT_COLUMNS = ("part", "inner", "boundary", "ratio", "local_edges", "cut_edges", "train")


def input_entries(files: Iterable[Path]) -> list[dict]:
    """The manifest's ``dataset.inputs``: each input file's resolved path, size and mtime."""
    entries = []
    for path in files:
        stat = Path(path).stat()
        entries.append({"path": str(Path(path).resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns})
    return entries


def dataset_entry(graph: Graph, spec: str, inputs: list[dict], num_classes_given: int | None = None) -> dict:
    """The manifest's ``dataset`` entry; ``inputs`` from :func:`input_entries`; ``num_classes_given``
    the class count the user set (``bnsgcn-partition --num-classes``), None when the labels gave it."""
    return {
        "name": graph.name,
        "spec": spec,
        "inputs": inputs,
        "num_nodes": graph.num_nodes,
        "num_edges": graph.num_edges,
        "num_features": int(graph.features.shape[1]),
        "num_classes": int(graph.num_classes),
        "num_classes_given": num_classes_given,
        "multilabel": bool(graph.multilabel),
        "symmetrized": bool(graph.symmetrized),
        "feature_preprocessing": graph.feature_preprocessing,
    }


def find_reusable(
    out_dir: Path,
    spec: str,
    parts: int,
    partitioner: dict,
    force: bool = False,
    *,
    inputs: Sequence[dict] = (),
    num_classes_given: int | None = None,
) -> dict | None:
    """Return the manifest of a valid set at ``out_dir`` made by the same request, else ``None``.

    The request is the dataset spec, its input files (``inputs`` from :func:`input_entries`:
    path, size and modification time each), ``parts``, the normalised ``partitioner``
    entry (method, objective, seed, assignment file checksum) and the class count given
    (``--num-classes``, None without). Valid means a manifest that passes
    :func:`~bnsgcn.data.format.read_manifest` and every listed file present with its listed
    size, and each partition's ``partition.json`` where the set has an id (checksums are
    left to ``bnsgcn-train --verify``). A *different* or broken set at ``out_dir`` raises
    :class:`UserError` unless ``force``; a path that is not a partition set at all is never
    overwritten, not even with ``force``.
    """
    out_dir = Path(out_dir)
    if not out_dir.exists() or (out_dir.is_dir() and not any(out_dir.iterdir())):
        return None
    if not (out_dir / MANIFEST_NAME).is_file():
        raise UserError(f"{out_dir} exists and is not a partition set; choose another --out")
    if force:
        return None
    try:
        manifest = read_manifest(out_dir)
        same = (
            manifest["dataset"]["spec"] == spec
            and manifest["parts"] == parts
            and _request(manifest["partitioner"]) == _request(partitioner)
            and manifest["dataset"].get("num_classes_given") == num_classes_given
        )
        # Sets written before input files were recorded have no "inputs": as if made from none.
        same_inputs = manifest["dataset"].get("inputs", []) == list(inputs)
        complete = (
            all(
                (out_dir / entry["dir"] / f"{name}.npy").is_file()
                and (out_dir / entry["dir"] / f"{name}.npy").stat().st_size == meta["bytes"]
                for entry in manifest["partitions"]
                for name, meta in entry["files"].items()
            )
            and len(manifest["partitions"]) == parts
            and (
                "set_id" not in manifest
                or all((out_dir / e["dir"] / PART_META_NAME).is_file() for e in manifest["partitions"])
            )
        )
    except (UserError, KeyError, TypeError):
        same = same_inputs = complete = False
    if not same:
        raise UserError(
            f"{out_dir} holds a different partition set; pass --force to replace it or choose another --out"
        )
    if not same_inputs:
        raise UserError(
            f"{out_dir} was made from other or since changed input files (another --data-dir, or files "
            "replaced or edited); pass --force to re-partition or choose another --out"
        )
    if not complete:
        raise UserError(f"{out_dir} holds an incomplete partition set; pass --force to rewrite it")
    return manifest


def _request(partitioner: dict) -> dict:
    """The ``partitioner`` entry without what the run found (``resolved``: what ``--method auto``
    chose; ``blocks_by``: how each partition's blocks were found), for comparing requests. Sets
    written before node orders existed keep ascending ids: ``node_order`` "ids"."""
    return {"node_order": "ids"} | {
        key: value for key, value in partitioner.items() if key not in ("resolved", "blocks_by")
    }


WRITER_BYTES_PER_NODE = 64  # owner order and its sort keys, local index, boundary column, degree, flags, assignment


def part_sizes(graph: Graph, assignment: np.ndarray, parts: int) -> tuple[np.ndarray, np.ndarray]:
    """Each partition's inner nodes and their in-edges (float64 [K] each), for memory estimates."""
    return (
        np.bincount(assignment, minlength=parts).astype(np.float64),
        np.bincount(assignment, weights=graph.in_degree(), minlength=parts),
    )


def writer_bytes(graph: Graph, assignment: np.ndarray, parts: int) -> int:
    """Estimated peak memory of :func:`write_partition_set` beyond the graph: the ``N``-sized
    arrays plus the largest partition's adjacency (int32 entries, int64 row pointer), features
    and node data."""
    sizes, in_edges = part_sizes(graph, assignment, parts)
    row_bytes = (
        4 * graph.features.shape[1] + 8 + 8 + 3 + graph.labels.itemsize * (graph.labels.size // max(1, graph.num_nodes))
    )
    per_part = 4 * (in_edges + sizes) + row_bytes * sizes
    return int(WRITER_BYTES_PER_NODE * graph.num_nodes + per_part.max())


def remove_stale_temporaries(out_dir: Path) -> None:
    """Delete ``<out>.tmp-<host>-<pid>[-<random>]`` directories left by killed runs on this
    machine (pid no longer running, or ours). Other machines' are kept: on a shared file
    system their pids say nothing here."""
    out_dir = Path(out_dir)
    if not out_dir.parent.is_dir():
        return
    pattern = re.compile(
        re.escape(out_dir.name) + r"\.tmp-" + re.escape(socket.gethostname()) + r"-(\d+)(?:-[0-9a-f]+)?"
    )
    for candidate in out_dir.parent.iterdir():
        match = pattern.fullmatch(candidate.name)
        if match and candidate.is_dir() and not candidate.is_symlink() and not _running_elsewhere(int(match[1])):
            shutil.rmtree(candidate, ignore_errors=True)


def _running_elsewhere(pid: int) -> bool:
    """Whether ``pid`` is a running process other than this one."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def probe_writable(out_dir: Path) -> None:
    """Create and remove a temporary directory of ``out_dir`` (and missing parents); OSError if that fails.

    Asking the file system is the only reliable test: permission bits do not stop root, yet
    /proc, sysfs and the like refuse new directories even to root.
    """
    for directory in reversed(_make_temporary_dir(out_dir)):
        _remove_if_empty(directory)


def _make_temporary_dir(out_dir: Path) -> list[Path]:
    """Create a new ``<out>.tmp-<host>-<pid>-<random>`` and the missing parents of ``out_dir``;
    return the directories created, outermost first, the temporary one last.

    The random part makes the name unpredictable, and ``mkdir`` creates it or fails: the
    set is never written into a directory, or through a symbolic link, planted there.
    """
    created = _make_dirs(out_dir.parent)
    tmp_dir = out_dir.parent / f"{out_dir.name}.tmp-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        tmp_dir.mkdir()
    except BaseException:
        for directory in reversed(created):
            _remove_if_empty(directory)
        raise
    return [*created, tmp_dir]


def write_partition_set(
    graph: Graph,
    assignment: np.ndarray,
    out_dir: Path,
    *,
    parts: int,
    method_info: dict,
    dataset_spec: str | None = None,
    inputs: Sequence[dict] = (),
    force: bool = False,
    progress: bool = True,
    position: np.ndarray | None = None,
    num_classes_given: int | None = None,
) -> dict:
    """Write the partition set of ``assignment`` (int64 [N], values in ``[0, parts)``).

    ``position`` (int64 [N], :func:`bnsgcn.partition.order.block_positions`) orders the nodes
    within each partition; ``None`` keeps ascending global ids.

    ``method_info`` is the manifest's ``partitioner`` entry
    (:func:`bnsgcn.partition.partitioner.method_info`); ``dataset_spec`` (default ``graph.name``)
    and ``inputs`` (:func:`input_entries` of the files the graph was read from) identify
    the dataset for reuse, with ``num_classes_given`` (``--num-classes``: the class count
    of ``graph`` was set by the user). An existing set made by the same request is reused
    unless ``force``; see :func:`find_reusable`. Returns the manifest.

    A file that cannot be written raises ``OSError`` naming it as it would be in the set.
    """
    out_dir = Path(out_dir)
    spec = graph.name if dataset_spec is None else dataset_spec
    inputs = list(inputs)
    existing = find_reusable(
        out_dir, spec, parts, method_info, force, inputs=inputs, num_classes_given=num_classes_given
    )
    if existing is not None:
        return existing
    assignment = np.asarray(assignment, dtype=np.int64)
    if assignment.shape != (graph.num_nodes,) or (
        assignment.size and (assignment.min() < 0 or assignment.max() >= parts)
    ):
        raise ValueError(f"assignment must be int64 [{graph.num_nodes}] with values in [0, {parts})")

    remove_stale_temporaries(out_dir)
    created = _make_temporary_dir(out_dir)
    tmp_dir = created[-1]
    try:
        partitions = _write_partitions(graph, assignment, parts, tmp_dir, progress, position)
        if graph.feature_stats is not None:  # what the features' preprocessing needs again (docs/partition-format.md)
            np.savez(tmp_dir / graph.feature_preprocessing["file"], **graph.feature_stats)
        manifest = {
            "dataset": dataset_entry(graph, spec, inputs, num_classes_given),
            "parts": parts,
            "partitioner": method_info,
            "self_loops": "one per node, added",
            "partitions": partitions,
            "report": build_report(partitions),
            "created_by": {"tool": "bnsgcn-partition", "version": bnsgcn.__version__},
        }
        identity = set_id(manifest)
        for k, entry in enumerate(partitions):
            write_part_meta(tmp_dir / entry["dir"], identity, k, parts)
        write_manifest(tmp_dir, {"set_id": identity, **manifest})
        _move_into_place(tmp_dir, out_dir)
    except BaseException as exc:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        for directory in reversed(created[:-1]):  # parents this call created, innermost first
            _remove_if_empty(directory)
        if isinstance(exc, OSError) and exc.filename and Path(exc.filename).is_relative_to(tmp_dir):
            # name the file of the set, not of the temporary directory just removed
            raise OSError(exc.errno, exc.strerror, str(out_dir / Path(exc.filename).relative_to(tmp_dir))) from exc
        raise
    return read_manifest(out_dir)


def _make_dirs(path: Path) -> list[Path]:
    """``mkdir -p path``; return the directories created, outermost first."""
    missing = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    missing.reverse()
    created = []
    try:
        for directory in missing:
            directory.mkdir()
            created.append(directory)
    except BaseException:
        for directory in reversed(created):
            _remove_if_empty(directory)
        raise
    return created


def _remove_if_empty(directory: Path) -> None:
    try:
        directory.rmdir()
    except OSError:
        pass


def _move_into_place(tmp_dir: Path, out_dir: Path) -> None:
    """Rename ``tmp_dir`` to ``out_dir``; an old set there is moved aside, then deleted."""
    if not out_dir.exists():
        os.replace(tmp_dir, out_dir)
        return
    old = out_dir.parent / f"{out_dir.name}.old-{os.getpid()}"
    os.replace(out_dir, old)
    os.replace(tmp_dir, out_dir)
    shutil.rmtree(old)


@numba.njit(cache=True, nogil=True)
def _mark_boundary(indptr, indices, inner, assignment, k, is_boundary):  # pragma: no cover - numba
    """Flag the in-neighbours of ``inner`` owned elsewhere in ``is_boundary``; return the cut
    edges (in-edges from them), or -1 when some node lists itself (a self-loop)."""
    cut = 0
    for i in range(inner.shape[0]):
        v = inner[i]
        for e in range(indptr[v], indptr[v + 1]):
            u = indices[e]
            if u == v:
                return -1
            if assignment[u] != k:
                is_boundary[u] = True
                cut += 1
    return cut


@numba.njit(cache=True, nogil=True)
def _local_adjacency(
    indptr, indices, inner, assignment, k, local_index, boundary_column, adj_indptr, adj_indices
):  # pragma: no cover - numba
    """Fill the local CSR of ``inner``: row ``i`` holds the local columns of node ``inner[i]``'s
    in-neighbours plus its self-loop ``i``, ascending (inner columns, then boundary ones)."""
    max_degree = 0
    for i in range(inner.shape[0]):
        max_degree = max(max_degree, indptr[inner[i] + 1] - indptr[inner[i]])
    local = np.empty(max_degree + 1, dtype=np.int64)
    remote = np.empty(max_degree, dtype=np.int64)
    pos = 0
    for i in range(inner.shape[0]):
        v = inner[i]
        n_local, n_remote = 1, 0
        local[0] = i
        for e in range(indptr[v], indptr[v + 1]):
            u = indices[e]
            if assignment[u] == k:
                local[n_local] = local_index[u]
                n_local += 1
            else:
                remote[n_remote] = boundary_column[u]
                n_remote += 1
        # Rows are short: sorting each is cheaper than one sort of the partition's entries.
        adj_indices[pos : pos + n_local] = np.sort(local[:n_local])
        pos += n_local
        adj_indices[pos : pos + n_remote] = np.sort(remote[:n_remote])
        pos += n_remote
        adj_indptr[i + 1] = pos


def _by_owner(nodes: np.ndarray | None, assignment: np.ndarray, position: np.ndarray | None) -> np.ndarray:
    """``nodes`` (ascending global ids; None: every node) grouped by owner, each group by
    ``position`` (None: by id)."""
    owner = assignment if nodes is None else assignment[nodes]
    if position is None:  # a stable sort keeps global ids ascending within each owner
        order = np.argsort(owner, kind="stable")
    else:
        order = np.lexsort((position if nodes is None else position[nodes], owner))
    return order if nodes is None else nodes[order]


def inner_order(
    assignment: np.ndarray, parts: int, position: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every partition's inner nodes in order: ``(by_owner, starts, local_index)``, where
    ``by_owner[starts[k]:starts[k + 1]]`` are partition ``k``'s inner nodes and ``local_index[v]``
    is node ``v``'s place among its partition's (int64 [N], [K + 1], [N])."""
    num_nodes = assignment.shape[0]
    starts = np.concatenate([[0], np.cumsum(np.bincount(assignment, minlength=parts))])
    by_owner = _by_owner(None, assignment, position)
    local_index = np.empty(num_nodes, dtype=np.int64)
    local_index[by_owner] = np.arange(num_nodes, dtype=np.int64) - starts[assignment[by_owner]]
    return by_owner, starts, local_index


def _write_partitions(
    graph: Graph, assignment: np.ndarray, parts: int, out_dir: Path, progress: bool, position: np.ndarray | None
) -> list[dict]:
    """Write every partition's arrays under ``out_dir``; return the manifest's ``partitions``."""
    num_nodes = graph.num_nodes
    by_owner, part_starts, local_index = inner_order(assignment, parts, position)
    degree = (graph.in_degree() + 1).astype(np.float32)
    # Scratch arrays reused by every partition: O(N) memory once instead of per partition.
    is_boundary = np.zeros(num_nodes, dtype=bool)
    boundary_column = np.empty(num_nodes, dtype=np.int64)  # local column of the current boundary

    entries: list[dict] = []
    boundaries: list[tuple[np.ndarray, np.ndarray]] = []
    with Progress(parts, "writing partitions", enabled=progress) as bar:
        for k in range(parts):
            inner = by_owner[part_starts[k] : part_starts[k + 1]]
            n_inner = inner.shape[0]
            cut_edges = _mark_boundary(graph.indptr, graph.indices, inner, assignment, k, is_boundary)
            if cut_edges < 0:
                raise ValueError("the graph has self-loops; build it with bnsgcn.partition.graph.canonical_csr")
            # Distinct remote sources via the flag array: np.unique (hash-based in numpy >= 2.3)
            # is many times slower on arrays of this size.
            boundary = np.flatnonzero(is_boundary)
            is_boundary[boundary] = False
            boundary = _by_owner(boundary, assignment, position)
            boundary_offsets = np.concatenate([[0], np.cumsum(np.bincount(assignment[boundary], minlength=parts))])
            n_local = n_inner + boundary.shape[0]
            if n_local >= 2**31:
                raise UserError(
                    f"partition {k} has {n_local} local nodes, over the int32 column limit; pass more --parts"
                )
            boundary_column[boundary] = n_inner + np.arange(boundary.shape[0], dtype=np.int64)
            in_edges = int((graph.indptr[inner + 1] - graph.indptr[inner]).sum())
            adj_indptr = np.zeros(n_inner + 1, dtype=np.int64)
            adj_indices = np.empty(in_edges + n_inner, dtype=np.int32)
            _local_adjacency(
                graph.indptr, graph.indices, inner, assignment, k, local_index, boundary_column, adj_indptr, adj_indices
            )

            part_dir = out_dir / part_dir_name(k)
            part_dir.mkdir()
            arrays = {
                "inner_nodes": inner,
                "boundary_nodes": boundary,
                "boundary_offsets": boundary_offsets.astype(np.int64),
                "adj_indptr": adj_indptr,
                "adj_indices": adj_indices,
                "degree": np.concatenate([degree[inner], degree[boundary]]),
                "features": np.asarray(graph.features[inner], dtype=np.float32),
                "labels": graph.labels[inner],
                "train_mask": np.asarray(graph.train_mask[inner], dtype=bool),
                "val_mask": np.asarray(graph.val_mask[inner], dtype=bool),
                "test_mask": np.asarray(graph.test_mask[inner], dtype=bool),
            }
            files = {name: write_array(part_dir, name, array) for name, array in arrays.items()}
            entries.append(
                {
                    "dir": part_dir_name(k),
                    "files": files,
                    "n_inner": int(n_inner),
                    "n_boundary": int(boundary.shape[0]),
                    "boundary_counts": np.diff(boundary_offsets).tolist(),
                    "local_edges": in_edges - cut_edges,
                    "cut_edges": cut_edges,
                    "train_nodes": int(arrays["train_mask"].sum()),
                }
            )
            boundaries.append((boundary, boundary_offsets))
            del arrays
            bar.update()

    # Send lists need every partition's boundary, hence a second (cheap) pass.
    for k, entry in enumerate(entries):
        requested = [
            local_index[boundary[offsets[k] : offsets[k + 1]]] if q != k else np.empty(0, dtype=np.int64)
            for q, (boundary, offsets) in enumerate(boundaries)
        ]
        send_offsets = np.concatenate([[0], np.cumsum([r.shape[0] for r in requested])]).astype(np.int64)
        part_dir = out_dir / entry["dir"]
        entry["files"]["send_offsets"] = write_array(part_dir, "send_offsets", send_offsets)
        entry["files"]["send_nodes"] = write_array(part_dir, "send_nodes", np.concatenate(requested).astype(np.int64))
        entry["files"] = {name: entry["files"][name] for name in PART_ARRAYS}  # manifest in format order
    return entries


def build_report(partitions: list[dict]) -> dict:
    """Per-partition rows and totals; ``ratio`` = boundary / inner nodes (0 for an empty part)."""
    rows, ratios = [], []
    for k, entry in enumerate(partitions):
        ratio = entry["n_boundary"] / entry["n_inner"] if entry["n_inner"] else 0.0
        ratios.append(ratio)
        rows.append(
            {
                "part": k,
                "inner": entry["n_inner"],
                "boundary": entry["n_boundary"],
                "ratio": round(ratio, 4),
                "local_edges": entry["local_edges"],
                "cut_edges": entry["cut_edges"],
                "train": entry["train_nodes"],
            }
        )
    totals = {
        name: sum(row[name] for row in rows) for name in ("inner", "boundary", "local_edges", "cut_edges", "train")
    }
    totals["ratio_max"] = round(max(ratios), 4)
    totals["ratio_mean"] = round(sum(ratios) / len(ratios), 4)
    return {"rows": rows, "totals": totals}


def format_report(report: dict) -> str:
    """The report as a fixed-width text table (one row per partition, then totals)."""
    header = ["part", "inner", "boundary", "bnd/inner", "local edges", "cut edges", "train"]
    lines = [
        [
            str(r["part"]),
            f"{r['inner']:,}",
            f"{r['boundary']:,}",
            f"{r['ratio']:.3f}",
            f"{r['local_edges']:,}",
            f"{r['cut_edges']:,}",
            f"{r['train']:,}",
        ]
        for r in report["rows"]
    ]
    t = report["totals"]
    lines.append(
        [
            "total",
            f"{t['inner']:,}",
            f"{t['boundary']:,}",
            f"max {t['ratio_max']:.3f}",
            f"{t['local_edges']:,}",
            f"{t['cut_edges']:,}",
            f"{t['train']:,}",
        ]
    )
    lines.append(["", "", "", f"mean {t['ratio_mean']:.3f}", "", "", ""])
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
    text = [" ".join(cell.rjust(width) for cell, width in zip(row, widths)).rstrip() for row in [header, *lines]]
    text.insert(1, " ".join("-" * width for width in widths))
    text.insert(len(text) - 2, " ".join("-" * width for width in widths))
    return "\n".join(text)
