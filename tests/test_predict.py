"""bnsgcn-predict (bnsgcn.run.predict) and bnsgcn.export (bnsgcn.run.export): a run's model
over every node, on the ranks of its partition set and as a plain module, against whole-graph
inference in one process."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import bnsgcn
from bnsgcn.config import TrainConfig
from bnsgcn.data.format import ROW_NORMALISE, read_manifest
from bnsgcn.errors import UserError
from bnsgcn.nn.model import build_model
from bnsgcn.partition.graph import Graph
from bnsgcn.run.inference import load_model, read_whole_graph, whole_graph_logits
from bnsgcn.run.predict import PredictRequest, check_request, run, trained_on
from tests.helpers import kernels
from tests.helpers.cli import assert_user_error, run_cli
from tests.helpers.graphs import partition, random_graph
from tests.helpers.ranks import run_ranks

# the built-in models, with and without the first layer's precomputed aggregation where it has one
MODELS = {
    "gcn": {"model": "gcn"},
    "gcn-no-precompute": {"model": "gcn", "precompute": False},
    "graphsage": {"model": "graphsage", "norm": "batch"},
    "graphsage-no-precompute": {"model": "graphsage", "precompute": False},
    "gat": {"model": "gat", "heads": 2},
    # two models of the user's own, written against the public aggregation call
    "gin": {"model": "tests.helpers.user_models:GIN", "model_options": '{"eps": 0.2, "train_eps": true}'},
    "appnp": {"model": "tests.helpers.user_models:APPNPNet", "model_options": '{"K": 3, "alpha": 0.2}'},
}
BUILTIN = [name for name, settings in MODELS.items() if ":" not in settings["model"]]


def raw_graph() -> tuple[Graph, np.ndarray]:
    """A random graph whose loader row-normalised its features: the graph, and the features before."""
    graph = random_graph(num_nodes=50, features=6)
    raw = np.abs(graph.features) * 3
    raw[5] = 0  # a row summing to 0 stays as it is
    sums = raw.sum(1, keepdims=True)
    graph.features = np.divide(raw, sums, out=raw.copy(), where=sums > 0).astype(np.float32)
    graph.feature_preprocessing = {"kind": ROW_NORMALISE}
    return graph, raw


def make_run(run_dir: Path, parts: Path, seed: int, **settings) -> Path:
    """A run directory as training leaves it (config.json, best_model.pt) with random parameters."""
    run_dir.mkdir(parents=True)
    config = TrainConfig.from_settings(parts_dir=parts, layers=3, hidden=8, **settings).resolved(run_dir, "cpu", 1)
    dataset = read_manifest(parts)["dataset"]
    torch.manual_seed(seed)
    model = build_model(config, dataset["num_features"], dataset["num_classes"], lambda t: t)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.copy_(torch.rand_like(tensor) + 0.5 if tensor.dtype.is_floating_point else tensor)
    torch.save(model.state_dict(), run_dir / "best_model.pt")
    (run_dir / "config.json").write_text(json.dumps(config.to_json() | trained_on(read_manifest(parts))))
    return run_dir


def predict_rank(job: tuple[TrainConfig, PredictRequest]) -> dict | None:
    """One rank of a prediction job; arrays as numpy (a tensor crosses a queue as shared memory that
    the rank's exit takes away)."""
    written = run(*job)
    return None if written is None else {k: v.numpy() for k, v in written.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A partition set of 2 (random assignment: each partition's rows are not in node order),
    a run per model, and each run's predictions and layer-1 embeddings from 2 ranks."""
    root = tmp_path_factory.mktemp("predict")
    graph, raw = raw_graph()
    parts = partition(graph, 2, root / "parts").resolve()
    dirs = {name: make_run(root / name, parts, seed, **s) for seed, (name, s) in enumerate(MODELS.items())}
    asked = [  # (model, out, embeddings): a user's model has no layer to take embeddings from
        (name, dirs[name] / out, embeddings)
        for name in dirs
        for out, embeddings in (("p.pt", None), ("e.npy", 2))
        if name in BUILTIN or embeddings is None
    ]
    jobs = [check_request(dirs[name], out, embeddings) for name, out, embeddings in asked]
    results = run_ranks(2, [(config.replace(threads=1), request) for config, request in jobs], work=predict_rank)
    assert all(r is None for r in results[1]), "only rank 0 returns what it wrote"
    outputs: dict[str, list[dict]] = {}
    for (name, _, _), written in zip(asked, results[0]):
        outputs.setdefault(name, []).append({k: torch.from_numpy(v) for k, v in written.items()})
    return graph, raw, parts, dirs, outputs


@pytest.mark.parametrize("name", list(MODELS))
def test_predictions_equal_whole_graph_inference_in_node_order(runs, name):
    graph, _, parts, dirs, outputs = runs
    predicted = outputs[name][0]
    model, config = load_model(dirs[name])
    expected = whole_graph_logits(model, config, read_whole_graph(parts))
    assert predicted["logits"].shape == (graph.num_nodes, graph.num_classes)
    torch.testing.assert_close(predicted["logits"], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(predicted["predictions"], expected.argmax(1))
    assert torch.equal(predicted["node_ids"], torch.arange(graph.num_nodes))
    # what was written is what was returned; the last layer's output is the logits
    written = torch.load(dirs[name] / "p.pt", weights_only=True)
    assert torch.equal(written["logits"], predicted["logits"])
    if name in BUILTIN:
        embeddings = outputs[name][1]
        torch.testing.assert_close(torch.from_numpy(np.load(dirs[name] / "e.npy")), predicted["logits"])
        torch.testing.assert_close(embeddings["embeddings"], predicted["logits"])


@pytest.mark.parametrize("name", list(MODELS))
def test_export_equals_the_predictions_from_raw_features(runs, name, tmp_path):
    graph, raw, _, dirs, outputs = runs
    exported = bnsgcn.export(dirs[name])
    dst = np.repeat(np.arange(graph.num_nodes), np.diff(graph.indptr))
    edge_index = torch.from_numpy(np.stack([graph.indices.astype(np.int64), dst]))
    with torch.no_grad():
        logits = exported(torch.from_numpy(raw), edge_index)
    torch.testing.assert_close(logits, outputs[name][0]["logits"], atol=1e-5, rtol=1e-5)
    # the parameters round-trip through a file into a new module
    torch.save(exported.state_dict(), tmp_path / "exported.pt")
    again = _new_module(dirs[name])
    again.load_state_dict(torch.load(tmp_path / "exported.pt", weights_only=True))
    with torch.no_grad():
        assert torch.equal(again.eval()(torch.from_numpy(raw), edge_index), logits)


def _new_module(run_dir: Path) -> torch.nn.Module:
    """An exported module of ``run_dir``'s model with fresh parameters."""
    from bnsgcn.nn.user_model import build_user_model
    from bnsgcn.run.export import ExportedGNN, ExportedUserModel
    from bnsgcn.run.inference import run_config

    config = run_config(run_dir)
    dataset = read_manifest(config.data.parts_dir)["dataset"]
    features, classes = dataset["num_features"], dataset["num_classes"]
    if config.model.builtin:
        return ExportedGNN(config, features, classes, ROW_NORMALISE)
    return ExportedUserModel(build_user_model(config, features, classes), features, ROW_NORMALISE)


def test_predict_refuses_bad_input_with_one_line(runs, tmp_path):
    _, _, parts, dirs, _ = runs
    run_dir = dirs["gcn"]
    with pytest.raises(UserError, match="is not a directory"):
        check_request(tmp_path / "nothing")
    empty = tmp_path / "no-model"
    empty.mkdir()
    (empty / "config.json").write_text((run_dir / "config.json").read_text())
    with pytest.raises(UserError, match="best_model.pt is missing"):
        check_request(empty)
    with pytest.raises(UserError, match="out of range: the model has 3 layers; pass 0 to 2"):
        check_request(run_dir, embeddings=3)
    with pytest.raises(UserError, match="--embeddings reads a layer of the built-in models"):
        check_request(dirs["gin"], embeddings=0)
    with pytest.raises(UserError, match="unknown suffix '.csv'"):
        check_request(run_dir, tmp_path / "p.csv")
    other, _ = raw_graph()
    other.features = other.features[:, :4]
    other_parts = partition(other, 2, tmp_path / "other")
    with pytest.raises(UserError, match="no longer matches"):
        check_request(run_dir, parts_dir=other_parts)
    with pytest.raises(UserError, match="unknown"):
        unrecorded = tmp_path / "unrecorded"
        unrecorded.mkdir()
        settings = json.loads((run_dir / "config.json").read_text())
        settings["feature_preprocessing"] = {"kind": "unknown"}
        (unrecorded / "config.json").write_text(json.dumps(settings))
        (unrecorded / "best_model.pt").write_bytes((run_dir / "best_model.pt").read_bytes())
        bnsgcn.export(unrecorded)
    assert bnsgcn.export(unrecorded, preprocessing="none").preprocessing.kind == "none"


def test_the_partition_step_records_the_features_preprocessing(runs):
    _, _, parts, _, _ = runs
    assert read_manifest(parts)["dataset"]["feature_preprocessing"] == {"kind": ROW_NORMALISE}


PREDICT = [sys.executable, "-m", "bnsgcn.launch.predict"]


def test_the_command_writes_npy_files_and_refuses_bad_input_with_one_line(runs, tmp_path):
    _, _, _, dirs, outputs = runs
    kernels.compiled()
    outcome = run_cli(PREDICT, [str(dirs["gat"]), "--procs", "2", "--out", str(tmp_path / "gat.npy")], tmp_path)
    assert outcome.code == 0, outcome.stderr
    assert np.array_equal(np.load(tmp_path / "gat.npy"), outputs["gat"][0]["logits"].numpy())
    assert np.array_equal(np.load(tmp_path / "gat.predictions.npy"), outputs["gat"][0]["predictions"].numpy())
    refused = run_cli(PREDICT, [str(dirs["gat"]), "--embeddings", "7"], tmp_path)
    assert_user_error(refused, "--embeddings 7 is out of range")
    assert not (dirs["gat"] / "predictions.pt").exists()


def test_prediction_ranks_share_gpus_as_training_ranks_do(runs, monkeypatch):
    """--gpus 1 --ranks-per-gpu 2 on a one-GPU machine: two CUDA ranks, each told K (whatever
    the training run used); K without --gpus is refused in one line."""
    from bnsgcn.launch.predict import prepare
    from bnsgcn.launch.rank import training_parser

    _, _, _, dirs, _ = runs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    children, _ = prepare(dirs["gcn"], None, None, None, None, 1, ranks_per_gpu=2)
    assert [c.env["LOCAL_RANK"] for c in children] == ["0", "1"]
    for child in children:
        assert child.argv[3] == "--rank"  # then the request, then the training flags
        flags = training_parser("rank").parse_args(child.argv[5:])
        assert (flags.device, flags.ranks_per_gpu) == ("cuda", 2)
    with pytest.raises(UserError, match="^--ranks-per-gpu 2 shares CUDA GPUs among ranks but no --gpus was given"):
        prepare(dirs["gcn"], None, None, None, None, None, ranks_per_gpu=2)
