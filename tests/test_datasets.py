"""Dataset loaders: small files in every real format, the real Cora files, the generator, bad input."""

from __future__ import annotations

import gzip
import json
import pickle
import shutil
import sys
import types
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from bnsgcn.errors import UserError
from bnsgcn.partition.datasets import Progress, load_dataset
from bnsgcn.partition.graph import Graph

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


# ----------------------------------------------------------------------------- helpers


def edge_set(graph: Graph) -> set[tuple[int, int]]:
    """{(src, dst)} of the graph's in-edge CSR."""
    dst = np.repeat(np.arange(graph.num_nodes), graph.in_degree())
    return set(zip(graph.indices.tolist(), dst.tolist()))


def symmetric_closure(edges: list[tuple[int, int]]) -> set[tuple[int, int]]:
    return {(u, v) for a, b in edges if a != b for u, v in ((a, b), (b, a))}


def assert_canonical(graph: Graph) -> None:
    n = graph.num_nodes
    assert graph.indptr.dtype == np.int64 and graph.indices.dtype == np.int32
    assert graph.indptr[0] == 0 and graph.indptr[-1] == graph.num_edges
    dst = np.repeat(np.arange(n, dtype=np.int64), graph.in_degree())
    src = graph.indices.astype(np.int64)
    assert not np.any(src == dst), "self-loop"
    keys = dst * n + src
    assert np.all(np.diff(keys) > 0), "rows not strictly ascending (duplicate or unsorted edges)"
    assert np.array_equal(np.sort(src * n + dst), keys), "not symmetric"
    assert graph.features.dtype == np.float32 and graph.features.shape[0] == n
    for mask in (graph.train_mask, graph.val_mask, graph.test_mask):
        assert mask.dtype == np.bool_ and mask.shape == (n,)


def mask_of(n: int, nodes: list[int]) -> np.ndarray:
    mask = np.zeros(n, dtype=bool)
    mask[nodes] = True
    return mask


def save_scipy_npz(path: Path, fmt: str, row: np.ndarray, col: np.ndarray, shape: tuple[int, int]) -> None:
    """What scipy.sparse.save_npz writes, without scipy."""
    arrays = {"format": np.array(fmt.encode()), "shape": np.array(shape), "data": np.ones(len(row), dtype=np.float32)}
    if fmt == "coo":
        arrays |= {"row": np.asarray(row, dtype=np.int32), "col": np.asarray(col, dtype=np.int32)}
    else:
        order = np.lexsort((col, row))
        arrays |= {
            "indices": np.asarray(col)[order].astype(np.int32),
            "indptr": np.concatenate(([0], np.cumsum(np.bincount(row, minlength=shape[0])))).astype(np.int32),
        }
    np.savez_compressed(path, **arrays)


def write_csv_gz(path: Path, rows: np.ndarray, fmt: str = "%d") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as handle:
        np.savetxt(handle, np.atleast_2d(np.asarray(rows).T).T if np.ndim(rows) == 1 else rows, fmt=fmt, delimiter=",")


def expect_user_error(spec: str, data_dir: Path | None, *fragments: str) -> str:
    with pytest.raises(UserError) as info:
        load_dataset(spec, data_dir, progress=False)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


# ----------------------------------------------------------------------------- Reddit

REDDIT_EDGES = [(0, 1), (1, 0), (1, 2), (2, 2), (3, 4), (3, 4), (4, 5)]


def write_reddit(
    folder: Path, fmt: str = "coo", features: np.ndarray | None = None, labels: np.ndarray | None = None
) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    data = {
        "feature": rng.standard_normal((6, 4)) if features is None else features,
        "label": np.array([0, 2, 1, 2, 0, 1]) if labels is None else labels,
        "node_types": np.array([1, 1, 2, 3, 1, 3]),
    }
    np.savez_compressed(folder / "reddit_data.npz", **data)
    row, col = np.array(REDDIT_EDGES).T
    save_scipy_npz(folder / "reddit_graph.npz", fmt, row, col, (6, 6))
    return data


@pytest.mark.parametrize("fmt", ["coo", "csr"])
def test_reddit_reads_exactly_the_files(tmp_path: Path, fmt: str) -> None:
    data = write_reddit(tmp_path / "reddit", fmt)
    graph = load_dataset("reddit", tmp_path, progress=False)
    assert_canonical(graph)
    assert graph.name == "reddit" and graph.num_nodes == 6 and graph.num_classes == 3
    assert edge_set(graph) == symmetric_closure(REDDIT_EDGES)
    assert graph.symmetrized  # (1, 2) and (3, 4), (4, 5) were stored one way only
    np.testing.assert_array_equal(graph.features, data["feature"].astype(np.float32))
    np.testing.assert_array_equal(graph.labels, data["label"])
    np.testing.assert_array_equal(graph.train_mask, mask_of(6, [0, 1, 4]))
    np.testing.assert_array_equal(graph.val_mask, mask_of(6, [2]))
    np.testing.assert_array_equal(graph.test_mask, mask_of(6, [3, 5]))


def test_reddit_files_directly_in_data_dir(tmp_path: Path) -> None:
    write_reddit(tmp_path)
    assert load_dataset("reddit", tmp_path, progress=False).num_nodes == 6


# ----------------------------------------------------------------------------- GraphSAINT


def write_saint(folder: Path, multilabel: bool) -> tuple[np.ndarray, np.ndarray]:
    folder.mkdir(parents=True, exist_ok=True)
    edges = np.array([(0, 1), (1, 0), (2, 3), (3, 2), (4, 0), (0, 4)])
    save_scipy_npz(folder / "adj_full.npz", "csr", edges[:, 0], edges[:, 1], (5, 5))
    features = np.arange(15, dtype=np.float64).reshape(5, 3) ** 1.5
    features[:, 2] = 7.0  # a constant column: centred, not scaled
    np.save(folder / "feats.npy", features)
    if multilabel:
        labels = np.array([[1, 0, 1, 0], [0, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 1, 0]])
    else:
        labels = np.array([3, 0, 1, 1, 2])
    order = [4, 2, 0, 3, 1]  # class_map keys need not be in node order
    (folder / "class_map.json").write_text(json.dumps({str(v): labels[v].tolist() for v in order}))
    (folder / "role.json").write_text(json.dumps({"tr": [0, 1, 3], "va": [2], "te": [4]}))
    return features, labels


@pytest.mark.parametrize("multilabel", [False, True])
def test_saint_format(tmp_path: Path, multilabel: bool) -> None:
    features, labels = write_saint(tmp_path / "yelp", multilabel)
    graph = load_dataset("yelp", tmp_path, progress=False)
    assert_canonical(graph)
    assert graph.name == "yelp" and graph.multilabel == multilabel
    assert edge_set(graph) == symmetric_closure([(0, 1), (2, 3), (4, 0)])
    assert not graph.symmetrized
    train = features[[0, 1, 3]]
    scale = train.std(axis=0)
    scale[scale == 0] = 1.0
    np.testing.assert_allclose(graph.features, (features - train.mean(axis=0)) / scale, rtol=1e-5, atol=1e-5)
    assert np.all(graph.features[:, 2] == 0)
    if multilabel:
        assert graph.labels.dtype == np.uint8 and graph.num_classes == 4
    else:
        assert graph.labels.dtype == np.int64 and graph.num_classes == 4
    np.testing.assert_array_equal(graph.labels, labels)
    np.testing.assert_array_equal(graph.train_mask, mask_of(5, [0, 1, 3]))
    np.testing.assert_array_equal(graph.val_mask, mask_of(5, [2]))
    np.testing.assert_array_equal(graph.test_mask, mask_of(5, [4]))


def test_saint_any_named_directory(tmp_path: Path) -> None:
    write_saint(tmp_path / "flickr", multilabel=False)
    assert load_dataset("saint:flickr", tmp_path, progress=False).name == "flickr"
    assert load_dataset(f"saint:{tmp_path / 'flickr'}", None, progress=False).num_nodes == 5


# ----------------------------------------------------------------------------- OGB
# Tiny folders in each layout the ogb package reads; every load goes through ogb itself.

ARXIV_EDGES = np.array([(0, 1), (1, 2), (2, 0), (3, 1), (4, 4), (5, 3), (0, 1)])
ARXIV_SPLIT = {"train": [0, 1, 2], "valid": [3], "test": [4, 5]}


def write_split(folder: Path, split: dict[str, list[int]]) -> None:
    for part, nodes in split.items():
        write_csv_gz(folder / f"{part}.csv.gz", np.array(nodes).reshape(-1, 1))


def write_ogb_raw(folder: Path, labels: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """An ogbn-arxiv-like dataset folder in OGB's raw CSV layout, release file included."""
    features = np.round(np.random.default_rng(3).standard_normal((6, 3)), 4)
    labels = np.array([0, 39, 5, 5, 12, 7]) if labels is None else labels
    write_csv_gz(folder / "raw" / "edge.csv.gz", ARXIV_EDGES)
    write_csv_gz(folder / "raw" / "node-feat.csv.gz", features, fmt="%.4f")
    write_csv_gz(folder / "raw" / "node-label.csv.gz", labels.reshape(-1, 1))
    write_csv_gz(folder / "raw" / "node_year.csv.gz", np.arange(2000, 2006).reshape(-1, 1))
    write_csv_gz(folder / "raw" / "num-node-list.csv.gz", np.array([[6]]))
    write_csv_gz(folder / "raw" / "num-edge-list.csv.gz", np.array([[len(ARXIV_EDGES)]]))
    write_split(folder / "split" / "time", ARXIV_SPLIT)
    (folder / "RELEASE_v1.txt").write_text("")
    return features, labels


def check_arxiv(graph: Graph, features: np.ndarray, labels: np.ndarray) -> None:
    assert_canonical(graph)
    assert graph.name == "ogbn-arxiv" and graph.num_classes == 40 and graph.symmetrized
    assert edge_set(graph) == symmetric_closure([tuple(e) for e in ARXIV_EDGES.tolist()])
    np.testing.assert_allclose(graph.features, features, rtol=1e-6)
    np.testing.assert_array_equal(graph.labels, labels)
    np.testing.assert_array_equal(graph.train_mask, mask_of(6, [0, 1, 2]))
    np.testing.assert_array_equal(graph.val_mask, mask_of(6, [3]))
    np.testing.assert_array_equal(graph.test_mask, mask_of(6, [4, 5]))


@pytest.mark.parametrize(
    "folder, data_dir",
    [
        ("ogbn_arxiv", "."),  # data_dir is the root given to OGB
        ("arxiv", "."),  # as unzipped from arxiv.zip
        ("mine", "mine"),  # data_dir is the dataset folder itself
    ],
)
def test_ogb_raw_layout_is_read_by_ogb_and_symmetrised(tmp_path: Path, folder: str, data_dir: str) -> None:
    features, labels = write_ogb_raw(tmp_path / folder)
    check_arxiv(load_dataset("ogbn-arxiv", tmp_path / data_dir, progress=False), features, labels)
    assert (tmp_path / folder / "processed" / "data_processed").is_file()  # ogb read the raw files and saved them
    assert "outdated" not in sys.modules  # ogb's version check against PyPI was skipped


def test_ogb_processed_layout_without_raw_files(tmp_path: Path) -> None:
    features, labels = write_ogb_raw(tmp_path / "ogbn_arxiv")
    load_dataset("ogbn-arxiv", tmp_path, progress=False)  # ogb saves processed/data_processed
    shutil.rmtree(tmp_path / "ogbn_arxiv" / "raw")
    check_arxiv(load_dataset("ogbn-arxiv", tmp_path, progress=False), features, labels)


def test_ogb_products_undirected_with_sales_ranking_split(tmp_path: Path) -> None:
    folder = tmp_path / "products"
    edges = np.array([(0, 1), (1, 2), (2, 3), (0, 4), (3, 4)])  # each undirected edge once
    features = np.round(np.random.default_rng(4).standard_normal((5, 2)), 4)
    labels = np.array([46, 0, 3, 3, 1])
    write_csv_gz(folder / "raw" / "edge.csv.gz", edges)
    write_csv_gz(folder / "raw" / "node-feat.csv.gz", features, fmt="%.4f")
    write_csv_gz(folder / "raw" / "node-label.csv.gz", labels.reshape(-1, 1))
    write_csv_gz(folder / "raw" / "num-node-list.csv.gz", np.array([[5]]))
    write_csv_gz(folder / "raw" / "num-edge-list.csv.gz", np.array([[len(edges)]]))
    write_split(folder / "split" / "sales_ranking", {"train": [1, 3], "valid": [0], "test": [2, 4]})
    (folder / "RELEASE_v1.txt").write_text("")
    graph = load_dataset("ogbn-products", tmp_path, progress=False)
    assert_canonical(graph)
    assert graph.name == "ogbn-products" and graph.num_classes == 47 and not graph.symmetrized
    assert edge_set(graph) == symmetric_closure([tuple(e) for e in edges.tolist()])
    np.testing.assert_allclose(graph.features, features, rtol=1e-6)
    np.testing.assert_array_equal(graph.labels, labels)
    np.testing.assert_array_equal(graph.train_mask, mask_of(5, [1, 3]))
    np.testing.assert_array_equal(graph.val_mask, mask_of(5, [0]))
    np.testing.assert_array_equal(graph.test_mask, mask_of(5, [2, 4]))


def test_ogb_binary_layout_unlabelled_nodes(tmp_path: Path) -> None:
    folder = tmp_path / "ogbn_papers100M"
    (folder / "raw").mkdir(parents=True)
    edges = np.array([(0, 1), (2, 1), (3, 4)]).T
    features = np.random.default_rng(5).standard_normal((5, 2)).astype(np.float32)
    np.savez(
        folder / "raw" / "data.npz",
        edge_index=edges,
        node_feat=features,
        num_nodes_list=np.array([5]),
        num_edges_list=np.array([3]),
    )
    np.savez(folder / "raw" / "node-label.npz", node_label=np.array([[3.0], [np.nan], [171.0], [np.nan], [0.0]]))
    write_split(folder / "split" / "time", {"train": [0, 1], "valid": [2], "test": [4]})
    (folder / "RELEASE_v1.txt").write_text("")
    graph = load_dataset("ogbn-papers100m", tmp_path, progress=False)
    assert_canonical(graph)
    assert graph.name == "ogbn-papers100M" and graph.num_classes == 172 and graph.symmetrized
    assert edge_set(graph) == symmetric_closure([(0, 1), (2, 1), (3, 4)])
    np.testing.assert_array_equal(graph.features, features)
    np.testing.assert_array_equal(graph.labels, [3, 0, 171, 0, 0])
    np.testing.assert_array_equal(graph.train_mask, mask_of(5, [0]))  # node 1 is unlabelled
    np.testing.assert_array_equal(graph.val_mask, mask_of(5, [2]))
    np.testing.assert_array_equal(graph.test_mask, mask_of(5, [4]))


def test_ogb_split_dict_is_preferred_and_unpickled_restrictedly(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    features, labels = write_ogb_raw(tmp_path / "ogbn_arxiv")
    split_dict = tmp_path / "ogbn_arxiv" / "split" / "time" / "split_dict.pt"
    torch.save(
        {"train": np.array([5, 4]), "valid": np.array([0], dtype=np.int32), "test": np.array([1, 2, 3])}, split_dict
    )
    graph = load_dataset("ogbn-arxiv", tmp_path, progress=False)
    np.testing.assert_array_equal(graph.train_mask, mask_of(6, [4, 5]))
    np.testing.assert_array_equal(graph.val_mask, mask_of(6, [0]))
    np.testing.assert_array_equal(graph.test_mask, mask_of(6, [1, 2, 3]))

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    torch.save({"train": Payload(), "valid": [], "test": []}, split_dict)
    expect_user_error("ogbn-arxiv", tmp_path, "split_dict.pt", "refused")
    assert not marker.exists()


def test_ogb_split_dict_needs_a_torch_that_restricts_unpickling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    write_ogb_raw(tmp_path / "ogbn_arxiv")
    torch.save(
        {"train": np.array([0]), "valid": np.array([1]), "test": np.array([2])},
        tmp_path / "ogbn_arxiv" / "split" / "time" / "split_dict.pt",
    )
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    expect_user_error("ogbn-arxiv", tmp_path, "split_dict.pt", "torch 2.5.1", "upgrade torch")


def test_ogb_missing_release_file_is_refused_without_asking(tmp_path: Path) -> None:
    write_ogb_raw(tmp_path / "ogbn_arxiv")
    (tmp_path / "ogbn_arxiv" / "RELEASE_v1.txt").unlink()
    # ogb would call input() here; under pytest that raises instead of waiting
    expect_user_error("ogbn-arxiv", tmp_path, "RELEASE_v1.txt", "ogb.stanford.edu")
    assert not (tmp_path / "ogbn_arxiv" / "processed").exists()


def test_ogb_unwritable_folder_is_refused_before_reading(tmp_path: Path) -> None:
    folder = tmp_path / "ogbn_arxiv"
    write_ogb_raw(folder)
    # sysfs refuses new files even to root, so this is unwritable whoever runs the test
    (folder / "processed").symlink_to("/sys/kernel")
    expect_user_error(
        "ogbn-arxiv", tmp_path, f"cannot write to {folder / 'processed'}", "make it writable", "copy", "--data-dir"
    )


# ----------------------------------------------------------------------------- npz


def write_npz(
    path: Path, masks: bool, dense: bool = False, features: np.ndarray | None = None, labels: np.ndarray | None = None
) -> dict:
    n = 10
    rng = np.random.default_rng(7)
    attr = (rng.random((n, 6)) < 0.4).astype(np.float32) if features is None else features
    adj_rows = [[1, 2], [2], [], [4, 4], [], [6], [7, 9], [], [9, 0], []]  # a duplicate (3, 4)
    weights = np.ones(sum(map(len, adj_rows)), dtype=np.float32)
    weights[7] = 0.0  # an explicitly stored zero, (6, 9), is no edge
    arrays = {
        "adj_data": weights,
        "adj_indices": np.array([v for row in adj_rows for v in row], dtype=np.int32),
        "adj_indptr": np.concatenate(([0], np.cumsum([len(r) for r in adj_rows]))).astype(np.int32),
        "adj_shape": np.array([n, n]),
        "labels": np.array([0, 1, 2, 0, 1, 2, 0, 1, 2, 0]) if labels is None else labels,
    }
    if dense:
        arrays["features"] = attr
    else:
        nz = np.nonzero(attr)
        arrays |= {
            "attr_data": attr[nz],
            "attr_indices": nz[1].astype(np.int32),
            "attr_indptr": np.concatenate(([0], np.cumsum(np.count_nonzero(attr, axis=1)))).astype(np.int32),
            "attr_shape": np.array(attr.shape),
        }
    if masks:
        arrays |= {
            "train_mask": mask_of(n, [0, 1, 2, 3]),
            "val_mask": mask_of(n, [4, 5]),
            "test_mask": mask_of(n, [6, 7, 8]),
        }
    np.savez(path, **arrays)
    expected_edges = [(u, v) for u, row in enumerate(adj_rows) for v in row if (u, v) != (6, 9)]
    return {"features": attr, "labels": arrays["labels"], "edges": expected_edges}


@pytest.mark.parametrize("dense", [False, True])
def test_npz_with_masks(tmp_path: Path, dense: bool) -> None:
    expected = write_npz(tmp_path / "toy.npz", masks=True, dense=dense)
    graph = load_dataset(f"npz:{tmp_path / 'toy.npz'}", None, progress=False)
    assert_canonical(graph)
    assert graph.name == "toy" and graph.num_classes == 3
    assert edge_set(graph) == symmetric_closure(expected["edges"])
    np.testing.assert_array_equal(graph.features, expected["features"])
    np.testing.assert_array_equal(graph.labels, expected["labels"])
    np.testing.assert_array_equal(graph.train_mask, mask_of(10, [0, 1, 2, 3]))
    np.testing.assert_array_equal(graph.val_mask, mask_of(10, [4, 5]))
    np.testing.assert_array_equal(graph.test_mask, mask_of(10, [6, 7, 8]))


def test_npz_without_masks_gets_seeded_60_20_20_split(tmp_path: Path) -> None:
    write_npz(tmp_path / "toy.npz", masks=False)
    first = load_dataset("npz:toy.npz", tmp_path, progress=False)  # relative path under data_dir
    second = load_dataset(f"npz:{tmp_path / 'toy.npz'}", None, progress=False)
    assert (first.train_mask.sum(), first.val_mask.sum(), first.test_mask.sum()) == (6, 2, 2)
    assert np.all(first.train_mask.astype(int) + first.val_mask + first.test_mask == 1)
    for name in ("train_mask", "val_mask", "test_mask"):
        np.testing.assert_array_equal(getattr(first, name), getattr(second, name))


# ----------------------------------------------------------------------------- Planetoid


class FakeCSR:
    """Pickles like scipy.sparse.csr.csr_matrix of an old scipy (NEWOBJ + state dict)."""

    __module__ = "scipy.sparse.csr"
    __qualname__ = "csr_matrix"

    def __init__(self, dense: np.ndarray) -> None:
        rows, cols = np.nonzero(dense)
        self.indptr = np.concatenate(([0], np.cumsum(np.bincount(rows, minlength=dense.shape[0])))).astype(np.int32)
        self.indices = cols.astype(np.int32)
        self.data = dense[rows, cols]
        self._shape = dense.shape
        self.maxprint = 50


@pytest.fixture
def fake_scipy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make FakeCSR pickle under the name scipy.sparse.csr.csr_matrix (scipy is not installed)."""
    modules = {name: types.ModuleType(name) for name in ("scipy", "scipy.sparse", "scipy.sparse.csr")}
    modules["scipy.sparse.csr"].csr_matrix = FakeCSR
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


def write_planetoid(folder: Path, name: str) -> dict:
    """A CiteSeer-like set: 5 training, 500 validation nodes, test ids 507 and 510 missing from tx."""
    rng = np.random.default_rng(11)
    num_known, num_features, num_classes = 506, 4, 3
    allx = (rng.random((num_known, num_features)) < 0.5).astype(np.float32)
    ally_ids = rng.integers(0, num_classes, num_known)
    ally = np.eye(num_classes)[ally_ids]
    test_index = np.array([509, 506, 508, 511])
    tx = (rng.random((4, num_features)) < 0.5).astype(np.float32) + np.eye(4)[:, :num_features]
    ty_ids = np.array([2, 1, 0, 2])
    graph = defaultdict(list, {0: [1, 2], 1: [0], 2: [0, 2], 509: [510, 300], 300: [509]})
    parts = {
        "x": FakeCSR(allx[:5]),
        "y": ally[:5],
        "tx": FakeCSR(tx),
        "ty": np.eye(num_classes)[ty_ids],
        "allx": FakeCSR(allx),
        "ally": ally,
        "graph": graph,
    }
    folder.mkdir(parents=True, exist_ok=True)
    for part, value in parts.items():
        (folder / f"ind.{name}.{part}").write_bytes(pickle.dumps(value, protocol=2))
    (folder / f"ind.{name}.test.index").write_text("".join(f"{i}\n" for i in test_index))
    features = np.zeros((512, num_features), dtype=np.float32)
    features[:num_known], features[test_index] = allx, tx
    labels = np.zeros(512, dtype=np.int64)
    labels[:num_known], labels[test_index] = ally_ids, ty_ids
    edges = [(0, 1), (0, 2), (1, 0), (2, 0), (509, 510), (509, 300), (300, 509)]
    return {"features": features, "labels": labels, "edges": edges, "test": test_index}


@pytest.mark.usefixtures("fake_scipy")
def test_planetoid_pickles_public_split(tmp_path: Path) -> None:
    expected = write_planetoid(tmp_path / "citeseer", "citeseer")
    graph = load_dataset("citeseer", tmp_path, progress=False)
    assert_canonical(graph)
    assert graph.num_nodes == 512 and graph.num_classes == 3
    assert edge_set(graph) == symmetric_closure(expected["edges"])
    sums = expected["features"].sum(axis=1, keepdims=True)
    np.testing.assert_allclose(
        graph.features,
        np.divide(expected["features"], sums, out=np.zeros_like(expected["features"]), where=sums > 0),
        rtol=1e-6,
    )
    np.testing.assert_array_equal(graph.labels, expected["labels"])
    assert not graph.features[[507, 510]].any()  # padded isolated test ids
    np.testing.assert_array_equal(graph.train_mask, mask_of(512, list(range(5))))
    np.testing.assert_array_equal(graph.val_mask, mask_of(512, list(range(5, 505))))
    np.testing.assert_array_equal(graph.test_mask, mask_of(512, expected["test"].tolist()))


@pytest.mark.usefixtures("fake_scipy")
def test_planetoid_pickle_with_foreign_class_is_refused(tmp_path: Path) -> None:
    write_planetoid(tmp_path, "cora")
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (tmp_path / "ind.cora.ty").write_bytes(pickle.dumps(Payload(), protocol=2))
    expect_user_error("cora", tmp_path, "ind.cora.ty", "not allowed")
    assert not marker.exists()


def test_real_cora_planetoid_files() -> None:
    graph = load_dataset("cora", SHARED_DATA / "planetoid", progress=False)
    assert_canonical(graph)
    assert graph.features.shape == (2708, 1433) and graph.num_classes == 7
    assert (graph.train_mask.sum(), graph.val_mask.sum(), graph.test_mask.sum()) == (140, 500, 1000)
    assert graph.num_edges == 10556
    row_sums = graph.features.sum(axis=1)
    np.testing.assert_allclose(row_sums[row_sums > 0], 1.0, rtol=1e-5)  # row-normalised binary features
    np.testing.assert_array_equal(np.flatnonzero(graph.train_mask), np.arange(140))
    assert np.all(np.bincount(graph.labels[graph.train_mask]) == 20)  # 20 per class in the public split


def test_real_cora_npz_matches_planetoid() -> None:
    graph = load_dataset(f"npz:{SHARED_DATA / 'cora.npz'}", None, progress=False)
    planetoid = load_dataset("cora", SHARED_DATA / "planetoid", progress=False)
    assert_canonical(graph)
    assert graph.features.shape == (2708, 1433) and graph.num_classes == 7 and graph.num_edges == 10556
    assert (graph.train_mask.sum(), graph.val_mask.sum(), graph.test_mask.sum()) == (1625, 542, 541)
    # same graph, different node order: compare order-free statistics
    np.testing.assert_array_equal(np.sort(graph.in_degree()), np.sort(planetoid.in_degree()))
    np.testing.assert_array_equal(np.sort(np.bincount(graph.labels)), np.sort(np.bincount(planetoid.labels)))
    assert graph.features.sum() == np.count_nonzero(planetoid.features) == 49216


# ----------------------------------------------------------------------------- synthetic


def measured_homophily(graph: Graph) -> float:
    dst = np.repeat(np.arange(graph.num_nodes), graph.in_degree())
    return float(np.mean(graph.labels[dst] == graph.labels[graph.indices]))


def test_synthetic_default_is_small_and_canonical() -> None:
    graph = load_dataset("synthetic", None, progress=False)
    assert_canonical(graph)
    assert graph.name == "synthetic" and graph.num_nodes == 5000 and graph.features.shape == (5000, 32)
    assert graph.num_classes == 5 and np.all(np.bincount(graph.labels) == 1000)
    assert not graph.symmetrized and not graph.multilabel
    assert abs(graph.num_edges / graph.num_nodes - 10.0) < 0.3
    assert abs(measured_homophily(graph) - 0.8) < 0.02
    assert (graph.train_mask.sum(), graph.val_mask.sum(), graph.test_mask.sum()) == (3000, 1000, 1000)


@pytest.mark.parametrize(
    "spec, degree, homophily",
    [
        ("synthetic:nodes=3000,degree=40,classes=4,homophily=0.95,seed=3", 40.0, 0.95),
        ("synthetic:nodes=400,degree=30,classes=8,homophily=0.9", 30.0, 0.9),  # dense classes: many repeats
        ("synthetic:nodes=2000,degree=12,classes=3,homophily=0", 12.0, 0.0),
    ],
)
def test_synthetic_degree_and_homophily(spec: str, degree: float, homophily: float) -> None:
    graph = load_dataset(spec, None, progress=False)
    assert_canonical(graph)
    assert abs(graph.num_edges / graph.num_nodes - degree) / degree < 0.03
    assert abs(measured_homophily(graph) - homophily) < 0.02


def test_synthetic_determinism_and_independent_streams() -> None:
    spec = "synthetic:nodes=1500,degree=8,seed=4"
    first, second = (load_dataset(spec, None, progress=False) for _ in range(2))
    for name in ("indptr", "indices", "features", "labels", "train_mask", "val_mask", "test_mask"):
        np.testing.assert_array_equal(getattr(first, name), getattr(second, name))
    other = load_dataset("synthetic:nodes=1500,degree=8,seed=5", None, progress=False)
    assert not np.array_equal(first.labels, other.labels)
    assert not np.array_equal(first.features, other.features)
    assert edge_set(first) != edge_set(other)
    wider = load_dataset("synthetic:nodes=1500,degree=8,seed=4,features=7", None, progress=False)
    assert wider.features.shape == (1500, 7)
    # independent streams: the feature width moves neither the edges nor the split
    np.testing.assert_array_equal(wider.indices, first.indices)
    np.testing.assert_array_equal(wider.train_mask, first.train_mask)


def nearest_mean_accuracy(features: np.ndarray, graph: Graph) -> float:
    means = np.stack([features[graph.train_mask & (graph.labels == c)].mean(axis=0) for c in range(graph.num_classes)])
    test = features[graph.test_mask]
    predicted = ((test[:, None, :] - means[None]) ** 2).sum(axis=-1).argmin(axis=1)
    return float(np.mean(predicted == graph.labels[graph.test_mask]))


def test_synthetic_neighbourhood_separates_classes_better_than_features() -> None:
    graph = load_dataset("synthetic:noise=4", None, progress=False)
    dst = np.repeat(np.arange(graph.num_nodes), graph.in_degree())
    neighbour_mean = np.zeros_like(graph.features)
    np.add.at(neighbour_mean, dst, graph.features[graph.indices])
    neighbour_mean /= np.maximum(graph.in_degree(), 1)[:, None]
    alone, aggregated = nearest_mean_accuracy(graph.features, graph), nearest_mean_accuracy(neighbour_mean, graph)
    assert alone < 0.8 and aggregated > alone + 0.15, (alone, aggregated)


# ----------------------------------------------------------------------------- bad input


def test_unknown_dataset_lists_valid_names() -> None:
    expect_user_error("redit", None, "redit", "reddit", "ogbn-products", "npz:<path>", "synthetic")


@pytest.mark.parametrize(
    "spec, files",
    [
        ("reddit", ["reddit_data.npz", "reddit_graph.npz", "data.dgl.ai"]),
        ("yelp", ["adj_full.npz", "feats.npy", "class_map.json", "role.json", "GraphSAINT"]),
        (
            "ogbn-products",
            ["raw/edge.csv.gz", "raw/num-edge-list.csv.gz", "split/sales_ranking/train.csv.gz", "ogb.stanford.edu"],
        ),
        ("pubmed", ["ind.pubmed.x", "ind.pubmed.test.index", "kimiyoung/planetoid"]),
    ],
)
def test_missing_files_are_named(tmp_path: Path, spec: str, files: list[str]) -> None:
    expect_user_error(spec, tmp_path, str(tmp_path), *files)


def test_missing_npz_file(tmp_path: Path) -> None:
    expect_user_error("npz:nothing.npz", tmp_path, "nothing.npz")


def test_corrupt_files_are_named(tmp_path: Path) -> None:
    write_reddit(tmp_path)
    (tmp_path / "reddit_graph.npz").write_bytes(b"PK\x03\x04 not really a zip")
    expect_user_error("reddit", tmp_path, "reddit_graph.npz")
    write_ogb_raw(tmp_path / "ogbn_arxiv")
    (tmp_path / "ogbn_arxiv" / "raw" / "edge.csv.gz").write_bytes(b"\x1f\x8b\x08garbage")
    expect_user_error(
        "ogbn-arxiv", tmp_path, str(tmp_path / "ogbn_arxiv"), "ogb package could not read", "download the dataset again"
    )
    (tmp_path / "cora").mkdir()
    for part in ("x", "y", "tx", "ty", "allx", "ally", "graph", "test.index"):
        (tmp_path / "cora" / f"ind.cora.{part}").write_bytes(b"\x80\x02truncated")
    expect_user_error("cora", tmp_path, "ind.cora.x")


def test_nan_features_are_refused(tmp_path: Path) -> None:
    features = np.ones((10, 3), dtype=np.float32)
    features[7, 1] = np.nan
    write_npz(tmp_path / "bad.npz", masks=True, dense=True, features=features)
    expect_user_error(f"npz:{tmp_path / 'bad.npz'}", None, "bad.npz", "NaN", "node 7", "clean")
    reddit_features = np.ones((6, 4))
    reddit_features[2, 0] = np.inf
    write_reddit(tmp_path / "reddit", features=reddit_features)
    expect_user_error("reddit", tmp_path, "reddit_data.npz", "NaN or infinite", "clean")


def test_labels_out_of_range_are_refused(tmp_path: Path) -> None:
    write_ogb_raw(tmp_path / "ogbn_arxiv", labels=np.array([0, 40, 1, 1, 2, 3]))  # ogbn-arxiv has 40 classes
    expect_user_error("ogbn-arxiv", tmp_path, "label 40", "node 1", "[0, 40)")
    write_npz(tmp_path / "neg.npz", masks=True, labels=np.array([0, 1, -1, 0, 1, 2, 0, 1, 2, 0]))
    expect_user_error(f"npz:{tmp_path / 'neg.npz'}", None, "label -1", "node 2")


def test_npz_partial_masks_are_refused(tmp_path: Path) -> None:
    write_npz(tmp_path / "toy.npz", masks=True)
    arrays = dict(np.load(tmp_path / "toy.npz"))
    del arrays["test_mask"]
    np.savez(tmp_path / "toy.npz", **arrays)
    expect_user_error(f"npz:{tmp_path / 'toy.npz'}", None, "train_mask, val_mask", "all three or none")


@pytest.mark.parametrize(
    "train, val, test, fragment",
    [
        ([0, 1, 2], [2, 3], [4], "overlap"),
        ([], [2, 3], [4], "training split is empty"),
    ],
)
def test_bad_npz_splits_are_refused(
    tmp_path: Path, train: list[int], val: list[int], test: list[int], fragment: str
) -> None:
    write_npz(tmp_path / "toy.npz", masks=False)
    arrays = dict(np.load(tmp_path / "toy.npz"))
    arrays |= {"train_mask": mask_of(10, train), "val_mask": mask_of(10, val), "test_mask": mask_of(10, test)}
    np.savez(tmp_path / "toy.npz", **arrays)
    expect_user_error(f"npz:{tmp_path / 'toy.npz'}", None, "toy.npz", fragment)


def test_npz_non_bool_masks_name_the_fix(tmp_path: Path) -> None:
    write_npz(tmp_path / "toy.npz", masks=True)
    arrays = dict(np.load(tmp_path / "toy.npz"))
    arrays["train_mask"] = arrays["train_mask"].astype(np.int8)
    np.savez(tmp_path / "toy.npz", **arrays)
    expect_user_error(
        f"npz:{tmp_path / 'toy.npz'}",
        None,
        "train mask",
        "dtype int8",
        "expected bool",
        "store each mask as a boolean array",
    )


def test_npz_spec_naming_another_kind_of_file(tmp_path: Path) -> None:
    (tmp_path / "edges.npz").write_text("src,dst\n0,1\n")
    message = expect_user_error(
        f"npz:{tmp_path / 'edges.npz'}", None, "edges.npz", "not an .npz archive", "numpy.savez"
    )
    assert "pickle" not in message
    np.save(tmp_path / "single.npy", np.zeros(3))
    expect_user_error(f"npz:{tmp_path / 'single.npy'}", None, "single.npy", "single array", "numpy.savez")


@pytest.mark.parametrize("key", ["adj_indices", "adj_indptr"])
def test_npz_float_index_arrays_are_refused(tmp_path: Path, key: str) -> None:
    write_npz(tmp_path / "toy.npz", masks=True)
    arrays = dict(np.load(tmp_path / "toy.npz"))
    arrays[key] = arrays[key] + 0.5  # would silently become the integers below
    np.savez(tmp_path / "toy.npz", **arrays)
    expect_user_error(f"npz:{tmp_path / 'toy.npz'}", None, "toy.npz", key, "dtype float64", "expected integers")


@pytest.mark.parametrize(
    "spec, fragments",
    [
        ("synthetic:nodez=10", ["'nodez'", "nodes", "degree", "homophily"]),
        ("synthetic:nodes", ["'nodes'", "key=value"]),
        ("synthetic:nodes=ten", ["nodes", "'ten'", "integer"]),
        ("synthetic:homophily=1.5", ["homophily=1.5", "[0, 1]"]),
        ("synthetic:train=0.9,val=0.2", ["val", "train + val < 1"]),
        ("synthetic:nodes=100,degree=90,classes=10,homophily=1", ["degree=90", "lower degree"]),
    ],
)
def test_bad_synthetic_specs(spec: str, fragments: list[str]) -> None:
    expect_user_error(spec, None, *fragments)


# ----------------------------------------------------------------------------- progress


def test_progress_names_the_dataset_and_can_be_silenced(capsys: pytest.CaptureFixture[str]) -> None:
    with Progress("toy").step("reading"):
        pass
    with Progress("toy", enabled=False).step("silent"):
        pass
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "toy: reading ..."
    assert lines[1].startswith("toy: reading ... done in ") and len(lines) == 2
