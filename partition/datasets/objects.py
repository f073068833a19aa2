"""Graphs handed over in Python (``bnsgcn.partition(graph, ...)``), turned into a :class:`DatasetSource`.

Each form is recognised by its attributes, never by its type, so no graph library is
imported here and none has to be installed:

* an OGB node-property dataset: ``get_idx_split()`` (``train``/``valid``/``test`` node ids)
  and ``dataset[0]``, which is ``(graph dict, labels)`` (``NodePropPredDataset``: the dict
  holds ``edge_index`` [2, E], ``node_feat`` [N, F], ``num_nodes``), ``(DGL graph, labels)``
  (``DglNodePropPredDataset``) or a PyG ``Data`` (``PygNodePropPredDataset``);
* a PyG ``Data``: ``edge_index`` [2, E] (source row first), ``x`` [N, F], ``y`` [N], [N, 1]
  or [N, C] (multi-label), ``train_mask``/``val_mask``/``test_mask`` [N];
* a DGL graph: ``edges()`` -> (sources, destinations), ``ndata`` with ``feat``, ``label``,
  ``train_mask``, ``val_mask``, ``test_mask``;
* an adjacency: anything with ``tocsr()`` (a scipy sparse matrix or array), an
  ``(indptr, indices)`` pair of CSR arrays, or an edge list [2, E] (sources first) as one
  array; its features, labels and split come as arguments.

Arrays may be numpy arrays, torch tensors (on any device) or anything ``numpy.asarray``
takes. ``features``, ``labels`` and ``split`` given as arguments replace what the object
holds. Float labels with NaN mark unlabelled nodes (ogbn-papers100M): they get label 0 and
belong to no split. The graph is validated and canonicalised by :func:`build_graph`, as
every file loader's is; its spec in the manifest is ``memory:<hash of the graph>``, so the
same call again reuses the set and a changed graph is refused without ``force``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np

from bnsgcn.errors import UserError
from bnsgcn.partition.graph import Graph

from . import DatasetSource, Progress, build_graph, read_split_masks
from .ogb import labels_and_masks

SPLIT_NAMES = ("train", "val", "test")
SPLIT_ALIASES = {"train": ("train",), "val": ("val", "valid"), "test": ("test",)}  # OGB says "valid"
DGL_KEYS = {"features": "feat", "labels": "label"}


def _numpy(value: object) -> np.ndarray:
    """``value`` as a numpy array: a torch tensor is detached and brought to the CPU first, a
    sparse matrix (``toarray``) made dense."""
    if hasattr(value, "detach"):  # torch.Tensor, without importing torch
        value = value.detach().cpu().numpy()
    elif hasattr(value, "toarray"):
        value = value.toarray()
    return np.asarray(value)


def _attribute(obj: object, name: str) -> object:
    """``obj.name``, or ``obj[name]`` for mappings (PyG ``Data`` supports both; a dict only the second)."""
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def _split_arrays(split: Mapping, source: str) -> dict[str, object]:
    """``split``'s train/val/test entries (``valid`` is read as ``val``)."""
    found = {}
    for name, aliases in SPLIT_ALIASES.items():
        key = next((alias for alias in aliases if split.get(alias) is not None), None)
        if key is None:
            present = ", ".join(repr(k) for k, v in split.items() if v is not None) or "none"
            raise UserError(
                f"{source}: the split has no {name!r} entry (it has {present}); pass "
                "split={'train': ..., 'val': ..., 'test': ...}, each a bool mask [N] or node ids"
            )
        found[name] = split[key]
    return found


def _split_ids(split: dict[str, object], num_nodes: int, source: str) -> dict[str, np.ndarray]:
    """Node ids per split from bool masks [N] or node-id arrays."""
    ids = {}
    for name, value in split.items():
        array = _numpy(value)
        if array.dtype == np.bool_:
            if array.shape != (num_nodes,):
                more = " (one column per split: pick one, e.g. mask[:, 0])" if array.ndim == 2 else ""
                raise UserError(
                    f"{source}: the {name} mask has shape {list(array.shape)}, expected [{num_nodes}]{more}; pass "
                    "one bool mask per split"
                )
            array = np.flatnonzero(array)
        ids[name] = array
    return ids


def _masks_of(obj: object) -> dict[str, object] | None:
    """The object's own ``train_mask``/``val_mask``/``test_mask``, or None when it has none of them."""
    masks = {name: _attribute(obj, f"{name}_mask") for name in SPLIT_NAMES}
    return masks if any(m is not None for m in masks.values()) else None


def _ogb_parts(dataset: object) -> tuple[object, object | None, dict]:
    """``(graph, labels or None, split)`` of an OGB node-property dataset object."""
    item = dataset[0]
    split = dict(dataset.get_idx_split())
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return item[0], item[1], split
    return item, None, split


def _read(graph: object, source: str) -> tuple[np.ndarray, np.ndarray, int | None, dict[str, object]]:
    """Edges (sources, destinations), the node count where the form says it, and what the
    object holds of ``features``, ``labels`` and ``split`` (None where it holds nothing)."""
    held: dict[str, object] = {}
    if callable(getattr(graph, "tocsr", None)) or (
        isinstance(graph, (tuple, list)) and len(graph) == 2 and not isinstance(graph[0], Mapping)
    ):
        if callable(getattr(graph, "tocsr", None)):
            csr = graph.tocsr()
            shape = tuple(csr.shape)
            if len(shape) != 2 or shape[0] != shape[1]:
                raise UserError(f"{source}: the adjacency has shape {shape}; it must be square, [N, N]")
            indptr, indices = _numpy(csr.indptr), _numpy(csr.indices)
            data = _numpy(csr.data) if getattr(csr, "data", None) is not None else None
        else:
            indptr, indices, data = _numpy(graph[0]), _numpy(graph[1]), None
        indptr = indptr.astype(np.int64, copy=False)
        num_nodes = indptr.shape[0] - 1
        if indptr.ndim != 1 or num_nodes < 0 or indptr[0] != 0 or indptr[-1] != indices.shape[0]:
            raise UserError(
                f"{source}: indptr and indices do not form a CSR matrix (indptr [N+1] from 0 to len(indices)); "
                "pass (indptr, indices) of a CSR adjacency"
            )
        if np.any(np.diff(indptr) < 0):
            raise UserError(f"{source}: indptr decreases; pass the row pointer of a CSR adjacency")
        rows = np.repeat(np.arange(num_nodes, dtype=np.int64), np.diff(indptr))
        keep = data != 0 if data is not None else slice(None)  # explicitly stored zeros are not edges
        # row v holds v's in-edges u -> v (the canonical graph is symmetric either way)
        return indices[keep], rows[keep], num_nodes, held
    shape = getattr(graph, "shape", None)
    if shape is not None and len(shape) == 2 and shape[0] == 2:  # an edge list [2, E], as PyG's edge_index
        edges = _numpy(graph)
        return edges[0], edges[1], None, held
    if callable(getattr(graph, "edges", None)) and hasattr(graph, "ndata"):  # DGL
        if len(getattr(graph, "ntypes", ())) > 1:
            raise UserError(f"{source}: a heterogeneous DGL graph; pass a graph with one node and one edge type")
        src, dst = graph.edges()
        for ours, theirs in DGL_KEYS.items():
            held[ours] = graph.ndata[theirs] if theirs in graph.ndata else None
        held["split"] = _masks_of(graph.ndata)
        return _numpy(src), _numpy(dst), int(graph.num_nodes()), held
    edge_index = _attribute(graph, "edge_index")
    if edge_index is not None:  # PyG Data, or an OGB graph dict
        edges = _numpy(edge_index)
        if edges.ndim != 2 or edges.shape[0] != 2:
            raise UserError(f"{source}: edge_index has shape {list(edges.shape)}, expected [2, E]")
        held["features"] = _attribute(graph, "x")
        if held["features"] is None:
            held["features"] = _attribute(graph, "node_feat")
        held["labels"] = _attribute(graph, "y")
        held["split"] = _masks_of(graph)
        num_nodes = _attribute(graph, "num_nodes")
        return edges[0], edges[1], None if num_nodes is None else int(num_nodes), held
    raise UserError(
        f"{source}: not a graph bnsgcn reads: pass a PyG Data, a DGL graph, an OGB node-property dataset, a sparse "
        "adjacency, an (indptr, indices) pair or an edge list [2, E] (with features=, labels=, split=), or a dataset "
        "name as a string"
    )


def graph_source(
    graph: object,
    *,
    features: object = None,
    labels: object = None,
    split: Mapping | None = None,
    name: str | None = None,
    progress: bool = True,
) -> tuple[DatasetSource, str]:
    """The graph ``graph`` (any form of the module) as a loaded :class:`DatasetSource`, and its spec
    ``memory:<hash>``. ``features`` [N, F], ``labels`` [N] or [N, C] and ``split`` (``train``,
    ``val``, ``test``: each a bool mask [N] or node ids) replace what ``graph`` holds.

    Raises :class:`UserError` naming what is missing or malformed.
    """
    declared = None
    if callable(getattr(graph, "get_idx_split", None)) and hasattr(graph, "__getitem__"):
        name = name or getattr(graph, "name", None)
        declared = getattr(graph, "num_classes", None)
        inner, ogb_labels, ogb_split = _ogb_parts(graph)
        form = "OGB dataset"
        src, dst, num_nodes, held = _read(inner, f"{name or 'graph'} ({form})")
        held["labels"] = ogb_labels if ogb_labels is not None else held.get("labels")
        held["split"] = ogb_split
    else:
        form = "PyG Data" if _attribute(graph, "edge_index") is not None else type(graph).__name__
        if hasattr(graph, "ndata"):
            form = "DGL graph"
        src, dst, num_nodes, held = _read(graph, f"{name or 'graph'} ({form})")
    name = str(name or "graph")
    source = f"{name} ({form})"
    features = held.get("features") if features is None else features
    labels = held.get("labels") if labels is None else labels
    split = held.get("split") if split is None else split
    for what, value, hint in (
        ("features", features, "features=X (float [N, F])"),
        ("labels", labels, "labels=y (class ids [N], or 0/1 [N, C] for multi-label)"),
        ("split", split, "split={'train': ..., 'val': ..., 'test': ...} (bool masks [N] or node ids)"),
    ):
        if value is None:
            raise UserError(f"{source}: no {what}; pass {hint}")
    features = _numpy(features)
    if features.ndim == 1:
        features = features[:, None]
    num_nodes = features.shape[0] if num_nodes is None else num_nodes
    if features.shape[0] != num_nodes:
        raise UserError(
            f"{source}: features have {features.shape[0]} rows but the graph has {num_nodes} nodes; pass one row per "
            "node"
        )
    if not isinstance(split, Mapping):
        raise UserError(f"{source}: split is {type(split).__name__}; pass a dict with 'train', 'val' and 'test'")
    ids = _split_ids(_split_arrays(split, source), num_nodes, source)
    raw_labels = _numpy(labels)
    if raw_labels.ndim == 2 and raw_labels.shape[1] == 1:
        raw_labels = raw_labels[:, 0]
    multilabel = raw_labels.ndim == 2
    if multilabel:
        masks = read_split_masks(num_nodes, ids, source)
        class_labels, num_classes = raw_labels, raw_labels.shape[1]
    else:
        class_labels, masks = labels_and_masks(raw_labels, ids, source)
        found = int(class_labels.max()) + 1 if class_labels.size and np.isfinite(class_labels.max()) else 1
        num_classes = int(declared) if isinstance(declared, (int, np.integer)) and declared >= found else found
    converted = build_graph(
        name,
        src,
        dst,
        features,
        class_labels,
        masks,
        num_classes,
        source,
        Progress(name, progress),
        multilabel=multilabel,
    )
    return DatasetSource(label=name, files=(), read=lambda _progress: converted), f"memory:{graph_digest(converted)}"


def graph_digest(graph: Graph) -> str:
    """16 hex digits of the SHA-256 of everything a partition set keeps of ``graph``."""
    digest = hashlib.sha256(f"{graph.name}:{graph.num_classes}:{graph.multilabel}".encode())
    for array in (
        graph.indptr,
        graph.indices,
        graph.features,
        graph.labels,
        graph.train_mask,
        graph.val_mask,
        graph.test_mask,
    ):
        digest.update(str((array.dtype, array.shape)).encode())
        digest.update(memoryview(np.ascontiguousarray(array)).cast("B"))
    return digest.hexdigest()[:16]
