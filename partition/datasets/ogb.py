"""ogbn-arxiv, ogbn-products and ogbn-papers100M from a local OGB dataset folder.

The ``ogb`` package is not used to read them, so nothing can start a download or ask a
question: files are read with pandas and numpy. ``data_dir`` is the ``root`` given to
OGB (holding ``ogbn_arxiv/`` ...) or the dataset folder itself (``ogbn_arxiv/``, or
``arxiv/`` as unzipped from ``arxiv.zip``). Two layouts inside the dataset folder:

* raw, as distributed: ``raw/edge.csv.gz`` (src, dst per line), ``raw/node-feat.csv.gz``,
  ``raw/node-label.csv.gz``, ``raw/num-node-list.csv.gz``; ogbn-papers100M ships
  ``raw/data.npz`` (``edge_index`` [2, E], ``node_feat``, ``num_nodes_list``) and
  ``raw/node-label.npz`` (``node_label``) instead.
* processed, as OGB saves it after its first load: ``processed/data_processed`` (a torch
  zip file holding numpy arrays only; read with the restricted unpickler of the Planetoid
  loader, never with ``torch.load``), used when the raw files are gone.

Both need the split files ``split/<time|sales_ranking>/{train,valid,test}.csv.gz``.
Directed graphs (arxiv, papers100M citations) are symmetrised. Nodes without a label
(NaN, most of ogbn-papers100M) get label 0 and belong to no split.
"""

from __future__ import annotations

import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bnsgcn.errors import UserError
from partition.graph import Graph

from . import Progress, build_graph, find_dataset_dir, read_split_masks
from .npz import NpzArrays
from .planetoid import restricted_unpickle

HOW_TO_GET = (
    "get the dataset from https://ogb.stanford.edu (e.g. run NodePropPredDataset(name, root=DIR) "
    "from the ogb package once on a machine with internet access) and copy the folder"
)
PROCESSED_FILE = "processed/data_processed"


@dataclass(frozen=True)
class OgbInfo:
    num_classes: int
    split: str  # folder under split/
    download_name: str  # folder name inside the distributed zip
    directed: bool
    binary: bool  # raw files are .npz rather than .csv.gz


OGB_DATASETS = {
    "ogbn-arxiv": OgbInfo(40, "time", "arxiv", directed=True, binary=False),
    "ogbn-products": OgbInfo(47, "sales_ranking", "products", directed=False, binary=False),
    "ogbn-papers100M": OgbInfo(172, "time", "papers100M-bin", directed=True, binary=True),
}


def _split_files(info: OgbInfo) -> tuple[str, ...]:
    return tuple(f"split/{info.split}/{split}.csv.gz" for split in ("train", "valid", "test"))


def _raw_files(info: OgbInfo) -> tuple[str, ...]:
    if info.binary:
        return ("raw/data.npz", "raw/node-label.npz")
    return ("raw/edge.csv.gz", "raw/node-feat.csv.gz", "raw/node-label.csv.gz", "raw/num-node-list.csv.gz")


def _read_csv(path: Path, dtype: type) -> np.ndarray:
    """A headerless gzipped CSV as a 2-D array."""
    import pandas as pd

    try:
        return pd.read_csv(path, compression="gzip", header=None, dtype=dtype).to_numpy()
    except (ValueError, OSError, EOFError, zlib.error) as exc:  # pandas' parser errors are ValueErrors
        raise UserError(f"{path} is not a readable gzipped CSV of numbers ({exc}); download the dataset again") from None


def _read_raw_csv(folder: Path, progress: Progress) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(edge_index [2, E], features [N, F], labels [N] float with NaN = unlabelled)."""
    raw = folder / "raw"
    num_nodes = _read_csv(raw / "num-node-list.csv.gz", np.int64).reshape(-1)
    with progress.step(f"reading {raw / 'edge.csv.gz'}"):
        edges = _read_csv(raw / "edge.csv.gz", np.int64)
    with progress.step(f"reading {raw / 'node-feat.csv.gz'}"):
        features = _read_csv(raw / "node-feat.csv.gz", np.float32)
    labels = _read_csv(raw / "node-label.csv.gz", np.float64)
    if num_nodes.shape != (1,) or edges.ndim != 2 or edges.shape[1] != 2:
        raise UserError(f"{raw}: num-node-list.csv.gz must hold one count and edge.csv.gz two columns; download the dataset again")
    if features.shape[0] != num_nodes[0]:
        raise UserError(f"{raw / 'node-feat.csv.gz'} has {features.shape[0]} rows for {num_nodes[0]} nodes; download the dataset again")
    return edges.T, features, labels


def _read_raw_binary(folder: Path, progress: Progress) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    raw = folder / "raw"
    with progress.step(f"reading {raw / 'data.npz'}"), NpzArrays(raw / "data.npz") as data:
        edges, features, num_nodes = data["edge_index"], data["node_feat"], data["num_nodes_list"]
    with NpzArrays(raw / "node-label.npz") as label_file:
        labels = label_file["node_label"]
    if num_nodes.shape != (1,) or features.shape[0] != num_nodes[0]:
        raise UserError(f"{raw / 'data.npz'}: node_feat has {features.shape[0]} rows for num_nodes_list {num_nodes}; download the dataset again")
    return edges, features, labels


def _read_processed(folder: Path, progress: Progress) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    path = folder / PROCESSED_FILE
    with progress.step(f"reading {path}"):
        try:
            with zipfile.ZipFile(path) as archive:
                pickles = [name for name in archive.namelist() if name.endswith("/data.pkl")]
                if len(pickles) != 1:
                    raise UserError(f"{path} is not a torch zip file with one data.pkl; delete processed/ and keep the raw/ files instead")
                with archive.open(pickles[0]) as handle:
                    content = restricted_unpickle(handle, str(path))
        except (zipfile.BadZipFile, OSError) as exc:
            raise UserError(f"{path} cannot be read ({exc}); delete processed/ and keep the raw/ files instead") from None
    try:
        graph, labels = content["graph"], content["labels"]
        return np.asarray(graph["edge_index"]), np.asarray(graph["node_feat"]), np.asarray(labels)
    except (TypeError, KeyError, IndexError):
        raise UserError(f"{path} does not hold OGB's graph and labels; delete processed/ and keep the raw/ files instead") from None


def labels_and_masks(raw_labels: np.ndarray, splits: dict[str, np.ndarray], source: str) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Class ids [N] (0 where unlabelled) and split masks [N] restricted to labelled nodes.

    ``raw_labels`` is [N] or [N, 1], float with NaN marking unlabelled nodes, or integer.
    """
    if raw_labels.ndim == 2 and raw_labels.shape[1] == 1:
        raw_labels = raw_labels[:, 0]
    if raw_labels.ndim != 1:
        raise UserError(f"{source}: labels have shape {raw_labels.shape}, expected one label per node; download the dataset again")
    labelled = ~np.isnan(raw_labels) if np.issubdtype(raw_labels.dtype, np.floating) else np.ones(raw_labels.shape, dtype=bool)
    labels = np.where(labelled, raw_labels, 0)
    masks = read_split_masks(raw_labels.shape[0], splits, source)
    return labels, (masks[0] & labelled, masks[1] & labelled, masks[2] & labelled)


def load_ogb(name: str, data_dir: Path | None, progress: Progress) -> Graph:
    """Read an OGB node-property dataset from local files (raw layout preferred)."""
    info = OGB_DATASETS[name]
    folder = find_dataset_dir(
        data_dir,
        (name.replace("-", "_"), info.download_name),
        _raw_files(info) + _split_files(info),
        name,
        HOW_TO_GET,
        alternative=(PROCESSED_FILE, *_split_files(info)),
    )
    if all((folder / file).is_file() for file in _raw_files(info)):
        reader = _read_raw_binary if info.binary else _read_raw_csv
    else:
        reader = _read_processed
    edges, features, raw_labels = reader(folder, progress)
    if edges.ndim != 2 or edges.shape[0] != 2:
        raise UserError(f"{folder}: edge_index has shape {edges.shape}, expected [2, E]; download the dataset again")
    split_dir = folder / "split" / info.split
    splits = {split: _read_csv(split_dir / f"{file}.csv.gz", np.int64) for split, file in (("train", "train"), ("val", "valid"), ("test", "test"))}
    labels, masks = labels_and_masks(raw_labels, splits, f"{name} ({folder})")
    return build_graph(name, edges[0], edges[1], features, labels, masks, info.num_classes, f"{name} ({folder})", progress, symmetrized=info.directed)
