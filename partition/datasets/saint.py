"""Datasets in the GraphSAINT layout (Yelp, and any other directory in that layout).

Files, in ``<data_dir>/<name>`` or ``<data_dir>``:

* ``adj_full.npz``: the full adjacency as written by ``scipy.sparse.save_npz`` (CSR).
* ``feats.npy``: node features [N, F].
* ``class_map.json``: ``{"<node id>": class id}`` or, multi-label, ``{"<node id>": [0/1] * C}``.
* ``role.json``: ``{"tr": [...], "va": [...], "te": [...]}`` node ids of the splits.

As in GraphSAINT (and BNS-GCN), features are standardised with the mean and standard
deviation of the training nodes: ``x' = (x - mean_train) / std_train`` per column
(columns with zero deviation are only centred).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import numpy as np

from bnsgcn.data.format import FEATURE_STATS_FILE, STANDARDISE
from bnsgcn.errors import UserError
from bnsgcn.partition.graph import Graph

from . import (
    DatasetSource,
    Progress,
    build_graph,
    check_features,
    find_dataset_dir,
    read_split_masks,
)
from .npz import NpzArrays, read_sparse

FILES = ("adj_full.npz", "feats.npy", "class_map.json", "role.json")
HOW_TO_GET = (
    "get the dataset folder from the GraphSAINT data links (https://github.com/GraphSAINT/GraphSAINT, section Datasets)"
)
ROLE_KEYS = {"train": "tr", "val": "va", "test": "te"}


def _read_json(path: Path) -> object:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path} is not readable JSON ({exc}); download the dataset again") from None


def _read_labels(path: Path, num_nodes: int) -> tuple[np.ndarray, int, bool]:
    """Labels from ``class_map.json``: ([N] ids, C, False) or ([N, C] 0/1, C, True)."""
    class_map = _read_json(path)
    if not isinstance(class_map, dict) or not class_map:
        raise UserError(f"{path} must be a non-empty object mapping node ids to labels; download the dataset again")
    try:
        nodes = np.fromiter(map(int, class_map.keys()), dtype=np.int64, count=len(class_map))
        multilabel = isinstance(next(iter(class_map.values())), list)
        if multilabel:
            values = np.array(list(class_map.values()), dtype=np.int64)
        else:
            values = np.fromiter(class_map.values(), dtype=np.int64, count=len(class_map))
    except (TypeError, ValueError, OverflowError):
        raise UserError(
            f"{path}: node ids must be integers and labels integers or equal-length 0/1 lists; fix the file"
        ) from None
    if nodes.min() < 0 or nodes.max() >= num_nodes or np.unique(nodes).size != num_nodes:
        raise UserError(f"{path} must label every node 0..{num_nodes - 1} exactly once; it does not match adj_full.npz")
    if multilabel:
        num_classes = values.shape[1]
        labels = np.empty((num_nodes, num_classes), dtype=values.dtype)
    else:
        num_classes = int(values.max()) + 1
        labels = np.empty(num_nodes, dtype=values.dtype)
    labels[nodes] = values
    return labels, num_classes, multilabel


def _read_splits(path: Path, num_nodes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    role = _read_json(path)
    if not isinstance(role, dict) or any(key not in role for key in ROLE_KEYS.values()):
        raise UserError(f"{path} must hold the node lists 'tr', 'va' and 'te'; download the dataset again")
    try:
        splits = {split: np.asarray(role[key], dtype=np.int64) for split, key in ROLE_KEYS.items()}
    except (TypeError, ValueError, OverflowError):
        raise UserError(f"{path}: 'tr', 'va' and 'te' must be lists of node ids; fix the file") from None
    return read_split_masks(num_nodes, splits, str(path))


def standardise(features: np.ndarray, train_mask: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Column-wise ``(x - mean) / std`` with the training rows' statistics, float32 [N, F], and
    those statistics (``mean``, ``std`` float32 [F], a zero std as 1)."""
    train_rows = features[train_mask]
    mean = train_rows.mean(axis=0, dtype=np.float64)
    std = train_rows.std(axis=0, dtype=np.float64)
    std[std == 0] = 1.0
    stats = {"mean": mean.astype(np.float32), "std": std.astype(np.float32)}
    return (features - stats["mean"]) / stats["std"], stats


def locate_saint(name: str, data_dir: Path | None) -> DatasetSource:
    """A GraphSAINT-format directory (``name`` is its folder name, or a path)."""
    from .download import find_download

    downloadable = find_download(f"saint:{name}") is not None
    how_to_get = f"pass --download to fetch them, or {HOW_TO_GET}" if downloadable else HOW_TO_GET
    root, files = find_dataset_dir(data_dir, (name,), FILES, name, how_to_get)
    return DatasetSource(name, tuple(root / file for file in files), partial(read_saint, Path(name).name, root))


def read_saint(graph_name: str, root: Path, progress: Progress) -> Graph:
    with progress.step(f"reading {root / 'adj_full.npz'}"), NpzArrays(root / "adj_full.npz") as adjacency:
        src, dst, _, shape = read_sparse(adjacency)
    if shape[0] != shape[1]:
        raise UserError(f"{root / 'adj_full.npz'}: adjacency shape {shape} is not square; the file is damaged")
    num_nodes = shape[0]
    with progress.step(f"reading {root / 'feats.npy'}"):
        try:
            features = np.load(root / "feats.npy", allow_pickle=False)
        except (OSError, ValueError, EOFError) as exc:
            raise UserError(
                f"{root / 'feats.npy'} is not a readable .npy array ({exc}); download the dataset again"
            ) from None
    features = check_features(features, num_nodes, str(root / "feats.npy"))
    with progress.step(f"reading {root / 'class_map.json'}"):
        labels, num_classes, multilabel = _read_labels(root / "class_map.json", num_nodes)
    masks = _read_splits(root / "role.json", num_nodes)
    stats = None
    if masks[0].any():  # an empty training split is reported by build_graph
        features, stats = standardise(features, masks[0])
    return build_graph(
        graph_name,
        src,
        dst,
        features,
        labels,
        masks,
        num_classes,
        f"{graph_name} ({root})",
        progress,
        multilabel=multilabel,
        feature_preprocessing={"kind": STANDARDISE, "file": FEATURE_STATS_FILE} if stats else None,
        feature_stats=stats,
    )
