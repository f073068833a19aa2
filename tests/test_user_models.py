"""Models of the user's own (docs/api.md, "Your own model"): GIN and APPNP, written against the
public API alone (tests/helpers/user_models.py), equal PyG's layers with the same weights, train
partition-parallel exactly as a dense single-process reference does, resume bit for bit under
staleness and int8 rows, learn Cora at p = 0.1 on 4 ranks; a bad --model is one line (through
the command: tests/test_errors.py); the documented example runs as written.

Cora's bars: the test accuracy at the best validation epoch of seed 0 (20 epochs, evaluated every
10, METIS 4 parts, p = 0.1) must reach 0.62 for both models, about twice the majority class's
share of the test nodes (0.319). Measured 2026-11-29 (2 cores), seeds 0-4: GIN 0.735, 0.740,
0.704, 0.697, 0.719; APPNP 0.738, 0.780, 0.719, 0.698, 0.800, so the bar is 7.7 points below
the lowest seed of either (another machine's float rounding moves a seed's score about as much as
another seed does). GIN has one layer here: two layers of sum aggregation over Cora's
row-normalised features need more than 20 epochs to learn steadily (seeds 0-2 ended at
0.33-0.70). APPNP propagates K = 2 steps: every step aggregates this epoch's sampled boundary
rows scaled by 1/p, an unbiased estimate whose variance the steps compound: at K = 10 and p = 0.1
the model did not learn in 30-40 epochs (test 0.29-0.33; at p = 1, 0.68 after 40).
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import bnsgcn
from bnsgcn.config import TrainConfig
from bnsgcn.data.shard import load_shard
from bnsgcn.errors import UserError
from bnsgcn.kernels import spmm
from bnsgcn.nn import EpochGraph
from bnsgcn.nn.graph import ShardGraph
from bnsgcn.nn.model import build_model
from bnsgcn.run.inference import WholeGraph, whole_graph_logits

from .helpers import REPO, kernels, reference
from .helpers.cli import clean_env
from .helpers.graphs import cora_metis, partition, random_graph
from .helpers.ranks import run_ranks
from .helpers.user_models import GIN, APPNPNet

API_DOC = REPO / "docs" / "api.md"
GIN_PATH, APPNP_PATH = "tests.helpers.user_models:GIN", "tests.helpers.user_models:APPNPNet"
GIN_OPTIONS, APPNP_OPTIONS = json.dumps({"eps": 0.25, "train_eps": True}), json.dumps({"K": 3, "alpha": 0.2})


# --- the dense references: the same models as matrix algebra over the dense adjacency ------------


def _mlp(h: torch.Tensor, params: dict, prefix: str, count: int) -> torch.Tensor:
    """``count`` linear layers ``{prefix}{k}.weight``/``.bias`` (k = 0, 2, ... in a Sequential
    with ReLU between, or 0, 1, ... in a ModuleList) with ReLU between them."""
    keys = sorted({int(k[len(prefix) :].split(".")[0]) for k in params if k.startswith(prefix)})
    assert len(keys) == count, (prefix, keys)
    for j, k in enumerate(keys):
        h = h @ params[f"{prefix}{k}.weight"].T + params[f"{prefix}{k}.bias"]
        if j < count - 1:
            h = torch.relu(h)
    return h


def gin_dense(config: TrainConfig, a: torch.Tensor, params: dict, x: torch.Tensor) -> torch.Tensor:
    """GIN: ``MLP((1 + eps) h_v + sum over N(v) of h_u)`` per layer, ReLU between layers
    (``a``: the adjacency with self-loops, so ``a - I`` is the neighbours')."""
    neighbours = a - torch.eye(a.shape[0], dtype=a.dtype)
    h = x
    for i in range(config.model.layers):
        eps = params.get(f"convs.{i}.eps", config.model.keyword_options.get("eps", 0.0))
        h = _mlp((1 + eps) * h + neighbours @ h, params, f"convs.{i}.mlp.", 2)
        if i < config.model.layers - 1:
            h = torch.relu(h)
    return h


def appnp_dense(config: TrainConfig, a: torch.Tensor, params: dict, x: torch.Tensor) -> torch.Tensor:
    """APPNP: an MLP, then K steps of ``(1 - alpha) D^-1/2 A D^-1/2 h + alpha h0``."""
    options = config.model.keyword_options
    h0 = _mlp(x, params, "lins.", config.model.layers)
    degree = a.sum(1)
    normalised = a / torch.sqrt(degree[:, None] * degree[None, :])
    h = h0
    for _ in range(options["K"]):
        h = (1 - options["alpha"]) * normalised @ h + options["alpha"] * h0
    return h


# --- the primitive: each reduction, over every column and over a sample --------------------------


@pytest.mark.parametrize("built_for", ["sum", "mean", "gcn"])
def test_each_reduction_aggregates_over_the_sampled_columns(tmp_path, built_for):
    """``graph.adjacency(reduce)`` for each reduction, whichever the shard was built for (the
    others share its patterns), equals the dense sum over the inner and the kept boundary
    columns, the kept ones weighted 1/p; and the degrees are the full graph's."""
    parts = partition(random_graph(num_nodes=60, avg_degree=5, seed=9), 2, tmp_path / "parts")
    topology = load_shard(parts, 0, 2).topology
    n, columns = topology.n_inner, topology.n_inner + topology.n_boundary
    pattern = torch.zeros(n, columns, dtype=torch.float64)
    pattern[torch.repeat_interleave(torch.arange(n), topology.indptr.diff()), topology.indices.long()] = 1.0
    degree = topology.degree.double()
    weights = {
        "sum": pattern,
        "mean": pattern / degree[:n, None],
        "gcn": pattern / torch.sqrt(degree[:n, None] * degree[None, :]),
    }
    x = torch.randn(columns, 3)
    shard = ShardGraph(topology, built_for, False, torch.device("cpu"))
    keep = torch.rand(topology.n_boundary, generator=torch.Generator().manual_seed(1)) < 0.5
    for p, kept in ((1.0, torch.ones_like(keep)), (0.5, keep)):
        graph = shard.epoch(kept, p, None, None)
        column_weight = torch.cat([torch.ones(n, dtype=torch.float64), kept.double() / p])
        for reduce, dense in weights.items():
            inner, boundary = graph.adjacency(reduce)
            ours = spmm(inner, x[:n]) + spmm(boundary, x[n:][kept])
            expected = (dense * column_weight) @ x.double()
            message = lambda m, r=reduce, p=p: f"{r} at p={p}: {m}"  # noqa: E731
            torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=1e-6, msg=message)  # float32 sums
    assert torch.equal(graph.degree, topology.degree[:n]) and torch.equal(graph.in_degree, topology.degree[:n] - 1)
    torch.testing.assert_close(graph.gcn_norm, topology.degree[:n] ** -0.5)
    assert graph.num_inner == n and 0 < int(keep.sum()) < topology.n_boundary  # a sample, not every column


# --- at p = 1 in one process: PyG's layers ------------------------------------------------------


def _whole_graph(graph) -> WholeGraph:
    """``graph`` as inference reads a partition set back: every row with its self-loop."""
    n = graph.num_nodes
    rows = np.repeat(np.arange(n), graph.in_degree())
    sources, targets = np.concatenate([graph.indices, np.arange(n)]), np.concatenate([rows, np.arange(n)])
    order = np.lexsort((sources, targets))
    indptr = np.concatenate([[0], np.cumsum(np.bincount(targets, minlength=n))]).astype(np.int64)
    masks = (graph.train_mask, graph.val_mask, graph.test_mask)
    return WholeGraph(indptr, sources[order].astype(np.int32), graph.features, graph.labels, *masks)


def test_gin_and_appnp_equal_pyg_layers_with_the_same_weights():
    pyg = pytest.importorskip("torch_geometric.nn", reason="the test extra installs torch-geometric")
    graph = random_graph(num_nodes=50, avg_degree=4, seed=1)
    rows = np.repeat(np.arange(graph.num_nodes), graph.in_degree())
    edge_index = torch.from_numpy(np.stack([graph.indices.astype(np.int64), rows]))  # no self-loops, as PyG takes it
    x, whole = torch.from_numpy(graph.features), _whole_graph(graph)
    for path, options in ((GIN_PATH, GIN_OPTIONS), (APPNP_PATH, APPNP_OPTIONS)):
        config = TrainConfig.from_settings(model=path, model_options=options, layers=2, hidden=16, dropout=0.5)
        torch.manual_seed(0)
        model = build_model(config, x.shape[1], graph.num_classes, lambda t: t)
        ours = whole_graph_logits(model, config, whole)  # the engine's inference: one partition, every column
        with torch.no_grad():
            if isinstance(model, GIN):
                h = x
                for i, conv in enumerate(model.convs):
                    theirs = pyg.GINConv(copy.deepcopy(conv.mlp), eps=float(conv.eps), train_eps=True)
                    theirs.nn.load_state_dict(conv.mlp.state_dict())  # PyG re-initialises the MLP it is given
                    h = theirs(h, edge_index)
                    h = h.relu() if i < len(model.convs) - 1 else h
            else:
                assert isinstance(model, APPNPNet)
                h = model.lins[1](model.lins[0](x).relu())
                h = pyg.APPNP(model.K, model.alpha)(h, edge_index)
        assert ours.shape == (graph.num_nodes, graph.num_classes)
        torch.testing.assert_close(ours, h, rtol=0, atol=1e-5, msg=lambda m, path=path: f"{path}: {m}")
        assert ours.abs().max() > 1e-2, path  # a match of logits that are not all near zero


def test_a_forward_that_returns_no_logits_is_refused():
    class Transposed(torch.nn.Module):
        def forward(self, x: torch.Tensor, graph: EpochGraph) -> torch.Tensor:
            return graph.aggregate(x).t()

    graph = random_graph(num_nodes=20, seed=2)
    config = TrainConfig.from_settings(model=GIN_PATH)
    with pytest.raises(
        UserError, match=r"^the model's forward returned \[8, 20\]; it must return logits \[num_inner, cl"
    ):
        whole_graph_logits(Transposed(), config, _whole_graph(graph))


# --- partition-parallel training: exact at p = 1; resumed bit for bit under staleness -------------


def test_training_equals_the_dense_reference_and_resumes_exactly(tmp_path):
    """2 ranks at p = 1 without dropout equal full-graph training in one process (every boundary
    row crossing in each aggregation and its gradient back), and so do the scores of their
    evaluation, whose rows cross a column at a time; APPNP at p = 0.5 with dropout, stale int8
    rows and a checkpoint resumes to the very parameters of the uninterrupted run."""
    world = 2
    graph = random_graph(num_nodes=48, seed=5)
    parts = partition(graph, world, tmp_path / "parts", method="random")
    exact = [
        reference.exact_config(
            path, False, parts, tmp_path / name, layers=2, model_options=options, eval_buffer_mib=1e-4
        )
        for name, path, options in (("gin", GIN_PATH, GIN_OPTIONS), ("appnp", APPNP_PATH, APPNP_OPTIONS))
    ]
    stale = dict(p=0.5, dropout=0.3, staleness=1, compress="int8", epochs=5, eval_every=2)
    whole = exact[1].replace(out=tmp_path / "whole", **stale)
    first = whole.replace(out=tmp_path / "resumed", epochs=2, checkpoint_every=2)
    rest = first.replace(epochs=5, resume=True)
    results = run_ranks(world, [*exact, whole, first, rest])
    for i, (config, dense) in enumerate(zip(exact, (gin_dense, appnp_dense))):
        assert any(name.endswith(".eps") for name in results[0][i]["params"]) == (config is exact[0])
        reference.assert_run_matches(config, graph, [results[rank][i]["params"] for rank in range(world)], dense)
        _, params = reference.train(config, graph, dense)
        logits = dense(config, reference.dense_adjacency(graph), params, torch.from_numpy(graph.features).double())
        hits = (logits.argmax(1).numpy() == graph.labels).astype(float)
        scores = json.loads((config.run.out / "metrics.jsonl").read_text().splitlines()[-2])  # the last epoch's
        assert (scores["val_score"], scores["test_score"]) == pytest.approx(
            (hits[graph.val_mask].mean(), hits[graph.test_mask].mean())
        ), config.model.name

    def losses(config: TrainConfig) -> list[float]:
        lines = (config.run.out / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["loss"] for line in lines if '"loss"' in line]

    assert len(losses(rest)) == 5 and losses(rest) == losses(whole)
    for rank in range(world):
        for name, value in results[rank][2]["params"].items():
            assert np.array_equal(results[rank][4]["params"][name], value), name
    recorded = json.loads((whole.run.out / "config.json").read_text())
    assert (recorded["model"], json.loads(recorded["model_options"])) == (APPNP_PATH, {"K": 3, "alpha": 0.2})
    report = json.loads((whole.run.out / "report.json").read_text())
    assert report["info"]["config"]["model"] == APPNP_PATH
    sent = [
        json.loads(line)["bytes_sent_by_kind"]
        for line in (whole.run.out / "metrics.jsonl").read_text().splitlines()[:-1]
    ]
    assert all(kind["features"] > 0 and kind["gradients"] > 0 for kind in sent[1:])  # rows and gradients crossed


# --- Cora at p = 0.1 on 4 ranks (the module's docstring justifies the bars) ----------------------

CORA = [  # (model, its flags, bar)
    (GIN_PATH, dict(layers=1, lr=0.03), 0.62),
    (APPNP_PATH, dict(layers=2, lr=0.05, model_options=json.dumps({"K": 2, "alpha": 0.1})), 0.62),
]


def test_gin_and_appnp_learn_cora_on_four_ranks_at_p_0_1(tmp_path):
    """Both in one job's ranks, one after the other (each rank loads the kernels once)."""
    parts = cora_metis(4, tmp_path / "cora-4")
    settings = dict(p=0.1, hidden=16, dropout=0.5, weight_decay=5e-4, epochs=20, eval_every=10, seed=0, device="cpu")
    configs = [
        TrainConfig.from_settings(parts_dir=parts, model=path, out=tmp_path / path.split(":")[1], **settings, **flags)
        for path, flags, _ in CORA
    ]
    run_ranks(4, configs)
    scores = {c.model.name: json.loads((c.run.out / "metrics.jsonl").read_text().splitlines()[-1]) for c in configs}
    print("cora test scores (best-validation epoch):", {m: s["test_score"] for m, s in scores.items()})  # pytest -rP
    for path, _, bar in CORA:
        assert scores[path]["test_score"] >= bar, (path, scores[path])


# --- a bad --model: one line, before any rank starts ---------------------------------------------

BAD_MODELS = """\
from torch import nn


def not_a_class(in_channels, hidden_channels, out_channels, num_layers, dropout):
    return nn.Linear(in_channels, out_channels)


class NotAModule:
    pass


class WrongConstructor(nn.Module):
    def __init__(self, in_dim, out_dim):
        super().__init__()


class WrongForward(nn.Module):
    def __init__(self, in_channels, hidden_channels, out_channels, num_layers, dropout, **options):
        super().__init__()

    def forward(self, x):
        return x
"""


@pytest.mark.parametrize(
    ("model", "options", "message"),
    [
        (
            "no_such_module:GIN",
            None,
            "--model no_such_module:GIN: no module no_such_module in the current directory ({cwd}) or on PYTHONPATH; "
            "run from the directory that holds it, or add that directory to PYTHONPATH",
        ),
        (
            "broken_models:GIN",
            None,
            "--model broken_models:GIN: importing broken_models raised RuntimeError: this module needs a GPU",
        ),
        ("bad_models:Missing", None, "--model bad_models:Missing: bad_models ({cwd}/bad_models.py) has no Missing"),
        ("bad_models:not_a_class", None, "--model bad_models:not_a_class is a function, not a subclass of torch.nn"),
        ("bad_models:NotAModule", None, "--model bad_models:NotAModule is a class, not a subclass of torch.nn.Module"),
        (
            "bad_models:WrongConstructor",
            None,
            "--model bad_models:WrongConstructor: its constructor cannot take the keyword arguments bnsgcn passes "
            "(in_channels, hidden_channels, out_channels, num_layers, dropout): missing a required argument: 'in_dim'",
        ),
        (
            "bad_models:WrongForward",
            None,
            "--model bad_models:WrongForward: its forward(self, x) cannot take (x, graph): too many positional",
        ),
        (
            "gcn",
            '{"K": 3}',
            "--model-options passes keyword arguments to a model class of your own, but --model is gcn",
        ),
        ("bad_models:WrongForward", "[3]", "--model-options [3] is not a JSON object"),
        ("bad_models:WrongForward", '{"dropout": 0}', "--model-options names dropout, which bnsgcn passes itself"),
        ("gnc", None, "unknown model 'gnc'; choose --model from graphsage, gat, gcn, or name a model class of your"),
    ],
    ids=[
        "no-module",
        "import-fails",
        "no-class",
        "function",
        "not-a-module",
        "constructor",
        "forward",
        "options-builtin",
        "options-not-object",
        "options-taken",
        "unknown-name",
    ],
)
def test_a_bad_model_is_one_line_before_any_rank_starts(tmp_path, monkeypatch, model, options, message):
    (tmp_path / "bad_models.py").write_text(BAD_MODELS)
    (tmp_path / "broken_models.py").write_text("raise RuntimeError('this module needs a GPU. It has none')\n")
    monkeypatch.chdir(tmp_path)  # imported from the current directory, as the command does
    for name in ("bad_models", "broken_models"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    settings = {"model_options": options} if options is not None else {}
    with pytest.raises(UserError) as raised:
        bnsgcn.train(tmp_path / "no-parts", procs=2, model=model, out=tmp_path / "run", **settings)
    assert str(raised.value).startswith(message.format(cwd=tmp_path)), str(raised.value)
    assert "\n" not in str(raised.value) and not (tmp_path / "run").exists()


def test_a_model_class_the_ranks_cannot_import_is_refused(tmp_path):
    class Local(torch.nn.Module):
        pass

    for model, where in (
        (Local, "inside a function"),
        (type("Main", (torch.nn.Module,), {"__module__": "__main__"}), "in __main__"),
    ):
        with pytest.raises(
            UserError,
            match=rf"^model=\S+ is defined {where}.*, where the ranks cannot import it; define it in a module",
        ):
            bnsgcn.train(tmp_path, procs=2, model=model, out=tmp_path / "run")
    with pytest.raises(UserError, match=r"^model is a GIN object; pass a class \(model=MyGNN\)"):
        bnsgcn.train(tmp_path, procs=2, model=GIN(4, 4, 2, 1, 0.0), out=tmp_path / "run")
    with pytest.raises(UserError, match=r"^--precompute applies to the built-in models, but --model is tests\.helpers"):
        bnsgcn.train(tmp_path, procs=2, model=GIN, precompute=True, out=tmp_path / "run")


# --- the documentation ---------------------------------------------------------------------------


def test_the_documented_model_example_runs_as_written(tmp_path):
    section = API_DOC.read_text().split("\n## Your own model\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    names = [re.match(r"# (\w+\.py)\b", block).group(1) for block in blocks]
    assert names == ["my_gnn.py", "train_my_gnn.py"]
    for name, block in zip(names, blocks):
        (tmp_path / name).write_text(block)
    kernels.compiled()
    done = subprocess.run(
        [sys.executable, "train_my_gnn.py"], cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r'^model my_gnn:APPNP \{"K": 3, "alpha": 0\.3\}$', done.stdout, re.MULTILINE), done.stdout
    accuracy = re.search(r"^test accuracy ([0-9.]+) = ([0-9.]+)$", done.stdout, re.MULTILINE)
    assert accuracy and float(accuracy[1]) == pytest.approx(float(accuracy[2])), done.stdout
    assert float(accuracy[1]) > 0.5, done.stdout  # 4 classes the features carry: a model that learnt
