"""The partition file format, defined once.

A partition set is a directory::

    manifest.json          format, version, dataset, parts, counts, per-file checksums, report
    part-0/*.npy           one directory per partition, plain .npy arrays (memory-mappable)
    part-1/*.npy
    ...

Every array of a partition is listed in :data:`PART_ARRAYS`; ``docs/partition-format.md``
describes them for users. The offline step (``partition/``) writes sets with
:func:`write_array` and :func:`write_manifest`; training ranks read one partition with
:func:`load_partition`. Local column numbering of a partition: ``[0, n_inner)`` are its
inner nodes in the order of ``inner_nodes``, ``[n_inner, n_inner + n_boundary)`` its
boundary nodes in the order of ``boundary_nodes`` (grouped by owner partition, ascending,
then in the owner's node order). The node order within a partition is ascending global id
or blocks of nodes that share neighbours (``partitioner.node_order`` in the manifest).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bnsgcn.errors import UserError

FORMAT_NAME = "bnsgcn-partition"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"

# name -> what it holds; shapes use n_inner, n_boundary, nnz, K (parts), F, C.
PART_ARRAYS: dict[str, str] = {
    "inner_nodes": "int64 [n_inner]: global ids of the inner nodes, in the partition's node order",
    "boundary_nodes": "int64 [n_boundary]: global ids of the boundary nodes, grouped by owner, then in the owner's "
    "node order",
    "boundary_offsets": "int64 [K+1]: boundary_nodes[o[q]:o[q+1]] are owned by partition q",
    "adj_indptr": "int64 [n_inner+1]: CSR row pointer of the inner nodes' in-edges (self-loop included)",
    "adj_indices": "int32 [nnz]: source of each in-edge in local column numbering",
    "degree": "float32 [n_inner+n_boundary]: full-graph in-degree (self-loop included) of each local column",
    "features": "float32 [n_inner, F]: input features of the inner nodes",
    "labels": "int64 [n_inner] (single-label) or uint8 [n_inner, C] (multi-label)",
    "train_mask": "bool [n_inner]",
    "val_mask": "bool [n_inner]",
    "test_mask": "bool [n_inner]",
    "send_offsets": "int64 [K+1]: send_nodes[o[q]:o[q+1]] are the inner nodes partition q may request",
    "send_nodes": "int64 [sum]: local inner indices, in the order of partition q's boundary_nodes from us",
}


def part_dir_name(part: int) -> str:
    return f"part-{part}"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


class _FileSink:
    """The bytes of a file being written: every byte goes to ``fd`` (short writes retried)
    and into a SHA-256. An ``OSError`` names ``path``, the file the bytes are meant for."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd, self.path = fd, path
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        view = memoryview(data).cast("B")
        self.digest.update(view)
        self.size += len(view)
        while view:
            try:
                written = os.write(self.fd, view)
            except OSError as exc:
                raise OSError(exc.errno, exc.strerror, str(self.path)) from None
            view = view[written:]
        return len(data)


@contextmanager
def _new_file(path: Path) -> Iterator[_FileSink]:
    """Write ``path`` through a file of a new, unpredictable name beside it, renamed over
    ``path`` when the block succeeds and removed when it fails.

    ``O_EXCL`` creates the temporary file or fails: it never opens an existing file or
    follows a symbolic link planted at its name; and the rename replaces a link at ``path``
    itself, never its target. Mode 0666 less the umask, as ``open`` would give.
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    try:
        try:
            yield _FileSink(fd, path)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename is None:  # close() or rename(): say which file
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise


def write_array(part_dir: Path, name: str, array: np.ndarray) -> dict:
    """Write one partition array as ``<name>.npy`` (the bytes ``numpy.save`` writes); return
    its manifest entry, the checksum taken as the bytes are written."""
    if name not in PART_ARRAYS:
        raise ValueError(f"{name!r} is not an array of the partition format")
    array = np.ascontiguousarray(array)
    with _new_file(Path(part_dir) / f"{name}.npy") as sink:
        np.lib.format.write_array(sink, array, allow_pickle=False)
    return {
        "bytes": sink.size,
        "sha256": sink.digest.hexdigest(),
        "dtype": str(array.dtype),
        "shape": list(array.shape),
    }


def _write_json(path: Path, body: dict) -> None:
    with _new_file(path) as sink:
        sink.write((json.dumps(body, indent=1, sort_keys=False) + "\n").encode())


def write_manifest(out_dir: Path, manifest: dict) -> None:
    """Write ``manifest.json`` (stamped with format name and version) atomically."""
    _write_json(Path(out_dir) / MANIFEST_NAME, {"format": FORMAT_NAME, "version": FORMAT_VERSION, **manifest})


def read_manifest(parts_dir: Path) -> dict:
    """Read and check the manifest of a partition set."""
    path = Path(parts_dir) / MANIFEST_NAME
    if not path.is_file():
        raise UserError(
            f"{path} not found: {parts_dir} is not a partition set; "
            "create one with bnsgcn-partition or pass the right --parts-dir"
        )
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is not valid JSON ({exc}); re-run bnsgcn-partition with --force") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise UserError(f"{path} is not a bnsgcn partition manifest; re-run bnsgcn-partition")
    version = manifest.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise UserError(
            f"{path} has format version {version}, newer than this bnsgcn reads "
            f"({FORMAT_VERSION}); upgrade bnsgcn or re-partition with this version"
        )
    if version < FORMAT_VERSION:
        raise UserError(
            f"{path} has old format version {version} (this bnsgcn reads {FORMAT_VERSION}); "
            "re-run bnsgcn-partition with --force"
        )
    return manifest


@dataclass(frozen=True)
class PartitionArrays:
    """One partition's arrays, memory-mapped, plus the manifest facts a rank needs."""

    part: int
    num_parts: int
    manifest: dict
    arrays: dict[str, np.ndarray]

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]


def load_partition(parts_dir: Path, part: int, verify: bool = False) -> PartitionArrays:
    """Load partition ``part`` of a set, memory-mapped.

    File sizes are always checked against the manifest; with ``verify`` the SHA-256 of
    every file is checked too. Any mismatch raises :class:`UserError` naming the file.
    """
    parts_dir = Path(parts_dir)
    manifest = read_manifest(parts_dir)
    num_parts = int(manifest["parts"])
    if not 0 <= part < num_parts:
        raise UserError(
            f"rank {part} has no partition: {parts_dir} has {num_parts} parts; start {num_parts} ranks, one per "
            "partition"
        )
    entry = manifest["partitions"][part]
    part_dir = parts_dir / entry["dir"]
    arrays: dict[str, np.ndarray] = {}
    for name in PART_ARRAYS:
        meta = entry["files"].get(name)
        path = part_dir / f"{name}.npy"
        if meta is None:
            raise UserError(
                f"{parts_dir / MANIFEST_NAME} lists no {name}.npy for {entry['dir']}; re-run bnsgcn-partition --force"
            )
        if not path.is_file():
            raise UserError(f"{path} is missing: the partition set is incomplete; re-run bnsgcn-partition --force")
        if path.stat().st_size != meta["bytes"]:
            raise UserError(
                f"{path} has {path.stat().st_size} bytes, the manifest says {meta['bytes']}: "
                "the file is truncated or corrupt; re-run bnsgcn-partition --force"
            )
        if verify and sha256_file(path) != meta["sha256"]:
            raise UserError(f"{path} fails its SHA-256 checksum: the file is corrupt; re-run bnsgcn-partition --force")
        try:
            # copy-on-write: the file is opened read-only and never written; the engine uses
            # arrays of the right dtype in place (bnsgcn.data.shard), as writable tensors
            array = np.load(path, mmap_mode="c", allow_pickle=False)
        except ValueError as exc:
            raise UserError(f"{path} is not a readable .npy array ({exc}); re-run bnsgcn-partition --force") from None
        if list(array.shape) != meta["shape"] or str(array.dtype) != meta["dtype"]:
            raise UserError(
                f"{path} holds {array.dtype}{list(array.shape)}, the manifest says "
                f"{meta['dtype']}{meta['shape']}; re-run bnsgcn-partition --force"
            )
        arrays[name] = array
    return PartitionArrays(part=part, num_parts=num_parts, manifest=manifest, arrays=arrays)


def set_id(manifest: dict) -> str:
    """A short identity of a partition set: the hash of its files' checksums, in order."""
    digest = hashlib.sha256()
    for entry in manifest["partitions"]:
        for name in PART_ARRAYS:
            digest.update(entry["files"][name]["sha256"].encode())
    return digest.hexdigest()[:16]
