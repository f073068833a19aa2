"""Dataset loaders: every supported dataset becomes one canonical :class:`~bnsgcn.partition.graph.Graph`.

``load_dataset(spec, data_dir)`` is the entry point the rest of the project uses; it is
``resolve_dataset(spec, data_dir).load()``. Resolving finds every file the load will
read (or fails at once, without starting a progress line), so ``bnsgcn-partition`` can
check the files, and whether an existing set was made from them, before the long load.
The loaders never download: they read files placed under ``data_dir`` (see
``docs/datasets.md`` for each dataset's files and where to get them; ``bnsgcn-partition
--download`` fetches them first, :mod:`.download`) and turn every problem with them into a
one-line :class:`~bnsgcn.errors.UserError`.

This module also holds what all loaders share: the directory lookup
(:func:`find_dataset_dir`), the progress lines (:class:`Progress`) and the validation and
canonicalisation of the arrays a loader read (:func:`build_graph`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from bnsgcn.errors import UserError
from bnsgcn.metrics.progress import step
from bnsgcn.partition.graph import Graph, canonical_csr

DEFAULT_DATA_DIR = Path("data")
PLANETOID_NAMES = ("cora", "citeseer", "pubmed")
OGB_NAMES = ("ogbn-products", "ogbn-arxiv", "ogbn-papers100M")
SAINT_NAMES = ("yelp",)
DATASET_NAMES = ("reddit", *OGB_NAMES, *SAINT_NAMES, *PLANETOID_NAMES)
SPEC_FORMS = (*DATASET_NAMES, "saint:<name>", "npz:<path>", "csr:<dir>", "synthetic", "synthetic:<key=value,...>")


class Progress:
    """The named steps of one dataset load, each shown by :func:`bnsgcn.metrics.progress.step`."""

    def __init__(self, dataset: str, enabled: bool = True) -> None:
        self.dataset = dataset
        self.enabled = enabled

    def step(self, what: str) -> AbstractContextManager[None]:
        return step(f"{self.dataset}: {what}", enabled=self.enabled)


@dataclass(frozen=True)
class DatasetSource:
    """A dataset whose input files were found, ready to load (see :func:`resolve_dataset`)."""

    label: str  # names the dataset in progress lines
    files: tuple[Path, ...]  # every file the load reads; empty for generated graphs
    read: Callable[[Progress], Graph]

    def load(self, progress: bool = True) -> Graph:
        return self.read(Progress(self.label, progress))


def find_dataset_dir(
    data_dir: Path | None,
    subdirs: tuple[str, ...],
    required: tuple[str, ...],
    dataset: str,
    how_to_get: str,
    alternatives: Sequence[tuple[str, ...]] = (),
) -> tuple[Path, tuple[str, ...]]:
    """The first of ``<base>/<subdir>`` (in order) and ``<base>`` holding every ``required`` file.

    ``base`` is ``data_dir``, or ``./data`` when it is None. A directory holding every file
    of one of the ``alternatives`` layouts also qualifies. Returns the directory and the
    files of the first complete layout in it (``required`` first). Raises a
    :class:`UserError` naming the required files, the directories searched and
    ``how_to_get`` them when no directory qualifies.
    """
    base = Path(data_dir) if data_dir is not None else DEFAULT_DATA_DIR
    candidates = [base / sub for sub in subdirs] + [base]
    for candidate in candidates:
        for layout in (required, *alternatives):
            if all((candidate / name).is_file() for name in layout):
                return candidate, layout
    searched = " or ".join(str(c) for c in candidates)
    raise UserError(
        f"{dataset}: expected {', '.join(required)} in {searched}; {how_to_get}, "
        "or point the data directory (--data-dir) at the folder holding them"
    )


def read_split_masks(
    num_nodes: int, splits: dict[str, np.ndarray], source: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Boolean masks [N] from the node-index arrays ``splits['train'|'val'|'test']``."""
    masks = []
    for split in ("train", "val", "test"):
        index = np.asarray(splits[split]).reshape(-1)
        if index.size and (not np.issubdtype(index.dtype, np.integer) or index.min() < 0 or index.max() >= num_nodes):
            raise UserError(
                f"{source}: the {split} split holds node ids outside [0, {num_nodes}); use the split files that came "
                "with the dataset"
            )
        mask = np.zeros(num_nodes, dtype=bool)
        mask[index] = True
        masks.append(mask)
    return masks[0], masks[1], masks[2]


def random_split_masks(
    num_nodes: int, train: float, val: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A random train/val/test split: fractions ``train`` and ``val`` of the nodes, the rest test (bool [N] each)."""
    order = rng.permutation(num_nodes)
    n_train = max(1, int(round(train * num_nodes)))
    n_val = int(round(val * num_nodes))
    masks = np.zeros((3, num_nodes), dtype=bool)
    masks[0, order[:n_train]] = True
    masks[1, order[n_train : n_train + n_val]] = True
    masks[2, order[n_train + n_val :]] = True
    return masks[0], masks[1], masks[2]


def check_features(features: np.ndarray, num_nodes: int, source: str) -> np.ndarray:
    """``features`` as C-contiguous float32 [N, F]; UserError on a wrong shape or NaN/inf."""
    if features.ndim != 2 or features.shape[0] != num_nodes:
        raise UserError(
            f"{source}: features have shape {features.shape}, expected [{num_nodes}, F]; the file does not match the "
            "graph"
        )
    if not (np.issubdtype(features.dtype, np.number) or features.dtype == np.bool_) or np.iscomplexobj(features):
        raise UserError(
            f"{source}: features have dtype {features.dtype}, expected real numbers; re-export them as float32"
        )
    features = np.ascontiguousarray(features, dtype=np.float32)
    # Row blocks keep the temporary boolean array small on large feature matrices.
    rows = max(1, (1 << 24) // max(1, features.shape[1]))
    for start in range(0, num_nodes, rows):
        block = features[start : start + rows]
        finite = np.isfinite(block)
        if not finite.all():
            node = start + int(np.argwhere(~finite)[0, 0])
            raise UserError(
                f"{source}: features contain NaN or infinite values (first at node {node}); clean the features (fill "
                "or drop those values) and try again"
            )
    return features


def _check_labels(labels: np.ndarray, num_nodes: int, num_classes: int, multilabel: bool, source: str) -> np.ndarray:
    expected = f"[{num_nodes}, {num_classes}]" if multilabel else f"[{num_nodes}]"
    if labels.shape != ((num_nodes, num_classes) if multilabel else (num_nodes,)):
        raise UserError(
            f"{source}: labels have shape {labels.shape}, expected {expected}; the file does not match the graph"
        )
    if labels.size and not np.issubdtype(labels.dtype, np.integer) and not np.issubdtype(labels.dtype, np.bool_):
        if not np.issubdtype(labels.dtype, np.floating) or not np.all(labels == np.round(labels)):
            raise UserError(
                f"{source}: labels have dtype {labels.dtype} with non-integer values; labels must be class ids"
            )
    if multilabel:
        if labels.size and (labels.min() < 0 or labels.max() > 1):
            raise UserError(f"{source}: multi-label targets must be 0 or 1; fix the label file")
        return np.ascontiguousarray(labels, dtype=np.uint8)
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        bad = int(np.argmax((labels < 0) | (labels >= num_classes)))
        raise UserError(
            f"{source}: label {labels[bad]} of node {bad} is outside [0, {num_classes}); fix the labels or the class "
            "count"
        )
    return np.ascontiguousarray(labels, dtype=np.int64)


# A single-label class count above both is refused unless --num-classes confirms it.
CLASS_COUNT_FLOOR = 32
CLASS_COUNT_RATIO = 2


def with_class_count(graph: Graph, num_classes: int | None, source: str) -> Graph:
    """``graph`` with ``num_classes`` classes (``bnsgcn-partition --num-classes``), or with its
    own count (the largest label + 1, or what the dataset declares) when None.

    Its own count is refused when it is over :data:`CLASS_COUNT_FLOOR` and over
    :data:`CLASS_COUNT_RATIO` times the number of distinct labels: one stray label (10,000,000
    among labels 0..40) would otherwise make the output layer and the logits that wide.
    Multi-label targets have one column per class; ``num_classes`` must match it.
    """
    if graph.multilabel:
        if num_classes is not None and num_classes != graph.num_classes:
            raise UserError(
                f"{source}: --num-classes {num_classes}, but the multi-label targets have {graph.num_classes} "
                "columns, one per class; drop --num-classes"
            )
        return graph
    if num_classes is not None:
        _check_labels(graph.labels, graph.num_nodes, num_classes, False, source)
        return replace(graph, num_classes=num_classes)
    classes, labels = graph.num_classes, graph.labels
    if classes <= CLASS_COUNT_FLOOR:
        return graph
    # Distinct labels by counting (O(N), no sort) while the count array stays within 2N entries.
    if classes <= 2 * labels.size:
        distinct = int(np.count_nonzero(np.bincount(labels, minlength=classes)))
    else:
        distinct = int(np.unique(labels).size)
    if classes > CLASS_COUNT_RATIO * distinct:
        largest = int(labels.max()) if labels.size else 0
        raise UserError(
            f"{source}: {classes:,} classes but only {distinct:,} distinct labels (the largest {largest:,}); a class "
            f"count over {CLASS_COUNT_FLOOR} and over {CLASS_COUNT_RATIO}x the distinct labels is refused as a likely "
            f"stray label (the output layer and logits would be {classes:,} wide); fix the labels, or pass "
            f"--num-classes {classes} if there are that many classes"
        )
    return graph


def _check_masks(
    masks: tuple[np.ndarray, np.ndarray, np.ndarray], num_nodes: int, source: str
) -> tuple[np.ndarray, ...]:
    checked = []
    for split, mask in zip(("train", "val", "test"), masks):
        if mask.shape != (num_nodes,) or mask.dtype != np.bool_:
            raise UserError(
                f"{source}: {split} mask has shape {mask.shape} and dtype {mask.dtype}, expected bool [{num_nodes}]; "
                "store each mask as a boolean array with one entry per node (e.g. mask.astype(bool))"
            )
        checked.append(np.ascontiguousarray(mask))
    train, val, test = checked
    if not train.any():
        raise UserError(f"{source}: the training split is empty; provide a split with training nodes")
    if (train & val).any() or (train & test).any() or (val & test).any():
        raise UserError(f"{source}: the train/val/test splits overlap; each node may be in at most one split")
    return train, val, test


def build_graph(
    name: str,
    src: np.ndarray,
    dst: np.ndarray,
    features: np.ndarray,
    labels: np.ndarray,
    masks: tuple[np.ndarray, np.ndarray, np.ndarray],
    num_classes: int,
    source: str,
    progress: Progress,
    multilabel: bool = False,
    symmetrized: bool | None = None,
    feature_preprocessing: dict | None = None,
    feature_stats: dict[str, np.ndarray] | None = None,
) -> Graph:
    """Validate what a loader read and return the canonical :class:`Graph`.

    Args:
        src, dst: edge list ``src[e] -> dst[e]``, any integer dtype, [E].
        features: [N, F] real; labels: [N] class ids or [N, C] 0/1 when ``multilabel``.
        masks: (train, val, test), bool [N] each, pairwise disjoint, train non-empty.
        source: what the user should look at when something is wrong (file or dataset).
        symmetrized: whether the source graph was directed; None: decided from the edges.
        feature_preprocessing, feature_stats: what the loader did to the features (see
            :class:`~bnsgcn.partition.graph.Graph`); None: nothing.
    """
    num_nodes = features.shape[0] if features.ndim == 2 else -1
    features = check_features(features, num_nodes, source)
    labels = _check_labels(np.asarray(labels), num_nodes, num_classes, multilabel, source)
    train, val, test = _check_masks(masks, num_nodes, source)
    src, dst = np.asarray(src).reshape(-1), np.asarray(dst).reshape(-1)
    if src.shape != dst.shape:
        raise UserError(f"{source}: edge sources and destinations differ in length; the edge file is damaged")
    if src.size and (min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= num_nodes):
        raise UserError(
            f"{source}: edges refer to nodes outside [0, {num_nodes}); the edge file does not match the node files"
        )
    with progress.step(f"canonicalising {src.size:,} edges"):
        indptr, indices, was_directed = canonical_csr(src, dst, num_nodes)
    return Graph(
        name=name,
        indptr=indptr,
        indices=indices,
        features=features,
        labels=labels,
        train_mask=train,
        val_mask=val,
        test_mask=test,
        num_classes=int(num_classes),
        multilabel=multilabel,
        symmetrized=was_directed if symmetrized is None else symmetrized,
        feature_preprocessing=feature_preprocessing or {"kind": "none"},
        feature_stats=feature_stats,
    )


def resolve_dataset(spec: str, data_dir: Path | None) -> DatasetSource:
    """Find the files of the dataset named by ``spec``; nothing is read yet.

    ``spec`` is one of ``reddit``, ``ogbn-products``, ``ogbn-arxiv``, ``ogbn-papers100M``,
    ``yelp``, ``cora``, ``citeseer``, ``pubmed`` (files under ``data_dir``, default
    ``./data``), ``saint:<name>`` (any GraphSAINT-format directory), ``npz:<path>``,
    ``csr:<dir>`` (a canonical CSR as ``.npy`` files, memory-mapped), or
    ``synthetic[:key=value,...]``. Nothing is downloaded here (see :mod:`.download`).
    Raises :class:`UserError` for an unknown spec or missing files.
    """
    # Loaders are imported on use: the OGB reader pulls in pandas and ogb, the others need nothing.
    kind, _, argument = spec.partition(":")
    name = {n.lower(): n for n in DATASET_NAMES}.get(spec.lower())
    if name == "reddit":
        from .reddit import locate_reddit

        return locate_reddit(data_dir)
    if name in OGB_NAMES:
        from .ogb import locate_ogb

        return locate_ogb(name, data_dir)
    if name in SAINT_NAMES or (kind == "saint" and argument):
        from .saint import locate_saint

        return locate_saint(name or argument, data_dir)
    if name in PLANETOID_NAMES:
        from .planetoid import locate_planetoid

        return locate_planetoid(name, data_dir)
    if kind == "npz" and argument:
        from .npz import locate_npz

        return locate_npz(Path(argument), data_dir)
    if kind == "csr" and argument:
        from .csr import locate_csr

        return locate_csr(Path(argument), data_dir)
    if kind == "synthetic":
        from .synthetic import locate_synthetic

        return locate_synthetic(argument)
    raise UserError(f"unknown dataset {spec!r}; choose one of {', '.join(SPEC_FORMS)}")


def load_dataset(spec: str, data_dir: Path | None, progress: bool = True) -> Graph:
    """Load the dataset named by ``spec`` (see :func:`resolve_dataset`) as a canonical :class:`Graph`."""
    return resolve_dataset(spec, data_dir).load(progress)
