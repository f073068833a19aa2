"""Write a partition set: per-partition arrays, send lists, manifest and report.

For an assignment ``a`` (``a[v]`` = owner of node ``v``) partition ``k`` holds

* inner nodes ``I_k = {v : a[v] = k}``, ascending;
* boundary nodes ``B_k = {u : (u -> v) in E, v in I_k, a[u] != k}``, grouped by owner
  ascending, then by global id;
* the in-edges of its inner nodes plus one self-loop per inner node, as CSR over local
  columns ``[0, |I_k|)`` = inner, ``[|I_k|, |I_k| + |B_k|)`` = boundary, with ascending
  columns in every row;
* ``degree[c] = deg_in(c) + 1`` (full graph, self-loop included) for every local column;
* send lists: for each other partition ``q``, the local inner indices of ``B_q ∩ I_k``
  in the order they appear in ``B_q``, so the rows a rank sends line up with the rows its
  peer expects.

The graph itself carries no self-loops (:class:`~bnsgcn.partition.graph.Graph`); adding exactly
one per node here is the project's one self-loop convention.

Memory is ``O(N + E_k)`` per partition on top of the graph (``E_k``: in-edges of partition
``k``): no ``N x K`` or ``E x K`` arrays are ever built. Everything is written to a
temporary sibling directory ``<out>.tmp-<host>-<pid>`` and renamed into place at the end,
so an interrupted run leaves nothing that looks like a valid set; one killed outright
leaves its temporary directory, which the next run on the same machine for the same
``<out>`` deletes.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

import bnsgcn
from bnsgcn.errors import UserError
from bnsgcn.format import MANIFEST_NAME, PART_ARRAYS, part_dir_name, read_manifest, write_array, write_manifest
from bnsgcn.progress import Progress

from .graph import Graph

REPORT_COLUMNS = ("part", "inner", "boundary", "ratio", "local_edges", "cut_edges", "train")


def input_entries(files: Iterable[Path]) -> list[dict]:
    """The manifest's ``dataset.inputs``: each input file's resolved path, size and mtime."""
    entries = []
    for path in files:
        stat = Path(path).stat()
        entries.append({"path": str(Path(path).resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns})
    return entries


def dataset_entry(graph: Graph, spec: str, inputs: list[dict]) -> dict:
    """The manifest's ``dataset`` entry; ``inputs`` from :func:`input_entries`."""
    return {
        "name": graph.name,
        "spec": spec,
        "inputs": inputs,
        "num_nodes": graph.num_nodes,
        "num_edges": graph.num_edges,
        "num_features": int(graph.features.shape[1]),
        "num_classes": int(graph.num_classes),
        "multilabel": bool(graph.multilabel),
        "symmetrized": bool(graph.symmetrized),
    }


def find_reusable(out_dir: Path, spec: str, parts: int, partitioner: dict, force: bool = False, *,
                  inputs: Sequence[dict] = ()) -> dict | None:
    """Return the manifest of a valid set at ``out_dir`` made by the same request, else ``None``.

    The request is the dataset spec, its input files (``inputs`` from :func:`input_entries`:
    path, size and modification time each), ``parts`` and the normalised ``partitioner``
    entry (method, objective, seed, assignment file checksum). Valid means a readable
    manifest and every listed file present with its listed size (checksums are left to
    ``bnsgcn-train --verify``). A *different* or broken set at ``out_dir`` raises
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
            and manifest["partitioner"] == partitioner
        )
        # Sets written before input files were recorded have no "inputs": as if made from none.
        same_inputs = manifest["dataset"].get("inputs", []) == list(inputs)
        complete = all(
            (out_dir / entry["dir"] / f"{name}.npy").is_file()
            and (out_dir / entry["dir"] / f"{name}.npy").stat().st_size == meta["bytes"]
            for entry in manifest["partitions"]
            for name, meta in entry["files"].items()
        ) and len(manifest["partitions"]) == parts
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


def remove_stale_temporaries(out_dir: Path) -> None:
    """Delete ``<out>.tmp-<host>-<pid>`` directories left by killed runs on this machine
    (pid no longer running, or ours). Other machines' are kept: on a shared file system
    their pids say nothing here."""
    out_dir = Path(out_dir)
    if not out_dir.parent.is_dir():
        return
    pattern = re.compile(re.escape(out_dir.name) + r"\.tmp-" + re.escape(socket.gethostname()) + r"-(\d+)")
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
    """Create and remove the temporary directory of ``out_dir`` (and missing parents); OSError if that fails.

    Asking the file system is the only reliable test: permission bits do not stop root, yet
    /proc, sysfs and the like refuse new directories even to root.
    """
    tmp_dir = _temporary_dir(out_dir)
    created = _make_dirs(tmp_dir)
    for directory in reversed(created):
        _remove_if_empty(directory)


def _temporary_dir(out_dir: Path) -> Path:
    return out_dir.parent / f"{out_dir.name}.tmp-{socket.gethostname()}-{os.getpid()}"


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
) -> dict:
    """Write the partition set of ``assignment`` (int64 [N], values in ``[0, parts)``).

    ``method_info`` is the manifest's ``partitioner`` entry
    (:func:`bnsgcn.partition.partitioner.method_info`); ``dataset_spec`` (default ``graph.name``)
    and ``inputs`` (:func:`input_entries` of the files the graph was read from) identify
    the dataset for reuse. An existing set made by the same request is reused unless
    ``force``; see :func:`find_reusable`. Returns the manifest.
    """
    out_dir = Path(out_dir)
    spec = graph.name if dataset_spec is None else dataset_spec
    inputs = list(inputs)
    existing = find_reusable(out_dir, spec, parts, method_info, force, inputs=inputs)
    if existing is not None:
        return existing
    assignment = np.asarray(assignment, dtype=np.int64)
    if assignment.shape != (graph.num_nodes,) or (assignment.size and (assignment.min() < 0 or assignment.max() >= parts)):
        raise ValueError(f"assignment must be int64 [{graph.num_nodes}] with values in [0, {parts})")

    remove_stale_temporaries(out_dir)
    tmp_dir = _temporary_dir(out_dir)
    created = _make_dirs(tmp_dir)
    try:
        partitions = _write_partitions(graph, assignment, parts, tmp_dir, progress)
        report = build_report(partitions)
        manifest = {
            "dataset": dataset_entry(graph, spec, inputs),
            "parts": parts,
            "partitioner": method_info,
            "self_loops": "one per node, added",
            "partitions": partitions,
            "report": report,
            "created_by": {"tool": "bnsgcn-partition", "version": bnsgcn.__version__},
        }
        write_manifest(tmp_dir, manifest)
        _move_into_place(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        for directory in reversed(created[:-1]):  # parents this call created, innermost first
            _remove_if_empty(directory)
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


def _gather_rows(indptr: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Edge ids of the CSR rows ``rows`` (concatenated, in row order) and each row's length."""
    starts = indptr[rows]
    lengths = indptr[rows + 1] - starts
    ends = np.cumsum(lengths)
    edge_ids = np.arange(ends[-1] if ends.size else 0, dtype=np.int64)
    edge_ids += np.repeat(starts - (ends - lengths), lengths)
    return edge_ids, lengths


def _write_partitions(graph: Graph, assignment: np.ndarray, parts: int, out_dir: Path, progress: bool) -> list[dict]:
    """Write every partition's arrays under ``out_dir``; return the manifest's ``partitions``."""
    num_nodes = graph.num_nodes
    sizes = np.bincount(assignment, minlength=parts)
    part_starts = np.concatenate([[0], np.cumsum(sizes)])
    # Nodes sorted by owner; a stable sort keeps global ids ascending within each partition.
    by_owner = np.argsort(assignment, kind="stable")
    local_index = np.empty(num_nodes, dtype=np.int64)  # position of a node among its partition's inner nodes
    local_index[by_owner] = np.arange(num_nodes, dtype=np.int64) - part_starts[assignment[by_owner]]
    degree = (graph.in_degree() + 1).astype(np.float32)
    # Scratch arrays reused by every partition: O(N) memory once instead of per partition.
    is_boundary = np.zeros(num_nodes, dtype=bool)
    boundary_column = np.empty(num_nodes, dtype=np.int64)  # local column of the current boundary

    entries: list[dict] = []
    boundaries: list[tuple[np.ndarray, np.ndarray]] = []
    with Progress(parts, "writing partitions", enabled=progress) as bar:
        for k in range(parts):
            inner = by_owner[part_starts[k]:part_starts[k + 1]]
            n_inner = inner.shape[0]
            edge_ids, lengths = _gather_rows(graph.indptr, inner)
            src = graph.indices[edge_ids].astype(np.int64)
            del edge_ids
            rows = np.repeat(np.arange(n_inner, dtype=np.int64), lengths)
            if np.any(src == inner[rows]):
                raise ValueError("the graph has self-loops; build it with bnsgcn.partition.graph.canonical_csr")
            owner = assignment[src]
            remote = owner != k
            # Distinct remote sources via a flag array: np.unique (hash-based in numpy >= 2.3)
            # is many times slower on arrays of this size.
            is_boundary[src[remote]] = True
            boundary = np.flatnonzero(is_boundary)
            is_boundary[boundary] = False
            boundary = boundary[np.argsort(assignment[boundary], kind="stable")]
            boundary_offsets = np.concatenate([[0], np.cumsum(np.bincount(assignment[boundary], minlength=parts))])
            n_local = n_inner + boundary.shape[0]
            if n_local >= 2**31:
                raise UserError(f"partition {k} has {n_local} local nodes, over the int32 column limit; pass more --parts")
            boundary_column[boundary] = n_inner + np.arange(boundary.shape[0], dtype=np.int64)
            columns = np.where(remote, boundary_column[src], local_index[src])
            cut_edges = int(remote.sum())
            del src, owner, remote
            # One key per entry, row-major; the self-loop of row i is column i.
            keys = np.concatenate([rows * n_local + columns, np.arange(n_inner, dtype=np.int64) * (n_local + 1)])
            del rows, columns
            keys.sort()
            adj_indices = (keys % n_local).astype(np.int32) if n_local else keys.astype(np.int32)
            del keys
            adj_indptr = np.concatenate([[0], np.cumsum(lengths + 1)]).astype(np.int64)

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
            entries.append({
                "dir": part_dir_name(k),
                "files": files,
                "n_inner": int(n_inner),
                "n_boundary": int(boundary.shape[0]),
                "local_edges": int(lengths.sum()) - cut_edges,
                "cut_edges": cut_edges,
                "train_nodes": int(arrays["train_mask"].sum()),
            })
            boundaries.append((boundary, boundary_offsets))
            del arrays
            bar.update()

    # Send lists need every partition's boundary, hence a second (cheap) pass.
    for k, entry in enumerate(entries):
        requested = [
            local_index[boundary[offsets[k]:offsets[k + 1]]] if q != k else np.empty(0, dtype=np.int64)
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
        rows.append({
            "part": k,
            "inner": entry["n_inner"],
            "boundary": entry["n_boundary"],
            "ratio": round(ratio, 4),
            "local_edges": entry["local_edges"],
            "cut_edges": entry["cut_edges"],
            "train": entry["train_nodes"],
        })
    totals = {name: sum(row[name] for row in rows) for name in ("inner", "boundary", "local_edges", "cut_edges", "train")}
    totals["ratio_max"] = round(max(ratios), 4)
    totals["ratio_mean"] = round(sum(ratios) / len(ratios), 4)
    return {"rows": rows, "totals": totals}


def format_report(report: dict) -> str:
    """The report as a fixed-width text table (one row per partition, then totals)."""
    header = ["part", "inner", "boundary", "bnd/inner", "local edges", "cut edges", "train"]
    lines = [[str(r["part"]), f"{r['inner']:,}", f"{r['boundary']:,}", f"{r['ratio']:.3f}",
              f"{r['local_edges']:,}", f"{r['cut_edges']:,}", f"{r['train']:,}"] for r in report["rows"]]
    t = report["totals"]
    lines.append(["total", f"{t['inner']:,}", f"{t['boundary']:,}", f"max {t['ratio_max']:.3f}",
                  f"{t['local_edges']:,}", f"{t['cut_edges']:,}", f"{t['train']:,}"])
    lines.append(["", "", "", f"mean {t['ratio_mean']:.3f}", "", "", ""])
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
    text = [" ".join(cell.rjust(width) for cell, width in zip(row, widths)).rstrip() for row in [header, *lines]]
    text.insert(1, " ".join("-" * width for width in widths))
    text.insert(len(text) - 2, " ".join("-" * width for width in widths))
    return "\n".join(text)
