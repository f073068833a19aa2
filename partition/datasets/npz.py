"""Graphs stored as arrays in one ``.npz`` file, and the sparse-matrix layouts inside such files.

``npz:<path>`` reads the layout of the gnn-benchmark files (e.g. ``cora.npz``)::

    adj_data, adj_indices, adj_indptr, adj_shape       CSR adjacency, row u col v = edge u -> v
    attr_data, attr_indices, attr_indptr, attr_shape   CSR node features [N, F]
      or features                                      dense node features [N, F]
    labels                                             class ids [N] (or 0/1 [N, C]: multi-label)
    train_mask, val_mask, test_mask                    optional, bool [N]

Without masks the nodes are split 60/20/20 at random with seed 0. The readers here are
shared with the Reddit and GraphSAINT loaders, whose adjacency files were written by
``scipy.sparse.save_npz`` (keys ``format``, ``shape``, ``indptr``/``indices`` or
``row``/``col``, ``data``). Nothing is unpickled: files load with ``allow_pickle=False``.
"""

from __future__ import annotations

import zipfile
from functools import partial
from pathlib import Path

import numpy as np

from bnsgcn.errors import UserError
from bnsgcn.partition.graph import Graph

from . import DatasetSource, Progress, build_graph, random_split_masks

RANDOM_SPLIT = (0.6, 0.2)  # train and val fractions; the rest is test
RANDOM_SPLIT_SEED = 0
ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # a zip's first entry, or an empty zip
NPY_MAGIC = b"\x93NUMPY"


class NpzArrays:
    """The arrays of one ``.npz`` file, read on access; every failure names the file."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        # np.load takes anything that is neither zip nor .npy for a pickle and then names
        # allow_pickle as the problem, so the format is checked first.
        try:
            with open(self.path, "rb") as handle:
                magic = handle.read(len(NPY_MAGIC))
        except FileNotFoundError:
            raise UserError(f"{self.path} does not exist; check the path") from None
        except OSError as exc:
            raise UserError(f"{self.path} cannot be opened ({exc.strerror}); check its permissions") from None
        if magic == NPY_MAGIC:
            raise UserError(
                f"{self.path} holds a single array, not an .npz archive of named arrays; save it with numpy.savez"
            )
        if magic[:4] not in ZIP_MAGIC:
            raise UserError(
                f"{self.path} is not an .npz archive (a zip of .npy arrays); save the arrays with numpy.savez"
            )
        try:
            self._file = np.load(self.path, allow_pickle=False)
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
            raise UserError(f"{self.path} is not a readable .npz file ({exc}); download or export it again") from None

    def __contains__(self, key: str) -> bool:
        return key in self._file.files

    def __getitem__(self, key: str) -> np.ndarray:
        if key not in self:
            raise UserError(
                f"{self.path} has no array {key!r} (it has {', '.join(self._file.files) or 'none'}); see "
                "docs/datasets.md for the expected layout"
            )
        try:
            return self._file[key]
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
            raise UserError(
                f"{self.path}: array {key!r} cannot be read ({exc}); the file is damaged, get it again"
            ) from None

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> NpzArrays:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def csr_row_ids(indptr: np.ndarray, num_rows: int, nnz: int, what: str) -> np.ndarray:
    """Row id of every stored entry of a CSR matrix, int64 [nnz]; checks ``indptr`` [rows+1]."""
    indptr = np.asarray(indptr, dtype=np.int64)
    if indptr.shape != (num_rows + 1,) or indptr[0] != 0 or indptr[-1] != nnz or np.any(np.diff(indptr) < 0):
        raise UserError(
            f"{what} does not fit a CSR matrix of {num_rows} rows and {nnz} entries; the file is damaged, get it again"
        )
    return np.repeat(np.arange(num_rows, dtype=np.int64), np.diff(indptr))


def read_sparse(
    arrays: NpzArrays, prefix: str = "", default_format: str = "csr"
) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, int]]:
    """A sparse matrix stored under ``<prefix>{format,shape,indptr,indices,row,col,data}``.

    Returns ``(row, col, data, shape)``: the stored entries in COO form, [nnz] each.
    CSR, CSC and COO are understood; a missing ``data`` means all ones.
    """
    source = arrays.path
    fmt = default_format
    if prefix + "format" in arrays:
        fmt = arrays[prefix + "format"].item()
        fmt = fmt.decode("ascii") if isinstance(fmt, bytes) else str(fmt)
    shape_array = arrays[prefix + "shape"]
    if shape_array.shape != (2,) or not np.issubdtype(shape_array.dtype, np.integer) or shape_array.min() < 0:
        raise UserError(
            f"{source}: {prefix}shape must be two non-negative integers, found {shape_array!r}; the file is damaged"
        )
    shape = (int(shape_array[0]), int(shape_array[1]))
    if fmt in ("csr", "csc"):
        minor = _index_array(arrays, prefix + "indices")
        indptr = _index_array(arrays, prefix + "indptr")
        major = csr_row_ids(indptr, shape[0] if fmt == "csr" else shape[1], minor.shape[0], f"{source}: {prefix}indptr")
        row, col = (major, minor) if fmt == "csr" else (minor, major)
    elif fmt == "coo":
        row, col = _index_array(arrays, prefix + "row"), _index_array(arrays, prefix + "col")
    else:
        raise UserError(f"{source}: sparse format {fmt!r} is not supported; save the matrix as csr, csc or coo")
    data = arrays[prefix + "data"] if prefix + "data" in arrays else np.ones(row.shape[0], dtype=np.float32)
    if not (row.shape == col.shape == data.shape) or row.ndim != 1:
        raise UserError(
            f"{source}: the {prefix or 'matrix'} index and data arrays differ in length; the file is damaged"
        )
    if row.size and (row.min() < 0 or row.max() >= shape[0] or col.min() < 0 or col.max() >= shape[1]):
        raise UserError(f"{source}: {prefix or 'matrix'} entries lie outside its shape {shape}; the file is damaged")
    return row, col, data, shape


def _index_array(arrays: NpzArrays, key: str) -> np.ndarray:
    """``arrays[key]``, which must have an integer dtype (a float array would be truncated)."""
    values = arrays[key]
    if not np.issubdtype(values.dtype, np.integer):
        raise UserError(
            f"{arrays.path}: {key} has dtype {values.dtype}, expected integers; store node ids and offsets as an "
            "integer array (e.g. int32)"
        )
    return values


def dense_from_sparse(row: np.ndarray, col: np.ndarray, data: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Dense float32 [rows, cols] matrix of COO entries; duplicate entries add up (as in scipy)."""
    dense = np.zeros(shape, dtype=np.float32)
    np.add.at(dense, (row, col), data.astype(np.float32))
    return dense


def _resolve(path: Path, data_dir: Path | None) -> Path:
    if path.is_file():
        return path
    if data_dir is not None and not path.is_absolute() and (Path(data_dir) / path).is_file():
        return Path(data_dir) / path
    where = f" (nor in {data_dir})" if data_dir is not None else ""
    raise UserError(
        f"npz: file {path} not found{where}; pass npz:<path to an .npz file> in the layout of docs/datasets.md"
    )


def locate_npz(path: Path, data_dir: Path | None) -> DatasetSource:
    """A graph in the ``.npz`` layout of the module docstring (relative paths also tried under ``data_dir``)."""
    path = _resolve(path, data_dir)
    return DatasetSource(path.stem, (path,), partial(read_npz, path))


def read_npz(path: Path, progress: Progress) -> Graph:
    """Read the graph in ``path``."""
    with NpzArrays(path) as arrays, progress.step(f"reading {path}"):
        src, dst, weight, adj_shape = read_sparse(arrays, "adj_")
        keep = weight != 0  # explicitly stored zeros are not edges
        src, dst = src[keep], dst[keep]
        if "features" in arrays:
            features = arrays["features"]
        elif "attr_shape" in arrays:
            features = dense_from_sparse(*read_sparse(arrays, "attr_"))
        else:
            raise UserError(
                f"{path} has neither 'features' nor 'attr_data/attr_indices/attr_indptr/attr_shape'; add the node "
                "features"
            )
        labels = arrays["labels"]
        present = [key for key in ("train_mask", "val_mask", "test_mask") if key in arrays]
        if present and len(present) != 3:
            raise UserError(
                f"{path} has {', '.join(present)} but not all of train_mask, val_mask, test_mask; store all three or "
                "none"
            )
        if present:
            masks = (arrays["train_mask"], arrays["val_mask"], arrays["test_mask"])
        else:
            masks = random_split_masks(labels.shape[0], *RANDOM_SPLIT, np.random.default_rng(RANDOM_SPLIT_SEED))
    num_nodes = features.shape[0]
    if adj_shape != (num_nodes, num_nodes):
        raise UserError(
            f"{path}: adjacency shape {adj_shape} does not match {num_nodes} feature rows; the arrays belong to "
            "different graphs"
        )
    multilabel = labels.ndim == 2
    if multilabel:
        num_classes = labels.shape[1]
    else:
        num_classes = int(labels.max()) + 1 if labels.size and np.issubdtype(labels.dtype, np.integer) else 1
    return build_graph(
        path.stem, src, dst, features, labels, masks, num_classes, str(path), progress, multilabel=multilabel
    )
