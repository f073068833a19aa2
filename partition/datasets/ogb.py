"""ogbn-arxiv, ogbn-products and ogbn-papers100M from a local OGB dataset folder, read by the ogb package.

``data_dir`` is the ``root`` given to OGB (holding ``ogbn_arxiv/`` ...) or the dataset
folder itself (``ogbn_arxiv/``, or ``arxiv/`` as unzipped from ``arxiv.zip``). The folder
is read by ``ogb.nodeproppred.NodePropPredDataset``, pointed at it through ``meta_dict``
(ogb's ``master.csv`` row plus ``dir_path``, so any of those folder names works), with
the official split of ``get_idx_split()``. The folder holds one of two layouts:

* raw, as distributed: ``raw/*.csv.gz`` (ogbn-papers100M: ``raw/data.npz`` and
  ``raw/node-label.npz``). ogb saves what it read as ``processed/data_processed`` in the
  folder, and reads that file instead whenever it exists.
* processed: ``processed/data_processed`` alone.

and the split, ``split/<time|sales_ranking>/{train,valid,test}.csv.gz`` or ``split_dict.pt``
there (which ogb prefers).

ogb downloads whatever it does not find and asks on stdin when ``RELEASE_v<version>.txt``
is missing, so it is called only after every file it needs, the release file included,
was found here. Unpickling stays restricted: ogb's ``torch.load`` of ``split_dict.pt``
runs weights-only with nothing but numpy's array globals allowed; ``data_processed`` is
written by ogb with pickle protocol 4, which torch's weights-only unpickler cannot parse,
so it is read with the restricted unpickler of the Planetoid loader instead.

Directed graphs (arxiv, papers100M citations) are symmetrised. Nodes without a label
(NaN, most of ogbn-papers100M) get label 0 and belong to no split.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import pickle
import sys
import tempfile
import zipfile
from functools import partial
from pathlib import Path

import numpy as np

from bnsgcn.errors import UserError
from bnsgcn.partition.graph import Graph

from . import DatasetSource, Progress, build_graph, find_dataset_dir, read_split_masks
from .planetoid import ALLOWED_GLOBALS, restricted_unpickle

HOW_TO_GET = (
    "pass --download to fetch them, or get the dataset from https://ogb.stanford.edu (e.g. run "
    "NodePropPredDataset(name, root=DIR) from the ogb package once on a machine with internet access) and copy the "
    "folder"
)
PROCESSED_FILE = "processed/data_processed"
REBUILD_PROCESSED = "delete it (ogb rebuilds it from raw/) or download the dataset again"
SPLIT_FILES = {"train": "train", "val": "valid", "test": "test"}  # our split name: ogb's
# What torch's weights-only unpickler must accept for split_dict.pt to hold numpy arrays:
# numpy's array globals (under both numpy 1 and 2 module names) and the dtype classes
# (numpy >= 1.25) that rebuilding a dtype checks.
NUMPY_GLOBALS = [
    (value, f"{module}.{name}") for (module, name), value in ALLOWED_GLOBALS.items() if module.startswith("numpy")
] + sorted({type(np.dtype(code)) for code in "?" + np.typecodes["AllInteger"] + np.typecodes["Float"]}, key=str)


@functools.cache
def _metadata(name: str) -> dict[str, str]:
    """ogb's ``master.csv`` row of ``name``: what NodePropPredDataset reads when given no meta_dict."""
    import pandas as pd

    # find_spec does not import ogb, which takes seconds.
    master_csv = Path(importlib.util.find_spec("ogb").origin).parent / "nodeproppred" / "master.csv"
    return {key: str(value) for key, value in pd.read_csv(master_csv, index_col=0, keep_default_na=False)[name].items()}


def _layouts(meta: dict[str, str]) -> list[tuple[str, ...]]:
    """The file sets ogb reads the dataset from: (raw or processed) x (split CSVs or split_dict.pt)."""
    if meta["binary"] == "True":
        raw = ("raw/data.npz", "raw/node-label.npz")
    else:
        extra = [
            file
            for key in ("additional node files", "additional edge files")
            for file in meta[key].split(",")
            if file != "None"
        ]
        raw = (
            "raw/edge.csv.gz",
            "raw/num-node-list.csv.gz",
            "raw/num-edge-list.csv.gz",
            "raw/node-feat.csv.gz",
            "raw/node-label.csv.gz",
            *(f"raw/{file}.csv.gz" for file in extra),
        )
    split_dir = f"split/{meta['split']}"
    splits = (tuple(f"{split_dir}/{file}.csv.gz" for file in SPLIT_FILES.values()), (f"{split_dir}/split_dict.pt",))
    return [data + split for data in (raw, (PROCESSED_FILE,)) for split in splits]


def locate_ogb(name: str, data_dir: Path | None) -> DatasetSource:
    """Find the dataset folder and check everything ogb needs, so that ogb never downloads or asks."""
    meta = _metadata(name)
    required, *alternatives = _layouts(meta)
    folder, files = find_dataset_dir(
        data_dir, (name.replace("-", "_"), meta["download_name"]), required, name, HOW_TO_GET, alternatives
    )
    release = f"RELEASE_v{meta['version']}.txt"
    if not (folder / release).is_file():
        raise UserError(
            f"{name}: {folder} has no {release}, which marks OGB's release {meta['version']} of the dataset "
            "(the ogb package would ask to download it again); copy the whole dataset folder of the current release "
            f"from https://ogb.stanford.edu, or create an empty {release} there if these files are that release"
        )
    split_dict = f"split/{meta['split']}/split_dict.pt"
    if (folder / split_dict).is_file():
        _check_safe_torch_load(folder / split_dict)
        files = tuple(dict.fromkeys((*files, split_dict)))  # ogb reads it even when the CSVs are there
    if not (folder / PROCESSED_FILE).is_file():
        _check_writable(name, folder)
    return DatasetSource(name, tuple(folder / file for file in files), partial(read_ogb, name, folder))


def _check_safe_torch_load(path: Path) -> None:
    """Only from torch 2.6 on does ogb's plain ``torch.load`` refuse arbitrary objects."""
    import torch
    from torch.torch_version import TorchVersion

    if TorchVersion(torch.__version__) < "2.6":
        raise UserError(
            f"{path} would be unpickled without restrictions by torch {torch.__version__}; upgrade torch to 2.6 "
            "or later, or delete split_dict.pt where the split CSVs are there too"
        )


def _check_writable(name: str, folder: Path) -> None:
    """ogb saves processed/data_processed after reading the raw files: fail before the read, not after it."""
    processed = folder / "processed"
    where = processed if processed.is_dir() else folder
    try:
        os.rmdir(tempfile.mkdtemp(dir=where))
    except OSError as exc:
        raise UserError(
            f"{name}: cannot write to {where} ({exc.strerror}), where the ogb package saves its processed copy of "
            f"the raw files; make it writable, or copy {folder} somewhere writable and point --data-dir there"
        ) from None


def _read_processed(path: Path) -> tuple[object, object]:
    """(graph, labels) of ogb's ``processed/data_processed``: a torch zip file whose pickle holds numpy arrays only."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [name for name in archive.namelist() if name.endswith("/data.pkl")]
            if len(pickles) != 1:
                raise UserError(f"{path} is not a torch zip file with one data.pkl; {REBUILD_PROCESSED}")
            with archive.open(pickles[0]) as handle:
                content = restricted_unpickle(handle, str(path))
    except (zipfile.BadZipFile, OSError) as exc:
        raise UserError(f"{path} cannot be read ({exc}); {REBUILD_PROCESSED}") from None
    try:
        return content["graph"], content["labels"]
    except (TypeError, KeyError):
        raise UserError(f"{path} does not hold OGB's graph and labels; {REBUILD_PROCESSED}") from None


@functools.cache
def _dataset_class() -> type:
    """ogb's NodePropPredDataset, except that ``processed/data_processed`` is read by :func:`_read_processed`."""
    # At import ogb starts a thread that asks PyPI, without a timeout, whether ogb is
    # outdated; hiding the optional package it asks with skips that network call.
    saved = sys.modules.get("outdated")
    sys.modules["outdated"] = None  # makes `import outdated` raise ImportError
    try:
        from ogb.nodeproppred.dataset import NodePropPredDataset
    finally:
        if saved is None:
            del sys.modules["outdated"]
        else:
            sys.modules["outdated"] = saved

    class LocalDataset(NodePropPredDataset):
        def pre_process(self) -> None:
            processed = Path(self.root) / PROCESSED_FILE
            if processed.is_file():
                self.graph, self.labels = _read_processed(processed)
            else:
                super().pre_process()

    return LocalDataset


def labels_and_masks(
    raw_labels: np.ndarray, splits: dict[str, np.ndarray], source: str
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Class ids [N] (0 where unlabelled) and split masks [N] restricted to labelled nodes.

    ``raw_labels`` is [N] or [N, 1], float with NaN marking unlabelled nodes, or integer.
    """
    if raw_labels.ndim == 2 and raw_labels.shape[1] == 1:
        raw_labels = raw_labels[:, 0]
    if raw_labels.ndim != 1:
        raise UserError(
            f"{source}: labels have shape {raw_labels.shape}, expected one label per node; download the dataset again"
        )
    labelled = (
        ~np.isnan(raw_labels) if np.issubdtype(raw_labels.dtype, np.floating) else np.ones(raw_labels.shape, dtype=bool)
    )
    labels = np.where(labelled, raw_labels, 0)
    masks = read_split_masks(raw_labels.shape[0], splits, source)
    return labels, (masks[0] & labelled, masks[1] & labelled, masks[2] & labelled)


def read_ogb(name: str, folder: Path, progress: Progress) -> Graph:
    """Read the OGB dataset ``name`` from ``folder`` (checked by :func:`locate_ogb`) with the ogb package."""
    import torch

    source = f"{name} ({folder})"
    # ogb prints its own progress to stdout, which bnsgcn-partition keeps for results.
    with progress.step(f"reading {folder} with the ogb package"), contextlib.redirect_stdout(sys.stderr):
        dataset_class = _dataset_class()
        try:
            (folder / "processed").mkdir(exist_ok=True)  # ogb saves into it without creating it
            dataset = dataset_class(name, meta_dict={**_metadata(name), "dir_path": str(folder)})
            with torch.serialization.safe_globals(NUMPY_GLOBALS):
                split = dataset.get_idx_split()
            edges, features = np.asarray(dataset.graph["edge_index"]), dataset.graph["node_feat"]
            splits = {ours: np.asarray(split[theirs]) for ours, theirs in SPLIT_FILES.items()}
        except UserError:
            raise
        except pickle.UnpicklingError:  # only torch.load of split_dict.pt unpickles through torch
            raise UserError(
                f"{folder}/split/{_metadata(name)['split']}/split_dict.pt holds objects other than arrays and was "
                "refused; delete it where the split CSVs are there too, or download the dataset again"
            ) from None
        except Exception as exc:  # ogb reports a damaged file with whatever pandas, numpy or torch raise
            detail = next(iter(str(exc).strip().splitlines()), "")
            raise UserError(
                f"{source}: the ogb package could not read the dataset ({type(exc).__name__}: {detail}); download the "
                "dataset again"
            ) from None
    if features is None:
        raise UserError(f"{source}: the dataset has no node features; download the dataset again")
    if edges.ndim != 2 or edges.shape[0] != 2:
        raise UserError(f"{source}: edge_index has shape {edges.shape}, expected [2, E]; download the dataset again")
    labels, masks = labels_and_masks(np.asarray(dataset.labels), splits, source)
    return build_graph(
        name,
        edges[0],
        edges[1],
        np.asarray(features),
        labels,
        masks,
        int(_metadata(name)["num classes"]),
        source,
        progress,
    )
