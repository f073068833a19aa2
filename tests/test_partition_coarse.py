"""The ``coarse`` partitioner, ``--method auto``, the memory-mapped ``csr:`` input, the
partition step's memory, and running out of memory.

Graphs come from ``tests/test_partition.py`` (random, isolated nodes, path) plus a
disconnected one and a planted-partition one; every set is checked with its
``check_partition_set`` (every node in exactly one part, boundary lists and send lists
consistent with the graph, every edge stored once).
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import bnsgcn.partition.coarse as coarse_module
import bnsgcn.partition.datasets as datasets_module
import bnsgcn.partition.order as order_module
import bnsgcn.partition.partitioner as partitioner_module
import bnsgcn.partition.writer as writer_module
from bnsgcn.data.format import read_manifest
from bnsgcn.errors import UserError
from bnsgcn.partition.cli import main, parse_size
from bnsgcn.partition.coarse import balance_caps, metis_bytes
from bnsgcn.partition.datasets import Progress, load_dataset
from bnsgcn.partition.datasets.csr import write_synthetic_csr
from bnsgcn.partition.datasets.synthetic import parse_synthetic_spec
from bnsgcn.partition.graph import Graph
from bnsgcn.partition.partitioner import assign, method_info, resolve_method
from bnsgcn.partition.writer import write_partition_set

from .helpers.partition_sets import (
    check_partition_set,
    clustered_graph,
    isolated_graph,
    make_graph,
    path_graph,
    random_graph,
)

# How much more the coarse partitioner may cut than METIS on the planted-partition graph.
CUT_FACTOR = 1.25


def disconnected_graph(seed: int = 7) -> Graph:
    """Five random components of 40-120 nodes, then 50 isolated nodes."""
    rng = np.random.default_rng(seed)
    src, dst, start = [], [], 0
    for size in (40, 120, 60, 80, 100):
        src.append(start + rng.integers(0, size, 4 * size))
        dst.append(start + rng.integers(0, size, 4 * size))
        start += size
    return make_graph("disconnected", np.concatenate(src), np.concatenate(dst), start + 50, seed)


def planted_graph(
    blocks: int = 4, size: int = 500, degree_in: int = 12, degree_out: float = 1.0, seed: int = 3
) -> tuple[Graph, np.ndarray]:
    """A planted partition: ``blocks`` blocks of ``size`` nodes, ~``degree_in`` neighbours inside a
    node's block and ~``degree_out`` outside; nodes shuffled so ids say nothing. Returns the graph
    and the planted block of every node."""
    rng = np.random.default_rng(seed)
    n = blocks * size
    block = rng.permutation(np.arange(n) % blocks)
    members = [np.flatnonzero(block == b) for b in range(blocks)]
    inside = n * degree_in // 2
    u = rng.integers(0, n, inside)
    v = np.array([rng.choice(members[b]) for b in block[u]])
    across = int(n * degree_out / 2)
    graph = make_graph(
        "planted",
        np.concatenate([u, rng.integers(0, n, across)]),
        np.concatenate([v, rng.integers(0, n, across)]),
        n,
        seed,
    )
    graph.train_mask = rng.random(n) < 0.5
    return graph, block


def cut_of(graph: Graph, assignment: np.ndarray) -> int:
    dst = np.repeat(np.arange(graph.num_nodes), graph.in_degree())
    return int(np.sum(assignment[dst] != assignment[graph.indices]))


@pytest.fixture
def levels(monkeypatch) -> list[int]:
    """Force coarsening on small graphs (at most 40 coarse nodes) and record each level's cluster count."""
    counts: list[int] = []
    real = coarse_module._contract

    def contract(*args):
        counts.append(int(args[-2]))  # (..., cluster, clusters, max_edges)
        return real(*args)

    monkeypatch.setattr(coarse_module, "COARSE_NODES", 40)
    monkeypatch.setattr(coarse_module, "_contract", contract)
    return counts


# clustered: all training nodes in one of 4 clusters, so METIS' parts of the coarse graph
# can leave the training cap broken for the rebalancing to repair.
GRAPHS = {
    "random": random_graph,
    "isolated": isolated_graph,
    "path": lambda: path_graph(200),
    "disconnected": disconnected_graph,
    "clustered": clustered_graph,
}


@pytest.mark.parametrize("graph_name", sorted(GRAPHS))
@pytest.mark.parametrize("parts", [2, 3, 5])
def test_coarse_writes_a_valid_balanced_set(tmp_path, levels, graph_name, parts):
    graph = GRAPHS[graph_name]()
    assignment = assign(graph, parts, "coarse", "cut", seed=1)
    assert levels, "the graph was not coarsened"
    assert assignment.dtype == np.int64 and assignment.shape == (graph.num_nodes,)
    assert assignment.min() >= 0 and assignment.max() < parts
    cap_nodes, cap_train = balance_caps(graph.num_nodes, int(graph.train_mask.sum()), parts)
    assert np.bincount(assignment, minlength=parts).max() <= cap_nodes
    assert np.bincount(assignment[graph.train_mask], minlength=parts).max() <= cap_train
    manifest = write_partition_set(
        graph, assignment, tmp_path / "set", parts=parts, method_info=method_info("coarse", "cut", 1), progress=False
    )
    check_partition_set(graph, tmp_path / "set", parts)
    assert manifest["report"]["totals"]["cut_edges"] == cut_of(graph, assignment)
    assert np.array_equal(assignment, assign(graph, parts, "coarse", "cut", seed=1))  # deterministic


@pytest.mark.parametrize("graph_name", sorted(GRAPHS))
def test_refinement_rebalances_any_start_within_the_caps(graph_name):
    """From every node in part 0 (both caps broken), refinement ends with every part within both caps."""
    graph = GRAPHS[graph_name]()
    parts = 3
    train = graph.train_mask.astype(np.uint8)
    cap_nodes, cap_train = balance_caps(graph.num_nodes, int(train.sum()), parts)
    assignment = np.zeros(graph.num_nodes, dtype=np.int64)
    order = np.random.default_rng(0).permutation(graph.num_nodes)
    coarse_module._refine(graph.indptr, graph.indices, assignment, parts, train, cap_nodes, cap_train, order, 4)
    assert np.bincount(assignment, minlength=parts).max() <= cap_nodes
    assert np.bincount(assignment[graph.train_mask], minlength=parts).max() <= cap_train


def test_level_too_large_to_hold_grows_its_clusters_first(tmp_path, monkeypatch):
    """A graph without locality: the first clustering's coarse graph exceeds what the budget
    may hold, so label propagation resumes from those clusters with a larger cap before
    contracting; the result is still a valid, balanced set."""
    rng = np.random.default_rng(2)
    graph = make_graph("random-dense", rng.integers(0, 4000, 100_000), rng.integers(0, 4000, 100_000), 4000, seed=2)
    starts: list[int] = []
    real = coarse_module._label_propagation

    def label_propagation(*args):
        starts.append(args[-1].shape[0])  # length of the initial clustering (0: every node alone)
        return real(*args)

    monkeypatch.setattr(coarse_module, "_label_propagation", label_propagation)
    monkeypatch.setattr(coarse_module, "COARSE_NODES", 1000)
    monkeypatch.setattr(coarse_module, "CONTRACT_BYTES_PER_EDGE", 8 * 2**30 // 2 // 50_000)  # hold <= 50k coarse edges
    assignment = assign(graph, 4, "coarse", "cut", seed=0, memory_limit=8 * 2**30)
    assert starts[0] == 0 and graph.num_nodes in starts[1:]  # resumed from a clustering of the fine graph
    cap_nodes, cap_train = balance_caps(graph.num_nodes, int(graph.train_mask.sum()), 4)
    assert np.bincount(assignment, minlength=4).max() <= cap_nodes
    assert np.bincount(assignment[graph.train_mask], minlength=4).max() <= cap_train
    write_partition_set(
        graph, assignment, tmp_path / "set", parts=4, method_info=method_info("coarse", "cut", 0), progress=False
    )
    check_partition_set(graph, tmp_path / "set", 4)


def test_coarse_finds_the_planted_cut_about_as_well_as_metis(tmp_path, levels):
    graph, block = planted_graph()
    coarse_cut = cut_of(graph, assign(graph, 4, "coarse", "cut", seed=0))
    metis_cut = cut_of(graph, assign(graph, 4, "metis", "cut", seed=0))
    planted_cut = cut_of(graph, block)
    assert levels and levels[-1] <= 40  # METIS saw at most 40 clusters of 2,000 nodes
    assert coarse_cut <= CUT_FACTOR * metis_cut
    assert coarse_cut <= CUT_FACTOR * planted_cut
    assert coarse_cut < 0.2 * cut_of(graph, assign(graph, 4, "random"))


def test_refinement_lowers_the_cut_of_the_projected_partition(monkeypatch, levels):
    graph, _ = planted_graph(seed=5)
    refined = cut_of(graph, assign(graph, 4, "coarse", "cut", seed=0))
    monkeypatch.setattr(coarse_module, "REFINE_ROUNDS", 0)
    projected = cut_of(graph, assign(graph, 4, "coarse", "cut", seed=0))
    assert refined < projected


def test_auto_picks_coarse_when_metis_would_not_fit(tmp_path, capsys, levels):
    assert resolve_method("auto", 1000, 10_000, memory_limit=metis_bytes(1000, 10_000)) == "metis"
    assert resolve_method("auto", 1000, 10_000, memory_limit=metis_bytes(1000, 10_000) - 1) == "coarse"
    assert resolve_method("metis", 1000, 10_000, memory_limit=1) == "metis"
    spec = "synthetic:nodes=600,degree=8,features=4,classes=3,seed=2"
    graph = load_dataset(spec, None, progress=False)
    fits = metis_bytes(graph.num_nodes, graph.num_edges)
    small, large = tmp_path / "small", tmp_path / "large"
    args = [spec, "--parts", "3", "--method", "auto", "--memory-limit"]
    assert main([*args, str(fits - 1), "--out", str(small)]) == 0
    assert "--method auto: coarse" in capsys.readouterr().err
    partitioner = read_manifest(small)["partitioner"]
    assert partitioner["method"] == "auto" and partitioner["resolved"] == "coarse"
    assert levels  # coarse really ran
    check_partition_set(graph, small, 3)
    assert main([*args, str(fits - 1), "--out", str(small)]) == 0
    assert "reusing the partition set" in capsys.readouterr().out
    assert main([*args, str(fits), "--out", str(large)]) == 0
    assert "--method auto: metis" in capsys.readouterr().err
    assert read_manifest(large)["partitioner"]["resolved"] == "metis"


def test_parse_size():
    assert parse_size("8G") == 8 * 2**30 and parse_size("500m") == 500 * 2**20 and parse_size("1.5GiB") == 3 * 2**29
    assert parse_size("1024") == 1024
    for bad in ("", "-1G", "8X", "0"):
        with pytest.raises(Exception, match="invalid size"):
            parse_size(bad)


SPEC = "synthetic:nodes=400,degree=6,features=4,classes=3,seed=1"


def out_of_memory_in_writer(monkeypatch) -> None:
    def fail(*args):
        raise MemoryError

    monkeypatch.setattr(writer_module, "_local_adjacency", fail)


def out_of_memory_in_partitioner(monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise np._core._exceptions._ArrayMemoryError((2**40,), np.dtype(np.int64))

    monkeypatch.setattr(partitioner_module, "coarse_assignment", fail)


def out_of_memory_in_node_order(monkeypatch) -> None:
    def fail(*args):
        raise MemoryError

    monkeypatch.setattr(order_module, "BLOCK_NODES", 50)  # several blocks per partition of SPEC
    monkeypatch.setattr(order_module, "_inner_degrees", fail)


def out_of_memory_in_loader(monkeypatch) -> None:
    def fail(*args):
        raise MemoryError

    monkeypatch.setattr(datasets_module, "canonical_csr", fail)


@pytest.mark.parametrize(
    "where, phase, detail",
    [
        (out_of_memory_in_writer, "writing partitions", "an allocation failed; it needs about"),
        (
            out_of_memory_in_partitioner,
            "partitioning 400 nodes into 2 parts (coarse)",
            "allocating 8192.0 GiB failed; it needs about",
        ),
        (out_of_memory_in_loader, f"loading {SPEC}", "an allocation failed; "),
        (out_of_memory_in_node_order, "ordering nodes into blocks", "an allocation failed; it needs about"),
    ],
)
def test_out_of_memory_is_one_line_naming_the_phase_and_leaves_nothing(
    tmp_path, capsys, monkeypatch, where, phase, detail
):
    where(monkeypatch)
    out = tmp_path / "new" / "set"
    assert main([SPEC, "--method", "coarse", "--out", str(out)]) == 2
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and stderr.rstrip().endswith(errors[0])
    assert errors[0].startswith(f"error: out of memory while {phase} ({detail}")
    assert "available); free memory" in errors[0] and "Traceback" not in stderr
    assert list(tmp_path.iterdir()) == []  # no set, no temporary directory, no parent made for it


def test_coarsest_graph_over_the_limit_is_refused_before_metis(tmp_path, capsys):
    out = tmp_path / "set"
    assert main([SPEC, "--method", "coarse", "--memory-limit", "1K", "--out", str(out)]) == 2
    stderr = capsys.readouterr().err
    assert stderr.splitlines()[-1].startswith("error: the coarsest graph (") and "raise --memory-limit" in stderr
    assert list(tmp_path.iterdir()) == []


def test_writer_memory_is_a_fraction_of_the_edges(tmp_path):
    """Python-side peak allocation while writing 8 partitions of a dense graph stays below 40%
    of the bytes of the graph's int32 indices (plus the 4 MiB block that checksums are read
    in): nothing edge-sized is built for the whole graph, and per partition only its own
    int32 entries (about 2 x 12% of the indices here: ``np.save`` holds a second copy while it
    writes; the former int64 per-edge temporaries took about 13 x one part's entries)."""
    rng = np.random.default_rng(0)
    n, m = 4000, 1_000_000
    graph = make_graph("dense", rng.integers(0, n, m), rng.integers(0, n, m), n, seed=0)
    assignment = assign(graph, 8, "random")
    info = method_info("random", "cut", 0)
    write_partition_set(
        graph, assignment, tmp_path / "warm", parts=8, method_info=info, progress=False
    )  # compiles the kernels
    tracemalloc.start()
    try:
        write_partition_set(graph, assignment, tmp_path / "set", parts=8, method_info=info, progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    checksum_block = 4 << 20  # bnsgcn.data.format.sha256_file's read size
    assert peak < checksum_block + 0.4 * graph.num_edges * 4, (peak, graph.num_edges)
    check_partition_set(graph, tmp_path / "set", 8)


def test_streamed_csr_equals_the_in_memory_graph_and_partitions(tmp_path, capsys):
    spec = "nodes=3000,degree=12,features=5,classes=4,seed=3"
    directory = tmp_path / "graph"
    write_synthetic_csr(parse_synthetic_spec(spec), directory, Progress("csr", False), bucket_keys=4000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["graph"]  # buckets and temporary directory gone
    expected = load_dataset(f"synthetic:{spec}", None, progress=False)
    graph = load_dataset(f"csr:{directory}", None, progress=False)
    for name in ("indptr", "indices", "features", "labels", "train_mask", "val_mask", "test_mask"):
        assert np.array_equal(getattr(graph, name), getattr(expected, name)), name
    assert graph.name == expected.name and graph.num_classes == 4
    assert not graph.indices.flags.writeable and not graph.features.flags.writeable  # mapped read-only
    out = tmp_path / "set"
    assert main([f"csr:{directory}", "--parts", "3", "--method", "coarse", "--out", str(out)]) == 0
    check_partition_set(expected, out, 3, "as written")


def corrupt(directory: Path, how: str) -> None:
    indptr = np.load(directory / "indptr.npy")
    indices = np.load(directory / "indices.npy")
    if how == "self-loop":
        indices[indptr[7]] = 7
    elif how == "unsorted":
        indices[indptr[9]], indices[indptr[9] + 1] = indices[indptr[9] + 1], indices[indptr[9]]
    np.save(directory / "indices.npy", indices)


@pytest.mark.parametrize(
    "how, message",
    [
        ("self-loop", "self-loop"),
        ("unsorted", "not strictly ascending"),
        ("missing", "lacks labels.npy"),
        ("meta", "graph.json is unreadable"),
    ],
)
def test_bad_csr_directory_is_one_error(tmp_path, capsys, how, message):
    directory = tmp_path / "graph"
    write_synthetic_csr(
        parse_synthetic_spec("nodes=3000,degree=8,features=3,seed=0"), directory, Progress("csr", False)
    )
    if how == "missing":
        (directory / "labels.npy").unlink()
    elif how == "meta":
        (directory / "graph.json").write_text("{")
    else:
        corrupt(directory, how)
    assert main([f"csr:{directory}", "--out", str(tmp_path / "set")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0]
    assert not (tmp_path / "set").exists()


def test_asymmetric_csr_is_refused(tmp_path):
    directory = tmp_path / "graph"
    # A directed 3-cycle 0 -> 1 -> 2 -> 0 written as in-edge CSR: sorted, no self-loops, not symmetric.
    directory.mkdir()
    np.save(directory / "indptr.npy", np.array([0, 1, 2, 3], dtype=np.int64))
    np.save(directory / "indices.npy", np.array([2, 0, 1], dtype=np.int32))
    np.save(directory / "features.npy", np.zeros((3, 2), dtype=np.float32))
    np.save(directory / "labels.npy", np.zeros(3, dtype=np.int64))
    for split, mask in (
        ("train_mask", [True, False, False]),
        ("val_mask", [False, True, False]),
        ("test_mask", [False, False, True]),
    ):
        np.save(directory / f"{split}.npy", np.array(mask))
    (directory / "graph.json").write_text(json.dumps({"name": "cycle", "num_classes": 1}))
    with pytest.raises(UserError, match="missing its reverse"):
        load_dataset(f"csr:{directory}", None, progress=False)
