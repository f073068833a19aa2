"""The partition file format, defined once.

A partition set is a directory::

    manifest.json          format, version, set id, dataset, parts, counts, per-file checksums, report
    part-0/partition.json  the set id and the partition's index in the set
    part-0/*.npy           one directory per partition, plain .npy arrays (memory-mappable)
    part-1/...

Every array of a partition is listed in :data:`PART_ARRAYS`; ``docs/partition-format.md``
describes them for users. The offline step (``partition/``) writes sets with
:func:`write_array`, :func:`write_part_meta` and :func:`write_manifest`; training ranks read
one partition with :func:`load_partition` and check its values with
:func:`check_partition_values`; the launcher reads a set with :func:`read_manifest`. Local
column numbering of a partition: ``[0, n_inner)`` are its inner nodes in the order of
``inner_nodes``, ``[n_inner, n_inner + n_boundary)`` its boundary nodes in the order of
``boundary_nodes`` (grouped by owner partition, ascending, then in the owner's node order).
The node order within a partition is ascending global id or blocks of nodes that share
neighbours (``partitioner.node_order`` in the manifest).

A set's id (:func:`set_id`) is a hash of its files' SHA-256s in partition order, recorded in
the manifest and in every ``partition.json``: a partition directory or manifest entry taken
from another set, or entries reordered, no longer match it. It is derived from the content
rather than drawn at random so that the same command on the same input still writes the
same bytes, and so that the id needs no bookkeeping of its own: it is the identity
checkpoints already record. Sets written before the id existed have no ``set_id``; they are
read without the checks that need it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np

from bnsgcn.errors import UserError
from bnsgcn.files import replaced

FORMAT_NAME = "bnsgcn-partition"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
PART_META_NAME = "partition.json"
REWRITE = "re-run bnsgcn-partition --force"

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


# dataset.feature_preprocessing: what the dataset's loader did to the features before they were
# written (docs/partition-format.md). "standardise" keeps its statistics in FEATURE_STATS_FILE
# at the set's top: float32 arrays "mean" and "std" [F], x' = (x - mean) / std.
NO_PREPROCESSING, ROW_NORMALISE, STANDARDISE = "none", "row_normalise", "standardise"
FEATURE_STATS_FILE = "feature_stats.npz"


def feature_preprocessing(manifest: dict) -> dict:
    """The set's ``dataset.feature_preprocessing`` entry; ``{"kind": "unknown"}`` for a set
    written before the entry existed."""
    return manifest["dataset"].get("feature_preprocessing") or {"kind": "unknown"}


def part_dir_name(part: int) -> str:
    return f"part-{part}"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


# --- writing ------------------------------------------------------------------------------


def write_array(part_dir: Path, name: str, array: np.ndarray) -> dict:
    """Write one partition array as ``<name>.npy`` (the bytes ``numpy.save`` writes); return
    its manifest entry, the checksum taken as the bytes are written."""
    if name not in PART_ARRAYS:
        raise ValueError(f"{name!r} is not an array of the partition format")
    array = np.ascontiguousarray(array)
    # a set is written into a temporary folder renamed whole at the end (partition/writer.py)
    with replaced(Path(part_dir) / f"{name}.npy", checksum=True, durable=False) as sink:
        np.lib.format.write_array(sink, array, allow_pickle=False)
    return {
        "bytes": sink.size,
        "sha256": sink.sha256.hexdigest(),
        "dtype": str(array.dtype),
        "shape": list(array.shape),
    }


def _write_json(path: Path, body: dict) -> None:
    with replaced(path, durable=False) as sink:
        sink.write((json.dumps(body, indent=1, sort_keys=False) + "\n").encode())


def write_manifest(out_dir: Path, manifest: dict) -> None:
    """Write ``manifest.json`` (stamped with format name and version) atomically."""
    _write_json(Path(out_dir) / MANIFEST_NAME, {"format": FORMAT_NAME, "version": FORMAT_VERSION, **manifest})


def write_part_meta(part_dir: Path, identity: str, part: int, parts: int) -> None:
    """Write the partition's ``partition.json``: the set's id and the partition's place in it."""
    body = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "set_id": identity, "part": part, "parts": parts}
    _write_json(Path(part_dir) / PART_META_NAME, body)


def set_id(manifest: dict) -> str:
    """A short identity of a partition set: the hash of its files' checksums, in partition order."""
    digest = hashlib.sha256()
    for entry in manifest["partitions"]:
        for name in PART_ARRAYS:
            digest.update(entry["files"][name]["sha256"].encode())
    return digest.hexdigest()[:16]


# --- reading the manifest -----------------------------------------------------------------


def _shown(value: object) -> str:
    if isinstance(value, list):
        return f"a list of {len(value)}"
    if isinstance(value, dict):
        return "an object"
    text = "missing or null" if value is None else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _malformed(path: Path, field: str, value: object, expected: str) -> UserError:
    return UserError(f"{path}: {field} is {_shown(value)}, expected {expected}; {REWRITE}")


def _is_count(value: object) -> bool:
    """A non-negative integer (JSON's true/false are not numbers here)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _count(path: Path, field: str, value: object, low: int = 0) -> int:
    if not _is_count(value) or value < low:
        raise _malformed(path, field, value, f"an integer >= {low}")
    return value


def read_manifest(parts_dir: Path, check_parts: bool = False) -> dict:
    """Read and check the manifest of a partition set.

    Every field the readers use is checked for its type, the counts for consistency (file
    shapes against ``n_inner``/``n_boundary``, per-owner boundary counts), the partition
    directories for lying inside the set, and the recorded set id against the checksums.
    With ``check_parts`` the ``partition.json`` of every partition present is checked too
    (:func:`check_part_meta`; the launcher's view of the whole set, a few small files).
    All of it is O(K) (O(K^2) integers for the boundary counts); problems raise
    :class:`UserError` naming the manifest and the field, or the partition's file.
    """
    parts_dir = Path(parts_dir)
    path = parts_dir / MANIFEST_NAME
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
    _check_manifest(parts_dir, path, manifest)
    if check_parts:  # first: a partition from another set is named as such, not as a manifest mismatch
        for part in range(manifest["parts"]):
            check_part_meta(parts_dir, manifest, part, required=False)
    if "set_id" in manifest and manifest["set_id"] != set_id(manifest):
        raise UserError(
            f"{path}: the partitions' checksums do not give the set id {_shown(manifest['set_id'])} it records "
            f"(an entry was edited, reordered or taken from another partition set); {REWRITE}"
        )
    return manifest


def _check_manifest(parts_dir: Path, path: Path, manifest: dict) -> None:
    parts = _count(path, "parts", manifest.get("parts"), low=1)
    partitions = manifest.get("partitions")
    if not isinstance(partitions, list) or len(partitions) != parts:
        raise _malformed(
            path, "partitions", partitions, f"a list of {parts} entries, one per partition (parts is {parts})"
        )
    dataset = manifest.get("dataset")
    if not isinstance(dataset, dict):
        raise _malformed(path, "dataset", dataset, "an object")
    if not isinstance(dataset.get("name"), str):
        raise _malformed(path, "dataset.name", dataset.get("name"), "a string")
    num_features = _count(path, "dataset.num_features", dataset.get("num_features"))
    num_classes = _count(path, "dataset.num_classes", dataset.get("num_classes"), low=1)
    _count(path, "dataset.num_nodes", dataset.get("num_nodes"))
    multilabel = dataset.get("multilabel", False)
    if not isinstance(multilabel, bool):
        raise _malformed(path, "dataset.multilabel", multilabel, "true or false")
    # Sets written before the set id existed have neither it nor the per-owner boundary counts.
    identified = "set_id" in manifest
    if identified and not isinstance(manifest["set_id"], str):
        raise _malformed(path, "set_id", manifest["set_id"], "a string")
    root = parts_dir.resolve()
    for k, entry in enumerate(partitions):
        where = f"partitions[{k}]"
        if not isinstance(entry, dict):
            raise _malformed(path, where, entry, "an object")
        _check_dir(parts_dir, root, path, f"{where}.dir", entry.get("dir"))
        n_inner = _count(path, f"{where}.n_inner", entry.get("n_inner"))
        n_boundary = _count(path, f"{where}.n_boundary", entry.get("n_boundary"))
        label_shape = [n_inner, num_classes] if multilabel else [n_inner]
        shapes = {
            "inner_nodes": [n_inner],
            "boundary_nodes": [n_boundary],
            "boundary_offsets": [parts + 1],
            "adj_indptr": [n_inner + 1],
            "degree": [n_inner + n_boundary],
            "features": [n_inner, num_features],
            "labels": label_shape,
            "train_mask": [n_inner],
            "val_mask": [n_inner],
            "test_mask": [n_inner],
            "send_offsets": [parts + 1],
        }
        files = entry.get("files")
        if not isinstance(files, dict):
            raise _malformed(path, f"{where}.files", files, "an object with an entry per array")
        for name in PART_ARRAYS:
            field = f"{where}.files.{name}"
            meta = files.get(name)
            if not isinstance(meta, dict):
                raise _malformed(path, field, meta, "an object with bytes, sha256, dtype and shape")
            _count(path, f"{field}.bytes", meta.get("bytes"))
            for key in ("sha256", "dtype"):
                if not isinstance(meta.get(key), str):
                    raise _malformed(path, f"{field}.{key}", meta.get(key), "a string")
            shape = meta.get("shape")
            if not isinstance(shape, list) or not all(_is_count(size) for size in shape):
                raise _malformed(path, f"{field}.shape", shape, "a list of sizes")
            expected = shapes.get(name)
            if expected is not None and shape != expected:
                raise UserError(
                    f"{path}: {field}.shape is {shape}, but the entry's counts (n_inner {n_inner}, n_boundary "
                    f"{n_boundary}, {parts} parts) make it {expected}; {REWRITE}"
                )
            if expected is None and len(shape) != 1:
                raise _malformed(path, f"{field}.shape", shape, "one size")
        if identified:
            counts = entry.get("boundary_counts")
            if not isinstance(counts, list) or len(counts) != parts or not all(_is_count(c) for c in counts):
                raise _malformed(path, f"{where}.boundary_counts", counts, f"a list of {parts} counts")
            if counts[k]:
                raise UserError(
                    f"{path}: {where}.boundary_counts has {counts[k]} boundary nodes owned by partition {k}, the "
                    f"entry's own partition (entry k must describe partition k: were the entries reordered?); {REWRITE}"
                )
            if sum(counts) != n_boundary:
                raise UserError(
                    f"{path}: {where}.boundary_counts add up to {sum(counts)}, but its n_boundary is {n_boundary}; "
                    f"{REWRITE}"
                )


def _check_dir(parts_dir: Path, root: Path, path: Path, field: str, value: object) -> None:
    """A partition directory must lie inside the set: relative, no ``..``, no link out of it."""
    if not isinstance(value, str) or not value:
        raise _malformed(path, field, value, "a directory name inside the set")
    if PurePosixPath(value).is_absolute() or ".." in PurePosixPath(value).parts:
        raise UserError(
            f"{path}: {field} is {value!r}, which is not inside the set (an absolute path or one with '..'); {REWRITE}"
        )
    resolved = (parts_dir / value).resolve()
    if not resolved.is_relative_to(root):
        raise UserError(
            f"{path}: {field} {value!r} leads out of the set, to {resolved} (a symbolic link); copy the partition "
            f"into the set or {REWRITE}"
        )


def check_part_meta(parts_dir: Path, manifest: dict, part: int, required: bool = True) -> None:
    """Check that ``part``'s ``partition.json`` belongs to this set and to this place in it.

    Sets without a ``set_id`` (written before it existed) have no ``partition.json``; for
    them, and with ``required`` False, a missing file is left to the loader.
    """
    parts_dir = Path(parts_dir)
    manifest_path = parts_dir / MANIFEST_NAME
    path = parts_dir / manifest["partitions"][part]["dir"] / PART_META_NAME
    if not path.is_file():
        if required and "set_id" in manifest:
            raise UserError(f"{path} is missing: the partition set is incomplete; {REWRITE}")
        return
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} cannot be read ({exc}); {REWRITE}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("set_id"), str) or not _is_count(meta.get("part")):
        raise UserError(f"{path} is not a partition's metadata (set_id and part); {REWRITE}")
    identity = manifest.get("set_id") or set_id(manifest)
    if meta["set_id"] != identity:
        raise UserError(
            f"{path} belongs to partition set {_shown(meta['set_id'])}, but {manifest_path} is set {identity!r}: "
            f"the partition was taken from another set; copy whole partition sets only, or {REWRITE}"
        )
    if meta["part"] != part:
        raise UserError(
            f"{path} is partition {meta['part']} of its set, but {manifest_path} lists it as partition {part}: "
            f"the manifest's entries were reordered or edited; {REWRITE}"
        )


# --- loading a partition ------------------------------------------------------------------


@dataclass(frozen=True)
class PartitionArrays:
    """One partition's arrays, memory-mapped, plus the manifest facts a rank needs."""

    part: int
    num_parts: int
    manifest: dict
    directory: Path
    arrays: dict[str, np.ndarray]

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]

    def path(self, name: str) -> Path:
        """The file of array ``name``."""
        return self.directory / f"{name}.npy"


def load_partition(parts_dir: Path, part: int, verify: bool = False) -> PartitionArrays:
    """Load partition ``part`` of a set, memory-mapped.

    Always checked, at O(K) cost: the manifest (:func:`read_manifest`), the partition's
    ``partition.json`` (:func:`check_part_meta`), every file's size, dtype and shape against
    the manifest, and the offsets (from 0, non-decreasing, ending at the array they index,
    nothing owned by or sent to the partition itself, the per-owner counts the manifest
    records). With ``verify`` the SHA-256 of every file is checked too. Any problem raises
    :class:`UserError` naming the file. The values of the arrays are checked by
    :func:`check_partition_values`.
    """
    parts_dir = Path(parts_dir)
    manifest = read_manifest(parts_dir)
    num_parts = manifest["parts"]
    if not 0 <= part < num_parts:
        raise UserError(
            f"rank {part} has no partition: {parts_dir} has {num_parts} parts; start {num_parts} ranks, one per "
            "partition"
        )
    check_part_meta(parts_dir, manifest, part)
    entry = manifest["partitions"][part]
    part_dir = parts_dir / entry["dir"]
    arrays: dict[str, np.ndarray] = {}
    for name in PART_ARRAYS:
        meta = entry["files"][name]
        path = part_dir / f"{name}.npy"
        if not path.is_file():
            raise UserError(f"{path} is missing: the partition set is incomplete; {REWRITE}")
        if path.stat().st_size != meta["bytes"]:
            raise UserError(
                f"{path} has {path.stat().st_size} bytes, the manifest says {meta['bytes']}: "
                f"the file is truncated or corrupt; {REWRITE}"
            )
        if verify and sha256_file(path) != meta["sha256"]:
            raise UserError(f"{path} fails its SHA-256 checksum: the file is corrupt; {REWRITE}")
        try:
            # copy-on-write: the file is opened read-only and never written; the engine uses
            # arrays of the right dtype in place (bnsgcn.data.shard), as writable tensors
            array = np.load(path, mmap_mode="c", allow_pickle=False)
        except ValueError as exc:
            raise UserError(f"{path} is not a readable .npy array ({exc}); {REWRITE}") from None
        if list(array.shape) != meta["shape"] or str(array.dtype) != meta["dtype"]:
            raise UserError(
                f"{path} holds {array.dtype}{list(array.shape)}, the manifest says "
                f"{meta['dtype']}{meta['shape']}; {REWRITE}"
            )
        arrays[name] = array
    partition = PartitionArrays(part=part, num_parts=num_parts, manifest=manifest, directory=part_dir, arrays=arrays)
    _check_offsets(partition)
    return partition


def _edited(path: Path, problem: str) -> UserError:
    return UserError(f"{path} {problem}; the file was edited or damaged: {REWRITE}")


def _check_offsets(partition: PartitionArrays) -> None:
    """``boundary_offsets`` and ``send_offsets`` against the arrays they index and the manifest."""
    k, parts = partition.part, partition.num_parts
    entries = partition.manifest["partitions"]
    identified = "set_id" in partition.manifest
    for name, indexed, what in (
        ("boundary_offsets", "boundary_nodes", "has {} boundary nodes owned by partition {}"),
        ("send_offsets", "send_nodes", "sends {} rows to partition {}"),
    ):
        path = partition.path(name)
        offsets = np.asarray(partition[name], dtype=np.int64)
        counts = np.diff(offsets)
        total = partition[indexed].shape[0]
        if offsets[0] != 0:
            raise _edited(path, f"starts at {offsets[0]}, not 0")
        if (counts < 0).any():
            raise _edited(path, f"decreases at partition {int(np.argmax(counts < 0))}")
        if offsets[-1] != total:
            raise _edited(path, f"ends at {offsets[-1]}, but {indexed}.npy holds {total} entries")
        if counts[k]:
            raise _edited(path, what.format(counts[k], k) + ", the partition itself")
        if identified:
            if name == "boundary_offsets":
                recorded = np.asarray(entries[k]["boundary_counts"])
            else:  # what partition q expects from us: its boundary nodes owned by partition k
                recorded = np.array([entries[q]["boundary_counts"][k] for q in range(parts)])
            if (counts != recorded).any():
                q = int(np.argmax(counts != recorded))
                raise _edited(path, what.format(counts[q], q) + f", where the manifest records {recorded[q]}")


def check_partition_values(partition: PartitionArrays, full: bool = False) -> None:
    """Check the index and degree arrays of a loaded partition; UserError naming the file.

    Always (O(n) vectorised passes, no sort): node ids within the dataset's nodes, send
    indices within the partition's inner nodes, every degree a finite number >= 1 (degrees
    count the self-loop). With ``full`` (``--verify``) also: no node listed twice among the
    inner and boundary nodes, none sent twice to the same partition, every adjacency row
    holding its self-loop and as many entries as the node's degree.
    """
    num_nodes = partition.manifest["dataset"]["num_nodes"]
    n_inner = partition["inner_nodes"].shape[0]
    for name, bound, within in (
        ("inner_nodes", num_nodes, f"the dataset's {num_nodes} nodes"),
        ("boundary_nodes", num_nodes, f"the dataset's {num_nodes} nodes"),
        ("send_nodes", n_inner, f"the partition's {n_inner} inner nodes"),
    ):
        ids = partition[name]
        if ids.size and (ids.min() < 0 or ids.max() >= bound):
            at = int(np.argmax((ids < 0) | (ids >= bound)))
            raise _edited(partition.path(name), f"holds {ids[at]} at position {at}, outside {within}")
    degree = partition["degree"]
    good = np.isfinite(degree)
    np.greater_equal(degree, 1, out=good, where=good)
    if not good.all():
        column = int(np.argmin(good))
        raise _edited(
            partition.path("degree"),
            f"holds degree {degree[column]} for node {_node(partition, column)} (local column {column}); degrees "
            "count the self-loop, so each is a finite number >= 1",
        )
    if full:
        _check_full(partition)


def _node(partition: PartitionArrays, column: int) -> int:
    """The global id of local column ``column``."""
    n_inner = partition["inner_nodes"].shape[0]
    if column < n_inner:
        return int(partition["inner_nodes"][column])
    return int(partition["boundary_nodes"][column - n_inner])


def _first_repeat(keys: np.ndarray) -> int | None:
    """The smallest value occurring twice in ``keys``, or None."""
    keys = np.sort(keys)
    repeated = keys[1:][keys[1:] == keys[:-1]]
    return int(repeated[0]) if repeated.size else None


def _check_full(partition: PartitionArrays) -> None:
    """The checks of :func:`check_partition_values` that sort or read every adjacency entry."""
    node = _first_repeat(np.concatenate([partition["inner_nodes"], partition["boundary_nodes"]]))
    if node is not None:
        raise _edited(partition.path("inner_nodes"), f"and boundary_nodes.npy list node {node} more than once")
    n_inner = partition["inner_nodes"].shape[0]
    peer = np.repeat(np.arange(partition.num_parts), np.diff(partition["send_offsets"]))
    key = _first_repeat(peer * max(n_inner, 1) + partition["send_nodes"])
    if key is not None:
        q, row = divmod(key, max(n_inner, 1))
        raise _edited(partition.path("send_nodes"), f"sends node {_node(partition, row)} twice to partition {q}")
    indptr = np.asarray(partition["adj_indptr"], dtype=np.int64)
    indices = partition["adj_indices"]
    row_length = np.diff(indptr)
    rows = np.repeat(np.arange(n_inner), row_length)
    has_self_loop = np.zeros(n_inner, dtype=bool)
    has_self_loop[rows[indices == rows]] = True
    if not has_self_loop.all():
        row = int(np.argmin(has_self_loop))
        raise _edited(partition.path("adj_indices"), f"has no self-loop in the row of node {_node(partition, row)}")
    mismatch = partition["degree"][:n_inner] != row_length
    if mismatch.any():
        row = int(np.argmax(mismatch))
        raise _edited(
            partition.path("degree"),
            f"gives node {_node(partition, row)} degree {partition['degree'][row]}, but its adjacency row holds "
            f"{row_length[row]} entries (its in-edges and self-loop)",
        )
