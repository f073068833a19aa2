"""Cora, CiteSeer and PubMed from the raw Planetoid files, with the public split.

Files ``ind.<name>.{x,y,tx,ty,allx,ally,graph,test.index}`` (from
https://github.com/kimiyoung/planetoid, folder ``data``), in ``<data_dir>/<name>``,
``<data_dir>/<PyG name>/raw`` (PyTorch Geometric's layout), ``<data_dir>/planetoid`` or
``<data_dir>``. They are Python 2 pickles of scipy/numpy objects; they are read by an
unpickler that accepts only the few classes they contain (numpy arrays and dtypes, a
``collections.defaultdict`` of lists, and scipy CSR matrices, decoded here without scipy),
so a tampered file cannot run code.

Layout (as in Kipf & Welling's loader): ``allx``/``ally`` are the first nodes, ``tx``/``ty``
the test nodes in the order of ``test.index``; ``y`` labels the first ``len(y)`` nodes
(the training split), the next 500 nodes are the validation split and ``test.index`` the
test split. Test ids missing from ``tx`` (CiteSeer's isolated nodes) get zero features,
label 0 and no split. Features (binary bag of words for Cora and CiteSeer, TF-IDF for
PubMed) are row-normalised to sum 1, as in Kipf & Welling's preprocessing; all-zero rows
stay zero.
"""

from __future__ import annotations

import codecs
import collections
import itertools
import pickle
from functools import partial
from pathlib import Path
from typing import BinaryIO

import numpy as np

from bnsgcn.data.format import ROW_NORMALISE
from bnsgcn.errors import UserError
from bnsgcn.partition.graph import Graph

from . import DatasetSource, Progress, build_graph, find_dataset_dir
from .npz import csr_row_ids, dense_from_sparse

PYG_NAMES = {"cora": "Cora", "citeseer": "CiteSeer", "pubmed": "PubMed"}
PICKLED_PARTS = ("x", "y", "tx", "ty", "allx", "ally", "graph")
NUM_VAL = 500
HOW_TO_GET = "pass --download to fetch them, or get them from the data folder of https://github.com/kimiyoung/planetoid"


class PickledCSR:
    """Stand-in for a pickled ``scipy.sparse.csr_matrix``: keeps its state, builds no scipy object."""

    state: dict

    def __setstate__(self, state: dict) -> None:
        self.state = state

    def to_dense(self, source: str) -> np.ndarray:
        """The matrix as dense float32 [rows, cols]."""
        state = getattr(self, "state", None)
        shape = state.get("_shape", state.get("shape")) if isinstance(state, dict) else None
        if shape is None or any(key not in state for key in ("indptr", "indices", "data")):
            raise UserError(f"{source} holds an incomplete sparse matrix; download the file again")
        try:
            indices = np.asarray(state["indices"], dtype=np.int64)
            data = np.asarray(state["data"], dtype=np.float32)
            rows, cols = int(shape[0]), int(shape[1])
        except (TypeError, ValueError, IndexError):
            raise UserError(f"{source} holds a sparse matrix with non-numeric parts; download the file again") from None
        if (
            indices.ndim != 1
            or indices.shape != data.shape
            or (indices.size and (indices.min() < 0 or indices.max() >= cols))
        ):
            raise UserError(
                f"{source} holds a sparse matrix whose column ids do not fit its shape; download the file again"
            )
        row = csr_row_ids(state["indptr"], rows, indices.size, f"{source}: the sparse matrix")
        return dense_from_sparse(row, indices, data, (rows, cols))


def _latin1_encode(text: str, encoding: str) -> bytes:
    # Protocol-2 pickles written by Python 3 store bytes as _codecs.encode(text, "latin1").
    if encoding != "latin1":
        raise pickle.UnpicklingError(f"_codecs.encode with encoding {encoding!r} is not allowed")
    return codecs.encode(text, "latin1")


_RECONSTRUCT = np.ndarray.__reduce__(np.empty(0))[0]  # numpy's array rebuilder, whatever its module
_SCALAR = np.float64(0).__reduce__()[0]
ALLOWED_GLOBALS: dict[tuple[str, str], object] = {
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy.core.multiarray", "scalar"): _SCALAR,
    ("numpy._core.multiarray", "scalar"): _SCALAR,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("collections", "defaultdict"): collections.defaultdict,
    ("__builtin__", "list"): list,
    ("builtins", "list"): list,
    ("_codecs", "encode"): _latin1_encode,
    ("scipy.sparse.csr", "csr_matrix"): PickledCSR,
    ("scipy.sparse._csr", "csr_matrix"): PickledCSR,
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        try:
            return ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a data file") from None


def restricted_unpickle(handle: BinaryIO, source: str) -> object:
    """Unpickle data that may only hold numpy arrays, lists, dicts and scipy CSR matrices.

    Python 2 strings decode as latin-1. Any other class, or a damaged stream, is a
    :class:`UserError` naming ``source``.
    """
    try:
        return _RestrictedUnpickler(handle, encoding="latin1").load()
    except Exception as exc:  # a damaged pickle can fail in any of the opcode handlers
        raise UserError(
            f"{source} cannot be read ({type(exc).__name__}: {exc}); the file is damaged or not in the expected "
            "format, get it again"
        ) from None


def _dense(value: object, path: Path) -> np.ndarray:
    if isinstance(value, PickledCSR):
        return value.to_dense(str(path))
    if isinstance(value, np.ndarray) and value.ndim == 2 and value.dtype != object:
        return value.astype(np.float32)
    raise UserError(f"{path} holds {type(value).__name__}, expected a 2-D matrix; download the file again")


def _edges(adjacency: object, path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) of the adjacency lists ``{node: [neighbour, ...]}``."""
    if not isinstance(adjacency, dict):
        raise UserError(
            f"{path} holds {type(adjacency).__name__}, expected a dict of adjacency lists; download the file again"
        )
    try:
        nodes = np.fromiter(adjacency.keys(), dtype=np.int64, count=len(adjacency))
        counts = np.fromiter(map(len, adjacency.values()), dtype=np.int64, count=len(adjacency))
        dst = np.fromiter(itertools.chain.from_iterable(adjacency.values()), dtype=np.int64, count=int(counts.sum()))
    except (TypeError, ValueError, OverflowError):
        raise UserError(f"{path} must map node ids to lists of node ids; download the file again") from None
    return np.repeat(nodes, counts), dst


def locate_planetoid(name: str, data_dir: Path | None) -> DatasetSource:
    """``cora``, ``citeseer`` or ``pubmed``."""
    required = tuple(f"ind.{name}.{part}" for part in (*PICKLED_PARTS, "test.index"))
    root, files = find_dataset_dir(data_dir, (name, f"{PYG_NAMES[name]}/raw", "planetoid"), required, name, HOW_TO_GET)
    return DatasetSource(name, tuple(root / file for file in files), partial(read_planetoid, name, root))


def read_planetoid(name: str, root: Path, progress: Progress) -> Graph:
    """Read ``cora``, ``citeseer`` or ``pubmed`` from ``root`` with the public Planetoid split."""
    parts = {}
    with progress.step(f"reading {root}/ind.{name}.*"):
        for part in PICKLED_PARTS:
            path = root / f"ind.{name}.{part}"
            try:
                with open(path, "rb") as handle:
                    parts[part] = restricted_unpickle(handle, str(path))
            except OSError as exc:
                raise UserError(f"{path} cannot be opened ({exc}); check its permissions") from None
        index_path = root / f"ind.{name}.test.index"
        try:
            test_index = np.loadtxt(index_path, dtype=np.int64, ndmin=1)
        except (OSError, ValueError) as exc:
            raise UserError(f"{index_path} must hold one node id per line ({exc}); download the file again") from None
    paths = {part: root / f"ind.{name}.{part}" for part in PICKLED_PARTS}
    allx, tx = _dense(parts["allx"], paths["allx"]), _dense(parts["tx"], paths["tx"])
    ally, ty, y = (_dense(parts[part], paths[part]) for part in ("ally", "ty", "y"))
    num_train, num_classes = y.shape
    num_known = allx.shape[0]
    if (
        ally.shape[0] != num_known
        or tx.shape[0] != ty.shape[0]
        or tx.shape[0] != test_index.size
        or tx.shape[1] != allx.shape[1]
        or not ally.shape[1] == ty.shape[1] == num_classes
        or test_index.size == 0
        or test_index.min() < num_known
        or num_train + NUM_VAL > num_known
    ):
        raise UserError(
            f"{root}: the ind.{name}.* files do not fit together (x/y/tx/ty/allx/ally/test.index sizes differ); use "
            "one complete download"
        )
    num_nodes = max(num_known + tx.shape[0], int(test_index.max()) + 1)
    features = np.zeros((num_nodes, allx.shape[1]), dtype=np.float32)
    features[:num_known], features[test_index] = allx, tx
    # Row-normalised, as Kipf & Welling's preprocessing and PyG's NormalizeFeatures do.
    row_sums = features.sum(axis=1, keepdims=True)
    np.divide(features, row_sums, out=features, where=row_sums > 0)
    one_hot = np.zeros((num_nodes, num_classes), dtype=np.float32)
    one_hot[:num_known], one_hot[test_index] = ally, ty
    labels = one_hot.argmax(axis=1)
    masks = np.zeros((3, num_nodes), dtype=bool)
    masks[0, :num_train] = True
    masks[1, num_train : num_train + NUM_VAL] = True
    masks[2, test_index] = True
    src, dst = _edges(parts["graph"], paths["graph"])
    return build_graph(
        name,
        src,
        dst,
        features,
        labels,
        (masks[0], masks[1], masks[2]),
        num_classes,
        f"{name} ({root})",
        progress,
        feature_preprocessing={"kind": ROW_NORMALISE},
    )
