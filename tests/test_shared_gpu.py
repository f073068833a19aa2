"""Several ranks on one CUDA GPU (``--ranks-per-gpu``): every multi-rank mode against the same
job on CPU ranks.

Ranks that share a GPU run gloo with their collectives staged through host memory
(bnsgcn/comm/communicator.py, ``Comm.host_staging``). Each test runs one tiny job twice in
the same rank processes, on CPU ranks and with every rank on GPU 0, and compares the losses
per epoch. Skipped, with the reason, where no CUDA GPU is visible: a skip is not a pass
(pytest counts skips apart; ``pytest -rs`` names them). On a GPU machine run

    .venv/bin/python -m pytest -q -rs tests/test_shared_gpu.py

Bounds. CPU and CUDA differ only in float32 rounding where the job is deterministic on the
CPU (dropout 0, so no random draw on the device; the boundary samples are drawn on the host
alike): products and sums run in other orders (cuBLAS against MKL, torch's scatter against
the numba kernels). One such value is off by at most a few units of float32's rounding,
2^-24 (6e-8), per operation it passed through: about a hundred in an epoch of these
two-layer models (two aggregations over a handful of neighbours, two products over 8
features, the loss, the gradients back, the optimizer), so about 1e-5 of its size per epoch,
compounded over the few epochs of a job: ROUNDING (rel 1e-4) bounds the losses. fp16 and
bf16 round each boundary row to nearest, which is deterministic, but a float32 difference
can move a value across a rounding boundary: one unit of the format's last place (2^-10
for fp16, 2^-7 for bf16), relative, on that value, so their bounds are that unit. int8 and
int4 round stochastically with torch's generator, which draws other numbers on CUDA than on
the CPU: the two runs carry independent quantization noise, each value off by less than
one step (1/255 of its row's range for int8, 1/15 for int4) from the exact row. A loss,
an average over many nodes whose boundary inputs move by less than a step, moves by less
than a step of itself per epoch; two runs, each within a step of the exact run per epoch,
are within twice that per epoch of each other: 2 x epochs steps, relative.
"""

from __future__ import annotations

import json

import pytest
import torch

from bnsgcn.config import TrainConfig

from .helpers.graphs import partition, random_graph
from .helpers.ranks import run_ranks

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU visible: these tests need one (they are not a pass here)"
)

EPOCHS = 4
ROUNDING = dict(rel=1e-4, abs=1e-6)
# one unit in the last place of the wire format, relative (see the module)
LAST_PLACE = {"fp16": 2.0**-10, "bf16": 2.0**-7}
# one quantization step of a row's range, relative; stochastic rounding draws other numbers on CUDA
STEP = {"int8": 1 / 255, "int4": 1 / 15}


def _config(parts, out, **overrides) -> TrainConfig:
    base = dict(
        parts_dir=parts,
        p=0.5,
        model="graphsage",
        layers=2,
        hidden=8,
        dropout=0.0,
        norm="layer",
        lr=0.01,
        epochs=EPOCHS,
        eval_every=0,
        device="cpu",
        seed=3,
        timeout=120,
        out=out,
    )
    return TrainConfig.from_settings(**(base | overrides))


def _records(config: TrainConfig) -> list[dict]:
    lines = map(json.loads, (config.run.out / "metrics.jsonl").read_text().splitlines())
    return [r for r in lines if "loss" in r and not r.get("summary")]


def _losses(config: TrainConfig) -> list[float]:
    return [r["loss"] for r in _records(config)]


def _on_cpu_and_gpu(tmp_path, world: int, parts, nodes: list[int] | None = None, **mode) -> tuple[list, list]:
    """The job on CPU ranks and with its ranks sharing GPU 0 (every rank of a machine on it,
    and at least two: simulated machines of one rank each share the one GPU too):
    (CPU config, GPU config). Checks that the GPU job ran where it was meant to."""
    machines = nodes or [0] * world
    per_gpu = max(2, *(machines.count(m) for m in machines))
    cpu = _config(parts, tmp_path / "cpu", **mode)
    gpu = cpu.replace(device="cuda", ranks_per_gpu=per_gpu, out=tmp_path / "gpu")
    run_ranks(world, [cpu, gpu], nodes=nodes)
    report = json.loads((gpu.run.out / "report.json").read_text())
    assert [r["device"] for r in report["ranks"]] == ["cuda:0"] * world
    assert json.loads((gpu.run.out / "config.json").read_text())["ranks_per_gpu"] == per_gpu
    assert len(_records(gpu)) == len(_records(cpu)) == EPOCHS
    return cpu, gpu


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """Partition sets of the same graph: 2, 4 and 8 parts (the work pool takes two per rank)."""
    graph = random_graph(num_nodes=120, avg_degree=6, seed=21)
    root = tmp_path_factory.mktemp("shared")
    return {k: partition(graph, k, root / f"parts{k}") for k in (2, 4, 8)}


EXACT_MODES = {
    "synchronous": dict(),
    "stale": dict(staleness=1),
    "partial": dict(staleness=1, sync="partial:WORLD"),  # every rank: the mean of all, summed in rank order
    "work-pool": dict(p=0.0, norm="none", work_pool=True),
}


@pytest.mark.parametrize("world", (2, 4))
@pytest.mark.parametrize("mode", list(EXACT_MODES))
def test_shared_gpu_equals_cpu_ranks(tmp_path, parts, world, mode):
    """Modes whose CPU job is deterministic: the same losses up to float rounding."""
    settings = {k: (v.replace("WORLD", str(world)) if isinstance(v, str) else v) for k, v in EXACT_MODES[mode].items()}
    parts_dir = parts[2 * world if mode == "work-pool" else world]
    cpu, gpu = _on_cpu_and_gpu(tmp_path, world, parts_dir, **settings)
    assert _losses(gpu) == pytest.approx(_losses(cpu), **ROUNDING)


@pytest.mark.parametrize("nodes", ([0, 1], [0, 0, 1, 1]), ids=("1+1", "2+2"))
def test_shared_gpu_hierarchical_over_two_machines(tmp_path, parts, nodes):
    """Two simulated machines (GROUP_RANK) of one or two ranks each, every rank on GPU 0: rows
    cross between the machines as nonzero entries (auto when a job spans machines), relayed
    inside a machine of two."""
    cpu, gpu = _on_cpu_and_gpu(tmp_path, len(nodes), parts[len(nodes)], nodes=nodes, exchange="hierarchical")
    assert _losses(gpu) == pytest.approx(_losses(cpu), **ROUNDING)
    sent = [r["bytes_inter_node"] for r in json.loads((gpu.run.out / "report.json").read_text())["ranks"]]
    assert sum(sent) > 0  # rows did cross between the simulated machines


@pytest.mark.parametrize("world", (2, 4))
def test_shared_gpu_max_lag(tmp_path, parts, world):
    """--max-lag 2: as long as every rank of both runs used the previous epoch's rows (lag 1
    after the first epoch), both runs did the same arithmetic: float rounding apart. An epoch
    where a rank ran ahead used other versions in one run, and nothing equal is promised."""
    cpu, gpu = _on_cpu_and_gpu(tmp_path, world, parts[world], staleness=1, max_lag=2)
    lags = [[r["per_rank"]["lag"] for r in _records(c)] for c in (cpu, gpu)]
    same = 0
    while same < EPOCHS and all(lag[same] == [min(same, 1)] * world for lag in lags):
        same += 1
    assert same >= 1  # the first epoch is a synchronous exchange in every run
    assert _losses(gpu)[:same] == pytest.approx(_losses(cpu)[:same], **ROUNDING)
    assert all(lag <= 2 for run in lags for epoch in run for lag in epoch)


@pytest.mark.parametrize("world", (2, 4))
@pytest.mark.parametrize("wire", list(LAST_PLACE))
def test_shared_gpu_float_compression(tmp_path, parts, world, wire):
    """fp16 / bf16 rows and gradients: rounding to nearest, the same on both devices but for a
    float32 difference that moves a value across a rounding boundary (one last place)."""
    cpu, gpu = _on_cpu_and_gpu(tmp_path, world, parts[world], compress=wire)
    assert _losses(gpu) == pytest.approx(_losses(cpu), rel=LAST_PLACE[wire] + ROUNDING["rel"], abs=1e-6)


@pytest.mark.parametrize("world", (2, 4))
@pytest.mark.parametrize("wire", list(STEP))
def test_shared_gpu_integer_compression(tmp_path, parts, world, wire):
    """int8 / int4: stochastic rounding draws other numbers on CUDA, so the runs differ by
    their noise: after epoch e, within 2 x e quantization steps of each other, relative (see
    the module)."""
    cpu, gpu = _on_cpu_and_gpu(tmp_path, world, parts[world], compress=wire)
    for epoch, (x, y) in enumerate(zip(_losses(cpu), _losses(gpu)), start=1):
        assert x == pytest.approx(y, rel=2 * epoch * STEP[wire]), epoch
