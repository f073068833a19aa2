"""The Python API (docs/api.md): ``bnsgcn.partition`` from every form of graph, ``bnsgcn.train``
returning the model, metrics and scores, bad input raising the commands' messages, scripts
without a main guard, Ctrl-C stopping every rank, and the documented example as written.

PyG, DGL and OGB objects are stand-ins with the attributes the API reads (neither
torch_geometric nor dgl is installed here).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import bnsgcn
from bnsgcn.errors import UserError
from bnsgcn.launch.api import RankFailed, Result
from bnsgcn.run.inference import read_whole_graph

from .helpers import REPO, kernels
from .helpers.cli import PARTITION, SMALL_RUN, TRAIN, clean_env, run_cli
from .helpers.faults import (
    START_S,
    assert_all_gone,
    descendants,
    kill_job,
    last_epoch,
    rank_process,
    start,
    stderr_of,
    wait_for,
)
from .helpers.graphs import random_graph, write_npz

API_DOC = REPO / "docs" / "api.md"
SCRIPT_TIMEOUT_S = 300
TRAIN_SETTINGS = dict(layers=2, hidden=8, threads=1, timeout=60)


def _edge_list(graph) -> np.ndarray:
    """The graph's directed edges as [2, E], sources first."""
    return np.stack([graph.indices.astype(np.int64), np.repeat(np.arange(graph.num_nodes), graph.in_degree())])


def _pyg(graph) -> SimpleNamespace:
    """A PyG ``Data`` stand-in holding torch tensors, as PyG does (labels [N, 1], as ogbn-arxiv's)."""
    return SimpleNamespace(
        edge_index=torch.from_numpy(_edge_list(graph)),
        x=torch.from_numpy(graph.features),
        y=torch.from_numpy(graph.labels)[:, None],
        train_mask=torch.from_numpy(graph.train_mask),
        val_mask=torch.from_numpy(graph.val_mask),
        test_mask=torch.from_numpy(graph.test_mask),
        num_nodes=graph.num_nodes,
    )


class _DGLGraph:
    """A DGL graph stand-in: ``edges()``, ``num_nodes()``, ``ndata``, ``ntypes``."""

    ntypes = ["_N"]

    def __init__(self, graph) -> None:
        self._edges = torch.from_numpy(_edge_list(graph))
        self._n = graph.num_nodes
        self.ndata = {
            "feat": torch.from_numpy(graph.features),
            "label": torch.from_numpy(graph.labels),
            "train_mask": torch.from_numpy(graph.train_mask),
            "val_mask": torch.from_numpy(graph.val_mask),
            "test_mask": torch.from_numpy(graph.test_mask),
        }

    def edges(self):
        return self._edges[0], self._edges[1]

    def num_nodes(self) -> int:
        return self._n


class _OGBDataset:
    """An ``ogb.nodeproppred.NodePropPredDataset`` stand-in: ``dataset[0]`` is (graph dict,
    float labels [N, 1]), the split names validation ``valid``."""

    name = "ogbn-standin"

    def __init__(self, graph) -> None:
        self.graph = {
            "edge_index": _edge_list(graph),
            "node_feat": graph.features,
            "edge_feat": None,
            "num_nodes": graph.num_nodes,
        }
        self.labels = graph.labels[:, None].astype(np.float64)
        self.num_classes = graph.num_classes
        self.split = {k: np.flatnonzero(getattr(graph, f"{m}_mask")) for k, m in (("train", "train"), ("valid", "val"))}
        self.split["test"] = np.flatnonzero(graph.test_mask)

    def __getitem__(self, index):
        assert index == 0
        return self.graph, self.labels

    def get_idx_split(self):
        return self.split


def _split(graph) -> dict:
    return {"train": graph.train_mask, "val": np.flatnonzero(graph.val_mask), "test": graph.test_mask}


def _form(kind: str, graph) -> tuple[object, dict]:
    """``graph`` in the form ``kind`` and the arguments that go with it."""
    arrays = dict(features=graph.features, labels=graph.labels, split=_split(graph))
    if kind == "pyg":
        return _pyg(graph), {}
    if kind == "dgl":
        return _DGLGraph(graph), {}
    if kind == "ogb":
        return _OGBDataset(graph), {}
    if kind == "edge list":
        return _edge_list(graph), arrays
    if kind == "csr pair":
        return (graph.indptr, graph.indices), arrays
    if kind == "scipy":
        sparse = pytest.importorskip("scipy.sparse")
        n = graph.num_nodes
        return sparse.csr_matrix((np.ones(graph.num_edges), graph.indices, graph.indptr), shape=(n, n)), arrays
    raise AssertionError(kind)


def _assert_same_graph(parts_dir: Path, graph) -> None:
    """The set's graph, read back from its partitions, is ``graph`` (plus one self-loop per node)."""
    whole = read_whole_graph(parts_dir)
    n = graph.num_nodes
    rows = np.repeat(np.arange(n), np.diff(whole.indptr))
    off_diagonal = rows != whole.indices
    assert (~off_diagonal).sum() == n  # one self-loop each
    expected = np.repeat(np.arange(n), graph.in_degree())
    assert np.array_equal(rows[off_diagonal], expected)
    assert np.array_equal(whole.indices[off_diagonal], graph.indices)
    assert np.array_equal(whole.features, graph.features) and np.array_equal(whole.labels, graph.labels)
    for mask in ("train_mask", "val_mask", "test_mask"):
        assert np.array_equal(getattr(whole, mask), getattr(graph, mask)), mask


# --- import -----------------------------------------------------------------------------------


def test_importing_bnsgcn_loads_neither_torch_nor_numba(tmp_path):
    code = (
        "import sys, bnsgcn\n"
        "print(sorted(m for m in sys.modules if m.startswith('bnsgcn')))\n"
        "api = (bnsgcn.partition, bnsgcn.train, bnsgcn.Result, bnsgcn.PartitionSet, bnsgcn.TrainConfig)\n"
        "print(callable(bnsgcn.partition), sorted({'torch', 'numba', 'bnsgcn.partition.cli'} & set(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded, api = done.stdout.splitlines()
    assert loaded == "['bnsgcn', 'bnsgcn.errors']"
    assert api == "True []"


# --- bnsgcn.partition ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["pyg", "dgl", "ogb", "edge list", "csr pair", "scipy"])
def test_partition_from_an_object_writes_its_graph(tmp_path, kind):
    graph = random_graph(num_nodes=60, seed=4)
    obj, arguments = _form(kind, graph)
    parts = bnsgcn.partition(obj, 3, tmp_path / "set", method="random", progress=False, **arguments)
    manifest = json.loads((tmp_path / "set" / "manifest.json").read_text())
    assert parts.path == tmp_path / "set" and os.fspath(parts) == str(tmp_path / "set")
    assert (parts.parts, parts.num_nodes, parts.num_features, parts.num_classes) == (3, 60, 8, 3)
    assert parts.num_edges == graph.num_edges and not parts.reused
    assert list(parts.inner) == [p["n_inner"] for p in manifest["partitions"]] and sum(parts.inner) == 60
    assert list(parts.boundary) == [p["n_boundary"] for p in manifest["partitions"]]
    assert list(parts.train) == [p["train_nodes"] for p in manifest["partitions"]]
    assert sum(parts.train) == graph.train_mask.sum()
    assert re.match(r"memory:[0-9a-f]{16}$", manifest["dataset"]["spec"])
    assert parts.report().splitlines()[0].split()[:3] == ["part", "inner", "boundary"]
    _assert_same_graph(parts.path, graph)


def test_partition_of_the_same_graph_is_reused_and_of_a_changed_one_refused(tmp_path):
    graph = random_graph(num_nodes=60, seed=4)
    first = bnsgcn.partition(_pyg(graph), 2, tmp_path / "set", method="random", progress=False)
    again = bnsgcn.partition(_DGLGraph(graph), 2, tmp_path / "set", method="random", progress=False)
    assert again.reused and again.manifest["set_id"] == first.manifest["set_id"]
    changed = _pyg(graph)
    changed.x = changed.x + 1
    with pytest.raises(UserError, match="holds a different partition set; pass --force"):
        bnsgcn.partition(changed, 2, tmp_path / "set", method="random", progress=False)
    replaced = bnsgcn.partition(changed, 2, tmp_path / "set", method="random", progress=False, force=True)
    assert not replaced.reused and replaced.manifest["set_id"] != first.manifest["set_id"]


def test_partition_from_a_dataset_name_is_the_commands_set(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_npz(data / "small.npz")
    parts = bnsgcn.partition("npz:small.npz", 2, tmp_path / "api", data_dir=data, progress=False)
    outcome = run_cli(PARTITION, ["npz:small.npz", "--parts", "2", "--data-dir", str(data), "--out", "cli"], tmp_path)
    assert outcome.code == 0, outcome.stderr
    cli = json.loads((tmp_path / "cli" / "manifest.json").read_text())
    assert parts.manifest["set_id"] == cli["set_id"]  # the same bytes in every file
    assert parts.manifest["dataset"]["inputs"] == cli["dataset"]["inputs"]
    assert parts.report() in outcome.stdout


@pytest.mark.parametrize(
    "call, flags, message",
    [
        (dict(parts=0), ["--parts", "0"], "--parts 0 must be at least 1; pass e.g. --parts 2"),
        (dict(method="metsi"), ["--method", "metsi"], "argument --method: invalid choice: 'metsi'"),
        (dict(memory_limit="8Q"), ["--memory-limit", "8Q"], "invalid size '8Q'"),
        (dict(parts=100), ["--parts", "100"], "--parts 100 exceeds the 40 nodes of the graph"),
    ],
)
def test_partition_refuses_bad_input_with_the_commands_message(tmp_path, call, flags, message):
    data = tmp_path / "data"
    data.mkdir()
    write_npz(data / "small.npz")
    with pytest.raises(UserError) as raised:
        bnsgcn.partition("npz:small.npz", **({"parts": 2} | call), out=tmp_path / "api", data_dir=data, progress=False)
    outcome = run_cli(PARTITION, ["npz:small.npz", "--data-dir", str(data), "--out", "cli", *flags], tmp_path)
    assert outcome.code == 2 and outcome.last_line.endswith(str(raised.value)), (outcome.last_line, raised.value)
    assert message in str(raised.value)
    assert not (tmp_path / "api").exists()


def test_partition_names_what_an_object_lacks(tmp_path):
    graph = random_graph(num_nodes=30, seed=1)
    data = _pyg(graph)
    data.train_mask = data.val_mask = data.test_mask = None
    with pytest.raises(UserError, match=r"graph \(PyG Data\): no split; pass split="):
        bnsgcn.partition(data, 2, tmp_path / "set", progress=False)
    with pytest.raises(UserError, match="no labels; pass labels=y"):
        bnsgcn.partition(_edge_list(graph), 2, tmp_path / "set", features=graph.features, progress=False)
    with pytest.raises(UserError, match="the split has no 'test' entry"):
        bnsgcn.partition(data, 2, tmp_path / "set", split={"train": graph.train_mask, "val": []}, progress=False)
    with pytest.raises(UserError, match="not a graph bnsgcn reads"):
        bnsgcn.partition(object(), 2, tmp_path / "set", progress=False)
    assert not (tmp_path / "set").exists()


# --- bnsgcn.train --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Result, Path]:
    """2 ranks, 3 epochs on a random graph partitioned through the API: the result and the set."""
    kernels.compiled()
    root = tmp_path_factory.mktemp("trained")
    graph = random_graph(num_nodes=60, seed=4)
    parts = bnsgcn.partition(_pyg(graph), 2, root / "set", method="random", progress=False)
    result = bnsgcn.train(parts, procs=2, epochs=3, eval_every=1, out=root / "run", **TRAIN_SETTINGS)
    return result, parts.path


def test_train_returns_the_model_metrics_and_scores_of_the_run(trained):
    result, parts_dir = trained
    lines = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert result.metrics == lines[:-1] and [m["epoch"] for m in result.metrics] == [1, 2, 3]
    assert result.summary == lines[-1] and result.summary["summary"] is True
    assert result.parts_dir == parts_dir.resolve() and result.config.run.epochs == 3
    assert all(p.device.type == "cpu" for p in result.model.parameters()) and not result.model.training
    saved = torch.load(result.run_dir / "best_model.pt", weights_only=True)
    assert all(torch.equal(saved[k], v) for k, v in result.model.state_dict().items())
    logits = result.logits()
    assert logits.shape == (60, 3) and torch.isfinite(logits).all()
    # the run evaluated the same parameters over the same graph, partitioned: the same scores
    whole = read_whole_graph(parts_dir)
    hits = (logits.argmax(1).numpy() == whole.labels).astype(float)
    assert hits[whole.val_mask].mean() == pytest.approx(result.best_val_score)
    assert hits[whole.test_mask].mean() == pytest.approx(result.test_score)
    assert result.best_epoch in (1, 2, 3)


def test_train_refuses_bad_input_with_the_commands_message(trained, tmp_path, monkeypatch):
    _, parts_dir = trained
    monkeypatch.chdir(tmp_path)  # where a run without out would go: runs/<timestamp>
    with pytest.raises(UserError) as raised:
        bnsgcn.train(parts_dir, procs=2, p=1.5)
    outcome = run_cli(TRAIN, ["--procs", "2", "--parts-dir", str(parts_dir), "--p", "1.5"], tmp_path)
    assert (
        outcome.last_line
        == f"error: {raised.value}"
        == "error: --p 1.5 is outside [0, 1]; pass a probability such as --p 0.1"
    )
    with pytest.raises(UserError) as raised:
        bnsgcn.train(parts_dir, procs=3, out=tmp_path / "run")
    outcome = run_cli(TRAIN, ["--procs", "3", "--parts-dir", str(parts_dir)], tmp_path)
    assert outcome.last_line == f"error: {raised.value}"
    with pytest.raises(TypeError, match="unknown training setting 'epoch'"):
        bnsgcn.train(parts_dir, procs=2, epoch=3)
    with pytest.raises(UserError, match=r"argument --hidden: invalid int value: '8\.5'"):
        bnsgcn.train(parts_dir, procs=2, hidden=8.5)
    assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()


def test_a_rank_that_fails_raises_the_commands_last_line(trained, tmp_path):
    result, parts_dir = trained
    # the run directory of the fixture holds a run: the ranks refuse to write into it
    argv = ["--procs", "2", "--parts-dir", str(parts_dir), "--out", str(result.run_dir), *SMALL_RUN]
    outcome = run_cli(TRAIN, argv, tmp_path)
    with pytest.raises(RankFailed) as raised:
        bnsgcn.train(parts_dir, procs=2, out=result.run_dir, epochs=2, eval_every=1, **TRAIN_SETTINGS)
    assert isinstance(raised.value, UserError) and raised.value.status == outcome.code == 2

    # every rank refuses; the first to exit is named, either may be first
    def any_rank(line: str) -> str:
        return re.sub(r"rank \d", "rank R", line)

    assert any_rank(outcome.last_line) == any_rank(f"error: {raised.value}")
    assert re.match(r"rank (\d) failed \(exit code 2\): error: \[rank \1\] .* holds an earlier run", str(raised.value))


def _script(tmp_path: Path, parts_dir: Path, epochs: int) -> Path:
    """A script that trains at its top level, without a main guard."""
    script = tmp_path / "train_here.py"
    script.write_text(
        textwrap.dedent(
            f"""\
            import bnsgcn

            result = bnsgcn.train({str(parts_dir)!r}, procs=2, epochs={epochs}, out="run", **{TRAIN_SETTINGS!r})
            print("trained", result.best_epoch, tuple(result.logits().shape))
            """
        )
    )
    return script


def test_a_script_without_a_main_guard_trains(trained, tmp_path):
    _, parts_dir = trained
    script = _script(tmp_path, parts_dir, epochs=2)
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    assert re.search(r"^trained [12] \(60, 3\)$", done.stdout, re.MULTILINE), done.stdout


def test_ctrl_c_stops_every_rank(trained, tmp_path):
    _, parts_dir = trained
    script = _script(tmp_path, parts_dir, epochs=100_000)
    run_dir = tmp_path / "run"
    job = start([sys.executable, str(script)], tmp_path, "job")
    try:
        wait_for(lambda: last_epoch(run_dir) >= 1, job, START_S, "training under way")
        processes = descendants(job.pid)
        ranks = [rank_process(processes, rank) for rank in (0, 1)]
        job.send_signal(signal.SIGINT)  # the script's process alone, as Ctrl-C in a notebook reaches the kernel
        job.wait(60)
    finally:
        kill_job(job)
    stderr = stderr_of(tmp_path, "job")
    assert job.returncode == -signal.SIGINT, stderr  # an uncaught KeyboardInterrupt
    assert "error: interrupted by SIGINT; stopped all 2 local ranks" in stderr
    # raised by the signal itself, or, where the caller's SIGINT handler is not Python's, with the message
    assert stderr.rstrip().splitlines()[-1].partition(":")[0] == "KeyboardInterrupt", stderr
    assert_all_gone(ranks + processes, run_dir)


# --- the documentation ---------------------------------------------------------------------------


def test_the_documented_example_runs_as_written(tmp_path):
    section = API_DOC.read_text().split("\n## Example\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    (tmp_path / "example.py").write_text(block)
    kernels.compiled()
    done = subprocess.run(
        [sys.executable, "example.py"],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "parts" / "example-2" / "manifest.json").is_file()
    assert (tmp_path / "runs" / "example" / "best_model.pt").is_file()
    accuracy = re.search(r"^test accuracy ([0-9.]+) = ([0-9.]+)$", done.stdout, re.MULTILINE)
    assert accuracy and float(accuracy[1]) == pytest.approx(float(accuracy[2])), done.stdout
    assert "predictions agree True" in done.stdout and "export agrees True" in done.stdout, done.stdout
    assert (tmp_path / "runs" / "example" / "predictions.pt").is_file()
