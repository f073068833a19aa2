"""Reddit (GraphSAGE posts graph) in the layout DGL distributes as ``reddit.zip``.

Files, in ``<data_dir>/reddit`` or ``<data_dir>``:

* ``reddit_data.npz``: ``feature`` float [N, 602], ``label`` int [N] (41 classes),
  ``node_types`` int [N] with 1 = train, 2 = val, 3 = test.
* ``reddit_graph.npz``: the adjacency as written by ``scipy.sparse.save_npz`` (COO or CSR).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from bnsgcn.errors import UserError
from bnsgcn.partition.graph import Graph

from . import DatasetSource, Progress, build_graph, find_dataset_dir
from .npz import NpzArrays, read_sparse

HOW_TO_GET = (
    "pass --download to fetch them, or download reddit.zip from https://data.dgl.ai/dataset/reddit.zip (DGL's Reddit "
    "data) and unzip it"
)
FILES = ("reddit_data.npz", "reddit_graph.npz")


def locate_reddit(data_dir: Path | None) -> DatasetSource:
    root, files = find_dataset_dir(data_dir, ("reddit",), FILES, "reddit", HOW_TO_GET)
    return DatasetSource("reddit", tuple(root / file for file in files), partial(read_reddit, root))


def read_reddit(root: Path, progress: Progress) -> Graph:
    """Read Reddit from ``root``; the split comes from ``node_types`` (1 train, 2 val, 3 test)."""
    data_file, graph_file = root / FILES[0], root / FILES[1]
    with progress.step(f"reading {data_file}"), NpzArrays(data_file) as data:
        features = data["feature"]
        labels = data["label"]
        node_types = data["node_types"]
    with progress.step(f"reading {graph_file}"), NpzArrays(graph_file) as adjacency:
        src, dst, _, shape = read_sparse(adjacency)
    num_nodes = features.shape[0]
    if shape != (num_nodes, num_nodes) or node_types.shape != (num_nodes,):
        raise UserError(
            f"reddit: {graph_file.name} ({shape}) and {data_file.name} ({num_nodes} nodes) do not match; unzip both "
            "files from the same reddit.zip"
        )
    masks = (node_types == 1, node_types == 2, node_types == 3)
    num_classes = int(labels.max()) + 1 if labels.size else 1
    return build_graph("reddit", src, dst, features, labels, masks, num_classes, f"reddit ({data_file})", progress)
