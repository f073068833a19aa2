"""``--precision fp32 | tf32 | bf16`` (bnsgcn.nn.precision): fp32 unchanged, tf32 a CUDA mode
(on CPU the same float32 math and one log line), bf16 products under autocast with float32
parameters, optimizer state, loss and sums, and boundary rows in bfloat16 on the wire unless
``--compress`` says otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bnsgcn.config import TrainConfig, validate
from bnsgcn.errors import UserError
from bnsgcn.metrics import report

from .helpers.graphs import cora_metis, partition, random_graph
from .helpers.precision import record_dtypes
from .helpers.ranks import run_ranks


def _records(run_dir: Path) -> list[dict]:
    lines = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r for r in lines if "loss" in r and not r.get("summary")]


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in _records(run_dir)]


def _bytes_sent(run_dir: Path, kind: str) -> int:
    return sum(r["bytes_sent_by_kind"][kind] for r in _records(run_dir))


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    graph = random_graph(num_nodes=80, avg_degree=5, features=12, seed=4)
    return partition(graph, 2, tmp_path_factory.mktemp("precision") / "parts")


def test_precisions_on_cpu(parts, tmp_path, capsys):
    """fp32 is the default and tf32 on CPU the same math; bf16 multiplies in bfloat16 while
    parameters, optimizer state and loss are float32, and sends half the bytes each way
    unless --compress none keeps float32 on the wire."""
    base = dict(parts_dir=parts, p=0.5, layers=3, hidden=16, epochs=3, eval_every=2, device="cpu")
    runs = {
        "default": dict(),
        "fp32": dict(precision="fp32"),
        "tf32": dict(precision="tf32"),
        "bf16": dict(precision="bf16"),
        "bf16-none": dict(precision="bf16", compress="none"),
    }
    configs = [TrainConfig.from_settings(**base, **extra, out=tmp_path / name) for name, extra in runs.items()]
    results = run_ranks(2, configs, instrument=record_dtypes)
    out = {name: tmp_path / name for name in runs}

    assert _losses(out["fp32"]) == _losses(out["default"]) == _losses(out["tf32"])
    tf32_lines = [line for line in (out["tf32"] / "log.txt").read_text().splitlines() if "--precision tf32" in line]
    assert len(tf32_lines) == 1 and "stay float32" in tf32_lines[0], tf32_lines
    assert not any("--precision" in line for line in (out["fp32"] / "log.txt").read_text().splitlines())

    for rank in range(2):
        fp32, bf16 = results[rank][1]["instrumented"], results[rank][3]["instrumented"]
        assert fp32 == {
            "gemm": ["torch.float32"],
            "logits": ["torch.float32"],
            "loss": ["torch.float32"],
            "optimizer_state": ["torch.float32"],
        }, fp32
        assert bf16 == fp32 | {"gemm": ["torch.bfloat16"]}, bf16
        assert all(v.dtype == np.float32 for v in results[rank][3]["params"].values())
    bf16_losses = _losses(out["bf16"])
    assert all(np.isfinite(bf16_losses)) and bf16_losses != _losses(out["fp32"])
    assert bf16_losses == pytest.approx(_losses(out["fp32"]), rel=0.05)

    for kind in ("features", "gradients"):
        fp32_bytes = _bytes_sent(out["fp32"], kind)
        assert fp32_bytes > 0 and _bytes_sent(out["bf16"], kind) * 2 == fp32_bytes, kind
        assert _bytes_sent(out["bf16-none"], kind) == fp32_bytes, kind

    resolved = {name: json.loads((out[name] / "config.json").read_text()) for name in runs}
    assert [(resolved[n]["precision"], resolved[n]["compress"], resolved[n]["compress_grad"]) for n in runs] == [
        ("fp32", "none", "none"),
        ("fp32", "none", "none"),
        ("tf32", "none", "none"),
        ("bf16", "bf16", "bf16"),
        ("bf16", "none", "none"),
    ]
    assert report.load(out["bf16"])["info"]["config"]["precision"] == "bf16"
    assert report.main([str(out["bf16"])]) == 0
    assert "precision bf16, wire formats: rows bf16, gradients bf16" in capsys.readouterr().out
    assert report.main([str(out["fp32"]), str(out["bf16"])]) == 0
    assert [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("precision")] == [
        ["precision", "fp32", "bf16"]
    ]


def test_unknown_precision_is_refused_in_one_line():
    with pytest.raises(UserError, match=r"^unknown precision 'fp8'; choose --precision from fp32, tf32, bf16$"):
        validate(TrainConfig.from_settings(precision="fp8"))


@pytest.mark.parametrize("lag", [None, 2], ids=["staleness-1", "max-lag-2"])
def test_bf16_trains_every_kind_of_model_with_stale_rows(parts, tmp_path, lag):
    """Built-in models and a user's, one epoch stale or up to ``lag`` behind, recomputed
    segments (--remat), batch norm and sliced evaluation: finite losses in bfloat16."""
    base = dict(parts_dir=parts, p=0.5, hidden=8, heads=2, epochs=3, eval_every=3, precision="bf16", device="cpu")
    base |= dict(staleness=1, max_lag=lag)
    models = {
        "graphsage": dict(remat=True),
        "gcn": dict(norm="batch"),
        "gat": dict(eval_buffer_mib=1e-4),  # evaluation's rows in column slices
        "gin": dict(model="tests.helpers.user_models:GIN", layers=2),
    }
    configs = [
        TrainConfig.from_settings(**base, **({"model": name} | extra), out=tmp_path / name)
        for name, extra in models.items()
    ]
    run_ranks(2, configs)
    for name in models:
        losses = _losses(tmp_path / name)
        assert len(losses) == 3 and all(np.isfinite(losses)), (name, losses)


def test_bf16_trains_cora_as_well_as_fp32(tmp_path):
    """Cora, 2 ranks, p = 0.1, seeds 0-2: the mean test accuracy (at the best validation epoch)
    of bf16 within a point of fp32's."""
    parts = cora_metis(2, tmp_path / "cora-2")
    precisions, seeds = ("fp32", "bf16"), (0, 1, 2)
    configs = [
        TrainConfig.from_settings(
            parts_dir=parts,
            p=0.1,
            model="graphsage",
            layers=2,
            hidden=16,
            norm="none",
            dropout=0.5,
            lr=0.05,
            weight_decay=5e-4,
            epochs=30,
            eval_every=10,
            seed=seed,
            precision=precision,
            device="cpu",
            out=tmp_path / f"{precision}-{seed}",
        )
        for precision in precisions
        for seed in seeds
    ]
    run_ranks(2, configs)
    scores = {p: [] for p in precisions}
    for config in configs:
        summary = json.loads((config.run.out / "metrics.jsonl").read_text().splitlines()[-1])
        scores[config.run.precision].append(summary["test_score"])
    print("cora test scores by precision (best-validation epoch):", json.dumps(scores))  # pytest -rP
    assert np.mean(scores["fp32"]) > 0.7, scores  # trained: the comparison means something
    assert abs(np.mean(scores["bf16"]) - np.mean(scores["fp32"])) <= 0.01, scores


def test_dense_kernels_multiply_in_autocast_dtype_and_return_float32_gradients():
    """linear_pair and linear_sum under autocast: bfloat16 outputs equal to torch's autocast
    linear, the gradients of input, weights and bias float32 and close to float32's."""
    from bnsgcn.kernels.dense import linear_pair, linear_sum

    generator = torch.Generator().manual_seed(3)
    x, x2 = (torch.randn(50, 12, generator=generator, requires_grad=True) for _ in range(2))
    w_a, w_b = (torch.randn(6, 12, generator=generator, requires_grad=True) for _ in range(2))
    bias = torch.randn(6, generator=generator, requires_grad=True)
    leaves = (x, x2, w_a, w_b, bias)

    def gradients(autocast: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        for t in leaves:
            t.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            outputs = [*linear_pair(x, w_a, w_b, bias), linear_sum(bias, (x, w_a), (x2, w_b))]
            expected = [
                torch.nn.functional.linear(x, w_a, bias),
                torch.nn.functional.linear(x, w_b),
                torch.nn.functional.linear(x, w_a, bias) + torch.nn.functional.linear(x2, w_b),
            ]
        sum(o.float().square().sum() for o in outputs).backward()
        return [t.detach() for pair in zip(outputs, expected) for t in pair], [t.grad for t in leaves]

    products, grads = gradients(autocast=True)
    exact_products, exact_grads = gradients(autocast=False)
    assert [p.dtype for p in products[:4]] == [torch.bfloat16] * 4  # pair: autocast's own dtype
    torch.testing.assert_close(products[0], products[1])  # as torch's autocast computes it
    torch.testing.assert_close(products[2], products[3])
    assert products[4].dtype == torch.bfloat16
    torch.testing.assert_close(products[4].float(), exact_products[4], rtol=0.05, atol=0.1)
    assert [g.dtype for g in grads] == [torch.float32] * 5
    for g, exact in zip(grads, exact_grads):
        torch.testing.assert_close(g, exact, rtol=0.05, atol=0.5)
        assert not torch.equal(g, exact)  # really computed in bfloat16
