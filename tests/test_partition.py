"""The partition step's assignment and files: every invariant a training rank relies on.

Graphs are built directly (random, with isolated nodes, a path, clustered) so these tests
do not depend on the dataset loaders. Every set is read back through
``bnsgcn.data.format.load_partition`` and compared with the graph it came from.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import bnsgcn.partition.order as order_module
import bnsgcn.partition.partitioner as partitioner_module
import bnsgcn.partition.writer as writer_module
from bnsgcn.data.format import (
    PART_ARRAYS,
    load_partition,
    read_manifest,
    write_manifest,
)
from bnsgcn.errors import UserError
from bnsgcn.partition.graph import Graph
from bnsgcn.partition.order import block_positions
from bnsgcn.partition.partitioner import (
    assign,
    method_info,
    random_assignment,
    read_assignment,
)
from bnsgcn.partition.writer import (
    find_reusable,
    format_report,
    input_entries,
    remove_stale_temporaries,
    write_partition_set,
)

from .helpers.partition_sets import (
    check_partition_set,
    clustered_graph,
    isolated_graph,
    make_graph,
    path_graph,
    random_graph,
)

GRAPHS = {"random": random_graph, "isolated": isolated_graph, "path": path_graph}


def write_set(
    graph: Graph, out_dir: Path, parts: int, method: str = "metis", objective: str = "cut", seed: int = 0, **kwargs
) -> dict:
    assignment = assign(graph, parts, method, objective, seed)
    return write_partition_set(
        graph,
        assignment,
        out_dir,
        parts=parts,
        method_info=method_info(method, objective, seed),
        progress=False,
        **kwargs,
    )


@pytest.mark.parametrize("graph_name", sorted(GRAPHS))
@pytest.mark.parametrize("parts", [1, 2, 3, 5])
@pytest.mark.parametrize("method", ["metis", "random"])
def test_partition_set_invariants(tmp_path, graph_name, parts, method):
    graph = GRAPHS[graph_name]()
    write_set(graph, tmp_path / "set", parts, method, objective="vol" if parts == 3 else "cut")
    check_partition_set(graph, tmp_path / "set", parts)


@pytest.mark.parametrize("graph_name", sorted(GRAPHS))
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_partition_set_invariants_in_block_order(tmp_path, monkeypatch, graph_name, parts):
    """Nodes ordered by :func:`block_positions` (blocks of 16 nodes here, so every partition
    has several), the empty partition of an assignment file included."""
    monkeypatch.setattr(order_module, "BLOCK_NODES", 16)
    graph = GRAPHS[graph_name]()
    assignment = assign(graph, parts, "metis", "cut", 0)
    if parts == 3:
        assignment[assignment == 1] = 2  # partition 1 gets nothing
    position, blocks = block_positions(graph, assignment, parts, progress=False)
    assert blocks["parts"] == ["metis" if n > 16 else "one block" for n in np.bincount(assignment, minlength=parts)]
    write_partition_set(
        graph,
        assignment,
        tmp_path / "set",
        parts=parts,
        method_info=method_info("metis", "cut", 0),
        progress=False,
        position=position,
    )
    check_partition_set(graph, tmp_path / "set", parts, position)
    inner = load_partition(tmp_path / "set", 0)["inner_nodes"]
    if graph_name == "random":  # not the ids' order (which the check would pass too); a path's blocks keep it
        assert not np.all(np.diff(inner) > 0)


def test_empty_partition_from_assignment_file(tmp_path):
    graph = random_graph(100, 400)
    assignment = np.where(np.arange(100) < 40, 0, 2)  # partition 1 gets nothing
    path = tmp_path / "assignment.txt"
    path.write_text("\n".join(map(str, assignment)) + "\n")
    assert np.array_equal(assign(graph, 3, assignment_file=path), assignment)
    write_partition_set(
        graph,
        assign(graph, 3, assignment_file=path),
        tmp_path / "set",
        parts=3,
        method_info=method_info("metis", "cut", 0, path),
        progress=False,
    )
    check_partition_set(graph, tmp_path / "set", 3)
    assert read_manifest(tmp_path / "set")["partitions"][1]["n_inner"] == 0


def digests(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("method", ["metis", "random"])
def test_same_seed_gives_identical_files(tmp_path, method):
    graph = random_graph(400, 2400, seed=5)
    for name in ("a", "b"):
        write_set(graph, tmp_path / name, 4, method, seed=7)
    first = digests(tmp_path / "a")
    assert len(first) == 1 + 4 * (len(PART_ARRAYS) + 1)  # the manifest; per partition its arrays and partition.json
    assert first == digests(tmp_path / "b")
    write_set(graph, tmp_path / "c", 4, method, seed=8)
    assert digests(tmp_path / "c") != first


def test_parts_one_is_all_zeros_and_bounds_are_checked():
    graph = path_graph(10)
    assert np.array_equal(assign(graph, 1), np.zeros(10, dtype=np.int64))
    for parts in (0, -3, 11):
        with pytest.raises(UserError, match="--parts"):
            assign(graph, parts)
    assert np.array_equal(np.sort(assign(graph, 10, "random")), np.arange(10))


def test_random_assignment_is_stratified_and_seeded():
    train = np.random.default_rng(3).random(1001) < 0.27
    assignment = random_assignment(train, 4, seed=11)
    for counts in (np.bincount(assignment, minlength=4), np.bincount(assignment[train], minlength=4)):
        assert counts.max() - counts.min() <= 1
    assert np.array_equal(assignment, random_assignment(train, 4, seed=11))
    assert not np.array_equal(assignment, random_assignment(train, 4, seed=12))


def test_metis_balances_nodes_and_training_nodes():
    # Cutting along the clusters would leave all training nodes on one rank; the second
    # balance constraint must spread them.
    graph = clustered_graph()
    for objective in ("cut", "vol"):
        assignment = assign(graph, 4, "metis", objective, seed=0)
        sizes = np.bincount(assignment, minlength=4)
        train = np.bincount(assignment[graph.train_mask], minlength=4)
        assert sizes.max() <= 1.1 * sizes.mean()
        assert train.max() <= 1.1 * train.mean()
        assert np.array_equal(assignment, assign(graph, 4, "metis", objective, seed=0))


def test_metis_cuts_fewer_edges_than_random():
    graph = clustered_graph()
    graph.train_mask = np.zeros(graph.num_nodes, dtype=bool)  # single constraint: clusters can be kept whole
    dst = np.repeat(np.arange(graph.num_nodes), graph.in_degree())

    def cut(assignment: np.ndarray) -> int:
        return int(np.sum(assignment[dst] != assignment[graph.indices]))

    assert cut(assign(graph, 4, "metis")) < 0.2 * cut(assign(graph, 4, "random"))


def test_assignment_file_validation(tmp_path):
    good = np.arange(50) % 3
    np.save(tmp_path / "good.npy", good)
    assert np.array_equal(read_assignment(tmp_path / "good.npy", 3, 50), good)
    (tmp_path / "good.txt").write_text("\n".join(map(str, good)))
    assert np.array_equal(read_assignment(tmp_path / "good.txt", 3, 50), good)
    np.save(tmp_path / "short.npy", good[:-1])
    np.save(tmp_path / "range.npy", good + 1)
    np.save(tmp_path / "float.npy", good + 0.5)
    (tmp_path / "text.txt").write_text("0\n1\nx\n")
    (tmp_path / "corrupt.npy").write_bytes(b"\x93NUMPY garbage")
    cases = {
        "short.npy": "50 nodes",
        "range.npy": "outside 0..2",
        "float.npy": "non-integer",
        "text.txt": "unreadable",
        "corrupt.npy": "unreadable",
        "missing.npy": "not found",
    }
    for name, message in cases.items():
        with pytest.raises(UserError, match=message):
            read_assignment(tmp_path / name, 3, 50)
    info = method_info("random", "vol", 5, tmp_path / "good.npy")
    assert info["method"] == "file" and info["seed"] is None and len(info["assignment_file"]["sha256"]) == 64


def test_method_info_normalises_irrelevant_settings():
    assert method_info("random", "cut", 1) == method_info("random", "vol", 1)
    assert method_info("metis", "cut", 1) != method_info("metis", "vol", 1)
    for bad in (("spectral", "cut"), ("metis", "size")):
        with pytest.raises(UserError, match="choose"):
            method_info(*bad, 0)


def test_reuse_force_and_conflicts(tmp_path):
    graph = random_graph(120, 500)
    out = tmp_path / "set"
    write_set(graph, out, 2)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*.npy")}
    # Same request: reused, nothing rewritten.
    manifest = write_set(graph, out, 2)
    assert manifest == read_manifest(out)
    assert before == {p: p.stat().st_mtime_ns for p in out.rglob("*.npy")}
    # Different request without force: refused, old set untouched.
    with pytest.raises(UserError, match="--force"):
        write_set(graph, out, 2, seed=3)
    assert read_manifest(out)["partitioner"]["seed"] == 0
    # With force: rewritten.
    write_set(graph, out, 2, seed=3, force=True)
    assert read_manifest(out)["partitioner"]["seed"] == 3
    check_partition_set(graph, out, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["set"]  # no temp or old dirs left


def test_reuse_compares_the_input_files(tmp_path):
    graph = random_graph(120, 500)
    out = tmp_path / "set"
    data = tmp_path / "data" / "graph.bin"
    data.parent.mkdir()
    data.write_bytes(b"0123456789")
    inputs = input_entries([data])
    assert inputs == [{"path": str(data.resolve()), "bytes": 10, "mtime_ns": data.stat().st_mtime_ns}]
    write_set(graph, out, 2, inputs=inputs)
    assert read_manifest(out)["dataset"]["inputs"] == inputs
    info = method_info("metis", "cut", 0)
    assert find_reusable(out, graph.name, 2, info, inputs=input_entries([data])) == read_manifest(out)

    copy = tmp_path / "elsewhere" / "graph.bin"  # the same bytes in another --data-dir
    copy.parent.mkdir()
    copy.write_bytes(data.read_bytes())
    os.utime(copy, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns))
    with pytest.raises(UserError, match="other or since changed input files"):
        find_reusable(out, graph.name, 2, info, inputs=input_entries([copy]))
    stat = data.stat()
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # edited in place, same size
    with pytest.raises(UserError, match="other or since changed input files"):
        find_reusable(out, graph.name, 2, info, inputs=input_entries([data]))
    assert find_reusable(out, graph.name, 2, info, force=True, inputs=input_entries([data])) is None


def test_set_without_recorded_inputs_counts_as_made_from_none(tmp_path):
    """Sets written before ``dataset.inputs`` existed: a synthetic one is still reused."""
    graph = random_graph(120, 500)
    out = tmp_path / "set"
    write_set(graph, out, 2)
    manifest = read_manifest(out)
    del manifest["dataset"]["inputs"]
    manifest.pop("format"), manifest.pop("version")
    write_manifest(out, manifest)
    info = method_info("metis", "cut", 0)
    assert find_reusable(out, graph.name, 2, info) == read_manifest(out)
    data = tmp_path / "graph.bin"
    data.write_bytes(b"0123")
    with pytest.raises(UserError, match="other or since changed input files"):
        find_reusable(out, graph.name, 2, info, inputs=input_entries([data]))


def test_truncated_set_is_not_reused(tmp_path):
    graph = random_graph(120, 500)
    out = tmp_path / "set"
    write_set(graph, out, 2)
    features = out / "part-1" / "features.npy"
    features.write_bytes(features.read_bytes()[:-8])
    info = method_info("metis", "cut", 0)
    with pytest.raises(UserError, match="incomplete"):
        find_reusable(out, graph.name, 2, info)
    assert find_reusable(out, graph.name, 2, info, force=True) is None
    write_set(graph, out, 2, force=True)
    check_partition_set(graph, out, 2)


def test_foreign_directory_is_never_replaced(tmp_path):
    graph = random_graph(60, 200)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    for force in (False, True):
        with pytest.raises(UserError, match="not a partition set"):
            write_set(graph, out, 2, force=force)
    assert (out / "notes.txt").read_text() == "keep me"


def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    graph = random_graph(120, 500)
    out = tmp_path / "new" / "set"
    real_write_array = writer_module.write_array
    calls = {"n": 0}

    def failing_write_array(part_dir, name, array):
        calls["n"] += 1
        if calls["n"] == len(PART_ARRAYS) + 3:  # part-1, a few arrays in
            raise KeyboardInterrupt
        return real_write_array(part_dir, name, array)

    monkeypatch.setattr(writer_module, "write_array", failing_write_array)
    with pytest.raises(KeyboardInterrupt):
        write_set(graph, out, 3)
    assert list(tmp_path.iterdir()) == []  # not even the parent created for it

    # An interrupted --force rewrite keeps the old, valid set.
    monkeypatch.setattr(writer_module, "write_array", real_write_array)
    write_set(graph, out, 3)
    calls["n"] = 0
    monkeypatch.setattr(writer_module, "write_array", failing_write_array)
    with pytest.raises(KeyboardInterrupt):
        write_set(graph, out, 3, seed=9, force=True)
    assert sorted(p.name for p in out.parent.iterdir()) == ["set"]
    assert read_manifest(out)["partitioner"]["seed"] == 0
    check_partition_set(graph, out, 3)


def test_stale_temporaries_of_dead_runs_are_removed(tmp_path):
    finished = subprocess.Popen([sys.executable, "-c", ""])
    finished.wait()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        host = socket.gethostname()
        names = {
            f"set.tmp-{host}-{finished.pid}": False,  # its run was killed: removed
            f"set.tmp-{host}-{os.getpid()}": False,  # ours, from a killed run that had our pid: removed
            f"set.tmp-{host}-{running.pid}": True,  # a run still writing: kept
            f"set.tmp-other-{host}-{finished.pid}": True,  # another machine's (pids mean nothing here): kept
            f"other.tmp-{host}-{finished.pid}": True,  # another set's: kept
            "set.tmp-notes": True,  # not ours at all: kept
        }
        for name in names:
            (tmp_path / name / "part-0").mkdir(parents=True)
            (tmp_path / name / "part-0" / "features.npy").write_bytes(b"x")
        remove_stale_temporaries(tmp_path / "set")
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(name for name, kept in names.items() if kept)
    finally:
        running.kill()
        running.wait()


def stand_in_metis(monkeypatch, kway) -> None:
    """Replace the METIS routine by ``kway`` (which runs where METIS would: in the child)."""
    _, *rest = partitioner_module._metis_kway()
    monkeypatch.setattr(partitioner_module, "_metis_kway", lambda: (kway, *rest))


def test_metis_killed_for_lack_of_memory_is_a_user_error(monkeypatch):
    test_pid = os.getpid()

    def killed_kway(*args):
        if os.getpid() != test_pid:  # never kill the test itself
            os.kill(os.getpid(), signal.SIGKILL)
        return -1

    stand_in_metis(monkeypatch, killed_kway)
    with pytest.raises(UserError, match=r"METIS was killed \(SIGKILL\).*memory.*--method random"):
        assign(random_graph(), 2)


def test_self_loops_in_graph_are_rejected(tmp_path):
    graph = path_graph(5)
    graph.indices = graph.indices.copy()
    graph.indices[0] = 0  # node 0 now lists itself
    with pytest.raises(ValueError, match="self-loops"):
        write_set(graph, tmp_path / "set", 1)
    assert not (tmp_path / "set").exists()


def test_report_table_lists_every_partition(tmp_path):
    graph = random_graph(200, 800)
    report = write_set(graph, tmp_path / "set", 3)["report"]
    table = format_report(report)
    lines = table.splitlines()
    assert len(lines) == 2 + 3 + 1 + 2
    for row in report["rows"]:
        assert any(
            line.split()[:3] == [str(row["part"]), f"{row['inner']:,}", f"{row['boundary']:,}"] for line in lines
        )
    ratios = [row["boundary"] / row["inner"] for row in report["rows"]]
    assert report["totals"]["ratio_max"] == pytest.approx(max(ratios), abs=1e-4)
    assert report["totals"]["ratio_mean"] == pytest.approx(np.mean(ratios), abs=1e-4)


def test_worked_example_of_the_format_docs(tmp_path):
    """The 5-node example of docs/partition-format.md, derived by hand."""
    graph = make_graph("tiny", np.array([0, 1, 2, 3, 1]), np.array([1, 2, 3, 4, 4]), 5, seed=0)
    write_partition_set(
        graph,
        np.array([0, 0, 1, 1, 0]),
        tmp_path / "set",
        parts=2,
        method_info=method_info("metis", "cut", 0),
        progress=False,
    )
    expected = [
        {
            "inner_nodes": [0, 1, 4],
            "boundary_nodes": [2, 3],
            "boundary_offsets": [0, 0, 2],
            "adj_indptr": [0, 2, 6, 9],
            "adj_indices": [0, 1, 0, 1, 2, 3, 1, 2, 4],
            "degree": [2, 4, 3, 3, 3],
            "send_offsets": [0, 0, 2],
            "send_nodes": [1, 2],
        },
        {
            "inner_nodes": [2, 3],
            "boundary_nodes": [1, 4],
            "boundary_offsets": [0, 2, 2],
            "adj_indptr": [0, 3, 6],
            "adj_indices": [0, 1, 2, 0, 1, 3],
            "degree": [3, 3, 4, 3],
            "send_offsets": [0, 2, 2],
            "send_nodes": [0, 1],
        },
    ]
    for k, arrays in enumerate(expected):
        loaded = load_partition(tmp_path / "set", k)
        for name, values in arrays.items():
            assert loaded[name].tolist() == values, (k, name)
    rows = read_manifest(tmp_path / "set")["report"]["rows"]
    assert [(r["local_edges"], r["cut_edges"], r["ratio"]) for r in rows] == [(4, 2, 0.6667), (2, 2, 1.0)]
