"""The engine on one CUDA GPU: one NCCL rank, against the CPU run.

Skipped, with the reason, where no CUDA GPU is visible: a skip is not a pass (pytest counts
skips apart; `pytest -rs` names them). On a GPU machine run

    .venv/bin/python -m pytest -q -rs tests/test_gpu.py

With one GPU only one NCCL rank can run (NCCL refuses two ranks on one device): every test
here is world size 1. tests/test_nccl.py holds the 2-rank NCCL runs, which need two GPUs;
tests/test_shared_gpu.py runs several gloo ranks on one GPU (--ranks-per-gpu).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from .helpers import reference
from .helpers.cli import SMALL_RUN, train_without_numba
from .helpers.device_syncs import instrument_cuda_syncs
from .helpers.graphs import partition, random_graph
from .helpers.precision import record_dtypes
from .helpers.ranks import run_ranks

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU visible: the GPU tests need one (they are not a pass here)"
)

MODELS = [("graphsage", True), ("graphsage", False), ("gcn", True), ("gcn", False), ("gat", False)]
# the device reads of docs/training.md ("Device synchronisations in the epoch loop"), by function
DEVICE_SYNC_FUNCTIONS = {
    "exchange.exchange_selections",
    "hierarchy.NodeAwarePlanner.sample",
    "accounting.EpochAccount.row",
    "accounting.EpochAccount.gather",
    "train._evaluate",
}


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _epochs(run_dir) -> list[dict]:
    return [r for r in _records(run_dir) if "epoch" in r]


@pytest.fixture(scope="module")
def one_part(tmp_path_factory):
    graph = random_graph(num_nodes=120, avg_degree=6, seed=21)
    return graph, partition(graph, 1, tmp_path_factory.mktemp("gpu") / "parts")


@pytest.mark.parametrize("model, precompute", MODELS)
def test_cuda_rank_equals_cpu_rank_and_the_reference(tmp_path, one_part, model, precompute):
    """p = 1, one rank: the CUDA run's losses, scores and parameters equal the CPU run's
    (float tolerance) and the float64 reference's; evaluation every epoch."""
    graph, parts = one_part
    configs = [
        reference.exact_config(model, precompute, parts, tmp_path / device, device=device, eval_every=1)
        for device in ("cuda", "cpu")
    ]
    results = run_ranks(1, configs)
    cuda, cpu = (_epochs(c.run.out) for c in configs)
    assert [r["loss"] for r in cuda] == pytest.approx([r["loss"] for r in cpu], rel=1e-5, abs=1e-6)
    for a, b in zip(cuda, cpu):
        for split in ("train_score", "val_score", "test_score"):
            assert a[split] == pytest.approx(b[split], abs=1.5 / graph.num_nodes)  # a tie may tip one node
    reference.assert_run_matches(configs[0], graph, [results[0][0]["params"]])
    report = json.loads((configs[0].run.out / "report.json").read_text())
    rank = report["ranks"][0]
    assert rank["device"].startswith("cuda") and rank["peak_cuda_allocated_bytes"] > 0
    assert rank["peak_cuda_reserved_bytes"] >= rank["peak_cuda_allocated_bytes"] and rank["peak_rss_bytes"] > 0
    assert rank["per_epoch"]["epoch_time"] > 0  # device time, from CUDA events


def test_a_cuda_job_never_imports_numba(tmp_path, one_part):
    """Launcher, rank and report of a CUDA job with any import of numba failing: the CPU
    kernels' compiler is neither imported nor run (tests/test_run_ranks.py runs the same on
    the CPU's torch kernels)."""
    _, parts = one_part
    run_dir = tmp_path / "run"
    args = ["--gpus", "1", "--parts-dir", str(parts), "--out", str(run_dir), *SMALL_RUN]
    done = train_without_numba(args, tmp_path, "auto")
    assert done.code == 0, done.stderr[-3000:]
    assert json.loads((run_dir / "report.json").read_text())["ranks"][0]["device"].startswith("cuda")


def test_sampled_cuda_run_is_finite_and_device_syncs_are_the_documented_ones(tmp_path):
    """Two partitions on one GPU cannot run (NCCL: one rank per device), so p < 1 on one
    rank exercises sampling without selections; torch.cuda.set_sync_debug_mode records every
    synchronising CUDA operation of the epoch loop: only the documented ones occur."""
    graph = random_graph(num_nodes=120, avg_degree=6, seed=22)
    parts = partition(graph, 1, tmp_path / "parts")
    configs = [
        reference.exact_config(model, False, parts, tmp_path / model, device="cuda", p=0.5, dropout=0.2, eval_every=2)
        for model in ("graphsage", "gat")
    ]
    results = run_ranks(1, configs, instrument=instrument_cuda_syncs)
    for config, result in zip(configs, results[0]):
        assert all(np.isfinite(r["loss"]) for r in _epochs(config.run.out))
        functions = {site.rsplit(":", 1)[0] for site in result["instrumented"]}
        assert functions <= DEVICE_SYNC_FUNCTIONS, result["instrumented"]
        assert "accounting.EpochAccount.gather" in functions  # the recorder works: the loss is read


@pytest.mark.parametrize("first, then", [("cuda", "cpu"), ("cpu", "cuda")])
def test_checkpoint_resumes_across_devices(tmp_path, one_part, first, then):
    """Checkpoint on one device after 2 epochs, resume on the other for 2 more: the losses
    equal an uninterrupted 4-epoch run on the first device (float tolerance)."""
    graph, parts = one_part
    straight = reference.exact_config("gat", False, parts, tmp_path / "straight", device=first, epochs=4, dropout=0.0)
    interrupted = reference.exact_config(
        "gat", False, parts, tmp_path / "resumed", device=first, epochs=2, checkpoint_every=2
    )
    run_ranks(1, [straight, interrupted])
    resumed = reference.exact_config(
        "gat", False, parts, tmp_path / "resumed", device=then, epochs=4, checkpoint_every=2, resume=True
    )
    run_ranks(1, [resumed])
    losses = [r["loss"] for r in _epochs(resumed.run.out)]
    assert len(losses) == 4
    assert losses == pytest.approx([r["loss"] for r in _epochs(straight.run.out)], rel=1e-5, abs=1e-6)


def test_sampled_adjacency_selection_on_cuda_does_not_synchronise():
    """The selection of an epoch's sampled columns with host-known sizes runs on the GPU
    without a synchronisation (set_sync_debug_mode("error") raises on one) and equals the CPU's."""
    from bnsgcn.kernels import Adjacency

    generator = torch.Generator().manual_seed(0)
    dense = torch.rand(300, 500, generator=generator) < 0.05
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), dense.sum(1).cumsum(0)])
    adj = Adjacency.from_csr(indptr, dense.nonzero()[:, 1], 500, torch.rand(int(dense.sum()), generator=generator))
    on_gpu = adj.to("cuda")
    keep = torch.rand(500, generator=generator) < 0.3
    sizes = (int(keep.sum()), int(dense[:, keep].sum()))
    keep_gpu = keep.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        selected = on_gpu.select_columns(keep_gpu, sizes)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = adj.select_columns(keep)
    for name in Adjacency.__slots__:
        a, b = getattr(selected, name), getattr(expected, name)
        assert torch.equal(a.cpu(), b) if isinstance(a, torch.Tensor) else a == b, name


def test_nonzero_rows_kernels_on_cuda_equal_the_cpu_ones():
    """--nonzero-rows on a GPU: the pure-torch kernels (cumulative sums, no host read) give
    the numba kernels' bitmaps, entries, rows and gradients."""
    from bnsgcn.kernels import numba_backend, torch_backend

    generator = torch.Generator().manual_seed(5)
    x = torch.randn(500, 37, generator=generator)
    x[torch.rand(500, 37, generator=generator) < 0.7] = 0.0
    index = torch.randint(0, 500, (400,), generator=generator)
    grads = torch.randn(400, 37, generator=generator)
    results = {}
    for name, module, device in (("cpu", numba_backend, "cpu"), ("cuda", torch_backend, "cuda")):
        bits = torch.empty(400, 5, dtype=torch.uint8, device=device)
        values = torch.empty(400 * 37, device=device)
        offsets = module.pack_nonzero_rows(x.to(device), index.to(device), bits, values)
        count = int(offsets[-1])
        rows = module.unpack_nonzero_rows(
            bits, torch.cat([values[:count], values.new_zeros(1)]), torch.empty(400, 37, device=device)
        )
        gathered = module.gather_nonzero(grads.to(device), bits, torch.empty(count + 1, device=device))
        scattered = module.scatter_nonzero_rows(
            index.to(device), bits, torch.cat([gathered, gathered.new_zeros(1)]), (500, 37)
        )
        results[name] = [t.cpu() for t in (bits, offsets, values[:count], rows, gathered, scattered)]
    for a, b in zip(results["cpu"][:5], results["cuda"][:5]):
        assert torch.equal(a, b)
    torch.testing.assert_close(results["cuda"][5], results["cpu"][5])  # index_add_ on the GPU sums in its own order


def record_tf32():
    """Inside a rank: whether CUDA matmuls may use TF32 once the run is over (run_ranks' instrument)."""
    return lambda: torch.backends.cuda.matmul.allow_tf32


def test_tf32_and_bf16_train_on_one_gpu(tmp_path, one_part):
    """--precision tf32 turns TF32 matmuls on for its run only, without the CPU's log line;
    bf16 multiplies in bfloat16 on the GPU with float32 parameters, optimizer state and
    loss, and resolves the wire format to bf16. One rank: no boundary row crosses, so the
    halved bytes are tests/test_precision.py's (CPU ranks)."""
    _, parts = one_part
    configs = {
        precision: reference.exact_config(
            "graphsage", False, parts, tmp_path / precision, device="cuda", precision=precision, dropout=0.2
        )
        for precision in ("tf32", "fp32", "bf16")
    }
    tf32_flags = run_ranks(1, [configs["tf32"], configs["fp32"]], instrument=record_tf32)[0]
    assert [r["instrumented"] for r in tf32_flags] == [True, False]  # not carried into the next run
    assert "--precision tf32" not in (configs["tf32"].run.out / "log.txt").read_text()
    bf16 = run_ranks(1, [configs["bf16"]], instrument=record_dtypes)[0][0]
    assert bf16["instrumented"] == {
        "gemm": ["torch.bfloat16"],
        "logits": ["torch.float32"],
        "loss": ["torch.float32"],
        "optimizer_state": ["torch.float32"],
    }
    for config in configs.values():
        losses = [r["loss"] for r in _epochs(config.run.out)]
        assert len(losses) == config.run.epochs and all(np.isfinite(losses)), (config.run.precision, losses)
    resolved = json.loads((configs["bf16"].run.out / "config.json").read_text())
    assert (resolved["precision"], resolved["compress"], resolved["compress_grad"]) == ("bf16", "bf16", "bf16")
