"""The in-memory graph every dataset loader returns, and the one canonicalisation step."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Graph:
    """A node-classification graph, canonical form.

    ``indptr``/``indices`` are the CSR of in-edges: ``indices[indptr[v]:indptr[v+1]]`` are
    the sources ``u`` of the edges ``u -> v``, ascending. Canonical means symmetric, no
    self-loops, no duplicate edges (see :func:`canonical_csr`); self-loops are added back
    by the partition writer.

    ``feature_preprocessing`` says what the loader did to the features (``{"kind": "none"}``: used
    as given); a loader that standardises puts the statistics in ``feature_stats``.

    Shapes: ``indptr`` int64 [N+1], ``indices`` int32 [E] (E counts each direction),
    ``features`` float32 [N, F], ``labels`` int64 [N] or uint8 [N, C] when ``multilabel``,
    masks bool [N].
    """

    name: str
    indptr: np.ndarray
    indices: np.ndarray
    features: np.ndarray
    labels: np.ndarray
    train_mask: np.ndarray
    val_mask: np.ndarray
    test_mask: np.ndarray
    num_classes: int
    multilabel: bool = False
    symmetrized: bool = False  # True when the source graph was directed
    # what the loader did to the features: the manifest's dataset.feature_preprocessing
    # (docs/partition-format.md); ``feature_stats`` the arrays its "standardise" needs (mean, std)
    feature_preprocessing: dict = field(default_factory=lambda: {"kind": "none"})
    feature_stats: dict[str, np.ndarray] | None = None

    @property
    def num_nodes(self) -> int:
        return int(self.indptr.shape[0] - 1)

    @property
    def num_edges(self) -> int:
        return int(self.indices.shape[0])

    def in_degree(self) -> np.ndarray:
        """In-degree without self-loops, int64 [N]."""
        return np.diff(self.indptr)


def _sorted_unique(keys: np.ndarray) -> np.ndarray:
    """``np.unique`` by one sort and a mask (np.unique is many times slower on large arrays)."""
    keys = np.sort(keys)
    if keys.size == 0:
        return keys
    return keys[np.concatenate(([True], keys[1:] != keys[:-1]))]


def canonical_csr(src: np.ndarray, dst: np.ndarray, num_nodes: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """Symmetrise, drop self-loops and duplicates; return (indptr, indices, was_directed).

    Works on edge lists of any size with O(E) extra memory: edges are encoded as one
    int64 key ``dst * N + src`` and sorted.
    """
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    keep = src != dst
    n = np.int64(num_nodes)
    forward = _sorted_unique(dst[keep] * n + src[keep])
    del src, dst, keep
    backward = np.sort((forward % n) * n + forward // n)
    was_directed = not np.array_equal(forward, backward)
    keys = _sorted_unique(np.concatenate((forward, backward))) if was_directed else forward
    del forward, backward
    dst_sorted = keys // n
    indices = (keys - dst_sorted * n).astype(np.int32)
    indptr = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst_sorted, minlength=num_nodes), out=indptr[1:])
    return indptr, indices, was_directed
