"""A graph stored as a directory of ``.npy`` arrays in canonical CSR form, read memory-mapped.

``csr:<dir>`` is the input for graphs too large to load and canonicalise in memory (the
other loaders hold the edge list as int64 keys while they sort it). Layout::

    graph.json     {"name": str, "num_classes": int, "multilabel": bool, "symmetrized": bool}
    indptr.npy     int64 [N+1]   in-edges of v: indices[indptr[v]:indptr[v+1]]
    indices.npy    int32 [E]     canonical: symmetric, ascending in every row, no self-loops,
                                 no duplicates
    features.npy   float32 [N, F]
    labels.npy     int64 [N] (uint8 [N, C] when multilabel)
    train_mask.npy, val_mask.npy, test_mask.npy   bool [N]

Every array is opened with ``mmap_mode="r"``: nothing is copied into memory, pages are read
as the partition step touches them, and the files are never written. Loading checks the
CSR in one streamed pass (numba): ``indptr`` monotone from 0 to E, every row strictly
ascending, in range, without self-loops, and every edge present in both directions
(binary search in the reverse row); features are checked for NaN/inf in row blocks.

:func:`write_synthetic_csr` writes the graph of a ``synthetic:`` spec in this layout with
memory bounded by ``O(N + E / buckets)``: edges are drawn in chunks, both directions are
appended to bucket files by destination range, and each bucket is then sorted,
deduplicated and appended to ``indices.npy``; features are drawn straight into a
memory-mapped ``features.npy``. The result equals ``synthetic:<spec>`` loaded in memory,
array for array.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from functools import partial
from pathlib import Path

import numba
import numpy as np

from bnsgcn.errors import UserError
from bnsgcn.partition.graph import Graph, _sorted_unique

from . import (
    DatasetSource,
    Progress,
    _check_labels,
    _check_masks,
    check_features,
    random_split_masks,
)
from .synthetic import (
    CHUNK,
    SyntheticConfig,
    draw_labels,
    edge_sampler,
    fill_features,
    graph_name,
    random_streams,
)

META = "graph.json"
ARRAYS = ("indptr", "indices", "features", "labels", "train_mask", "val_mask", "test_mask")
CHECK_EDGES = 1 << 26  # edges checked per compiled call
BUCKET_KEYS = 1 << 24  # directed edges per bucket file (int64 keys: 128 MiB, a few times that to sort)
_NPY_HEADER = 128  # bytes of a version-1 .npy header of a 1-D array (numpy pads it to 64-byte blocks)


def locate_csr(directory: Path, data_dir: Path | None) -> DatasetSource:
    """The graph in ``directory`` (tried under ``data_dir`` when relative and missing)."""
    directory = Path(directory)
    if not directory.is_dir() and data_dir is not None and not directory.is_absolute():
        directory = Path(data_dir) / directory
    missing = [name for name in (META, *(f"{a}.npy" for a in ARRAYS)) if not (directory / name).is_file()]
    if missing:
        raise UserError(
            f"csr: {directory} lacks {', '.join(missing)}; write the directory layout of docs/datasets.md "
            "(e.g. with benchmarks/partition_scale.py --csr-dir)"
        )
    files = (directory / META, *(directory / f"{a}.npy" for a in ARRAYS))
    return DatasetSource(directory.name, files, partial(read_csr, directory))


def _open(directory: Path, name: str) -> np.ndarray:
    path = directory / f"{name}.npy"
    try:
        # np.asarray drops the memmap subclass (numba takes plain arrays); the pages stay mapped.
        return np.asarray(np.load(path, mmap_mode="r", allow_pickle=False))
    except (OSError, ValueError, EOFError) as exc:
        raise UserError(f"csr: {path} is not a readable .npy array ({exc}); write it again with numpy.save") from None


@numba.njit(cache=True, nogil=True)
def _check_indptr(indptr, num_edges):  # pragma: no cover - numba
    """-1 if ``indptr`` is non-decreasing from 0 to ``num_edges``, else the first bad node."""
    n = indptr.shape[0] - 1
    if indptr[0] != 0 or indptr[n] != num_edges:
        return 0
    for v in range(n):
        if indptr[v + 1] < indptr[v]:
            return v
    return -1


@numba.njit(cache=True, nogil=True)
def _check_rows(indptr, indices, first, last):  # pragma: no cover - numba
    """0 if rows ``first..last-1`` are canonical, else a code: 2 index out of range, 3 row not
    strictly ascending (or a duplicate), 4 self-loop, 5 not symmetric; and the node."""
    n = indptr.shape[0] - 1
    for v in range(first, last):
        previous = -1
        for e in range(indptr[v], indptr[v + 1]):
            u = indices[e]
            if u < 0 or u >= n:
                return 2, v
            if u <= previous:
                return 3, v
            if u == v:
                return 4, v
            previous = u
            # u -> v stored in row v; symmetric means v is in row u (rows are sorted).
            lo, hi = indptr[u], indptr[u + 1]
            while lo < hi:
                mid = (lo + hi) // 2
                if indices[mid] < v:
                    lo = mid + 1
                else:
                    hi = mid
            if lo == indptr[u + 1] or indices[lo] != v:
                return 5, v
    return 0, 0


CSR_PROBLEMS = {
    1: "indptr is not non-decreasing from 0 to len(indices)",
    2: "indices hold node ids outside [0, N)",
    3: "a row is not strictly ascending (unsorted or duplicate edges)",
    4: "a row lists its own node (self-loop)",
    5: "an edge is missing its reverse (the graph is not symmetric)",
}


def read_csr(directory: Path, progress: Progress) -> Graph:
    """Open the graph in ``directory`` memory-mapped and check it (module docstring)."""
    try:
        meta = json.loads((directory / META).read_text())
        name, num_classes = str(meta["name"]), int(meta["num_classes"])
        multilabel, symmetrized = bool(meta.get("multilabel", False)), bool(meta.get("symmetrized", False))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(
            f'csr: {directory / META} is unreadable ({exc}); write {{"name": ..., "num_classes": ...}}'
        ) from None
    arrays = {a: _open(directory, a) for a in ARRAYS}
    indptr, indices = arrays["indptr"], arrays["indices"]
    source = f"csr: {directory}"
    if indptr.dtype != np.int64 or indptr.ndim != 1 or indices.dtype != np.int32 or indices.ndim != 1:
        raise UserError(
            f"{source}: indptr must be int64 [N+1] and indices int32 [E], found {indptr.dtype} {list(indptr.shape)} "
            f"and {indices.dtype} {list(indices.shape)}; convert them with astype"
        )
    num_nodes = indptr.shape[0] - 1
    with progress.step(f"checking the CSR of {num_nodes:,} nodes and {indices.shape[0]:,} edges"):
        node = _check_indptr(indptr, indices.shape[0])
        code = 1 if node >= 0 else 0
        # Blocks of about CHECK_EDGES edges: Ctrl-C and SIGTERM are handled between compiled calls.
        bounds = np.unique(np.searchsorted(indptr, np.arange(0, indices.shape[0], CHECK_EDGES), side="right") - 1)
        for first, last in zip(bounds, [*bounds[1:], num_nodes]):
            if code:
                break
            code, node = _check_rows(indptr, indices, first, last)
    if code:
        raise UserError(
            f"{source}: {CSR_PROBLEMS[code]} (at node {node}); write a canonical CSR (see docs/datasets.md)"
        )
    features = check_features(arrays["features"], num_nodes, source)
    labels = _check_labels(arrays["labels"], num_nodes, num_classes, multilabel, source)
    train, val, test = _check_masks((arrays["train_mask"], arrays["val_mask"], arrays["test_mask"]), num_nodes, source)
    return Graph(
        name=name,
        indptr=indptr,
        indices=indices,
        features=features,
        labels=labels,
        train_mask=train,
        val_mask=val,
        test_mask=test,
        num_classes=num_classes,
        multilabel=multilabel,
        symmetrized=symmetrized,
    )


def write_synthetic_csr(
    config: SyntheticConfig, directory: Path, progress: Progress, bucket_keys: int = BUCKET_KEYS
) -> None:
    """Write the graph of ``config`` to ``directory`` in the ``csr:`` layout, streaming (module docstring).

    Written into a new temporary directory beside ``directory`` (a unique name: a link or
    another writer at a fixed name is never followed) and renamed at the end; memory
    ``O(N + bucket_keys)``, disk about 8 bytes per directed edge of scratch on top of the result.
    """
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".tmp", dir=directory.parent))
    try:
        _write_synthetic(config, tmp, progress, bucket_keys)
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_synthetic(config: SyntheticConfig, out: Path, progress: Progress, bucket_keys: int) -> None:
    rng_labels, rng_edges, rng_features, rng_split = random_streams(config)
    num_nodes = config.nodes
    labels = draw_labels(config, rng_labels)
    draws, sample = edge_sampler(config, labels)
    # Buckets are ranges of destination nodes; each gets about bucket_keys directed edges.
    buckets = max(1, math.ceil(2 * draws / bucket_keys))
    per_bucket = math.ceil(num_nodes / buckets)
    n = np.int64(num_nodes)
    files = [open(out / f"bucket-{b}.bin", "wb") for b in range(buckets)]
    try:
        with progress.step(f"drawing {draws:,} edges into {buckets} buckets"):
            for start in range(0, draws, CHUNK):
                u, v = sample(rng_edges, min(CHUNK, draws - start))
                keep = u != v
                u, v = u[keep].astype(np.int64), v[keep].astype(np.int64)
                dst = np.concatenate((v, u))
                keys = dst * n + np.concatenate((u, v))  # key dst * N + src, both directions
                del u, v
                bucket = dst // per_bucket
                order = np.argsort(bucket, kind="stable")
                bounds = np.searchsorted(bucket[order], np.arange(buckets + 1))
                keys = keys[order]
                for b in range(buckets):
                    keys[bounds[b] : bounds[b + 1]].tofile(files[b])
    finally:
        for handle in files:
            handle.close()
    counts = np.zeros(num_nodes, dtype=np.int64)
    with progress.step(f"sorting and deduplicating {buckets} buckets"), open(out / "indices.npy", "wb") as handle:
        handle.write(b"\0" * _NPY_HEADER)  # the header, written once the length is known
        total = 0
        for b in range(buckets):
            path = out / f"bucket-{b}.bin"
            keys = _sorted_unique(np.fromfile(path, dtype=np.int64))
            path.unlink()
            dst = keys // n
            low, high = b * per_bucket, min(num_nodes, (b + 1) * per_bucket)
            if high > low:
                counts[low:high] += np.bincount(dst - low, minlength=high - low)
            (keys - dst * n).astype(np.int32).tofile(handle)
            total += keys.size
            del keys, dst
        handle.seek(0)
        header = _npy_header(np.dtype(np.int32), (total,))
        handle.write(header)
    indptr = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    np.save(out / "indptr.npy", indptr)
    del counts, indptr
    features = np.lib.format.open_memmap(
        out / "features.npy", mode="w+", dtype=np.float32, shape=(num_nodes, config.features)
    )
    fill_features(config, labels, rng_features, features, progress)
    features.flush()
    del features
    masks = random_split_masks(num_nodes, config.train, config.val, rng_split)
    np.save(out / "labels.npy", labels)
    for split, mask in zip(("train_mask", "val_mask", "test_mask"), masks):
        np.save(out / f"{split}.npy", mask)
    meta = {
        "name": graph_name(config),
        "num_classes": config.classes,
        "multilabel": False,
        "symmetrized": False,
        "spec": config.spec(),
    }
    (out / META).write_text(json.dumps(meta, indent=1) + "\n")


def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The version-1 ``.npy`` header of a C-order array, padded to :data:`_NPY_HEADER` bytes."""
    import io

    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buffer, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    )
    header = buffer.getvalue()
    if len(header) != _NPY_HEADER:  # numpy pads to 64-byte blocks; a 1-D shape always fits 128
        raise RuntimeError(f"unexpected .npy header length {len(header)}")
    return header
