"""The GPU path checked on CPU: device-time clocks, no hidden device
synchronisation in the epoch loop, all-to-all splits NCCL accepts (zeros included)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bnsgcn.comm.communicator import Comm
from bnsgcn.config import TrainConfig
from bnsgcn.errors import UserError
from bnsgcn.kernels import Adjacency
from bnsgcn.metrics.timing import DeviceClock

from .helpers.device_syncs import instrument
from .helpers.graphs import graph_with_island, partition, random_graph
from .helpers.ranks import free_port, run_ranks

DOCS = Path(__file__).resolve().parents[1] / "docs" / "training.md"

# Every call in the engine's epoch loop that reads tensor data on the host or copies host
# data to a device without non_blocking (tests/helpers/device_syncs.py),
# as recorded with the pure-torch kernels (the ones CUDA runs). "device": the tensor is on
# the GPU there, so the call waits for it (each is listed in docs/training.md); "host": the
# tensor lives on the CPU on every device (the topology, samples, the gathered table).
SITES = {
    "comm.plan.exchange_selections:cpu": "device",  # the selection bits (p < 1)
    "exchange.transfers.start_nonzero_rows:tolist": "device",  # entries per peer (--nonzero-rows on)
    "comm.planners.NodeAwarePlanner.sample:cpu": "device",  # the node's selection bits (node-aware, p < 1)
    "metrics.accounting.EpochAccount.row:tolist": "device",  # the loss, at the epoch's end
    "metrics.accounting.EpochAccount.gather:cpu": "device",  # every rank's figures, at the epoch's end
    "run.train._evaluate:cpu": "device",  # the scores (evaluated epochs)
    "data.sampler.sample_boundary:tolist": "host",
    "comm.plan.pack_segments:numpy": "host",
    "comm.plan.unpack_segments:numpy": "host",
    "comm.plan.make_plan:__getitem__": "host",
    "data.shard.segment_counts:tolist": "host",
    "data.shard.segment_counts:tensor": "host",  # on the mask's device: the CPU (samples, selections)
    "nn.graph.ShardGraph.epoch:__getitem__": "host",
    "nn.graph.ShardGraph.epoch:__int__": "host",
    "comm.planners.NodeAwarePlanner.sample:__getitem__": "host",
    "comm.planners.NodeAwarePlanner._plan:__getitem__": "host",
    "comm.planners.NodeAwarePlanner._plan:__setitem__": "host",
    "comm.planners.NodeAwarePlanner._plan:bincount": "host",
    "comm.planners.NodeAwarePlanner._plan:nonzero": "host",
    "comm.planners.NodeAwarePlanner._plan:tolist": "host",
    "comm.planners._delegates:__setitem__": "host",
    "exchange.stale.StaleExchange.prepare:nonzero": "host",
    "kernels.backend.draw_seed:__int__": "host",  # a dropout seed drawn on the CPU (RecomputedDropout)
    "run.train._train:__float__": "host",
    "run.train._epoch_record:numpy": "host",  # the gathered table is on the CPU (rank 0 only)
    "run.train._scores:tolist": "host",
    "run.train._refuse_non_finite:nonzero": "host",  # the gathered table is on the CPU
    "run.train._refuse_non_finite:tolist": "host",
}


class FakeEvent:
    """Stands in for torch.cuda.Event: counts records and synchronisations; 2 ms apart."""

    log: list[str] = []
    clock_ms = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at = None

    def record(self) -> None:
        FakeEvent.clock_ms += 2.0
        self.at = FakeEvent.clock_ms
        FakeEvent.log.append("record")

    def synchronize(self) -> None:
        FakeEvent.log.append("synchronize")

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.at is not None and end.at is not None, "both events recorded before reading"
        return end.at - self.at


def test_clock_on_cpu_is_host_time():
    clock = DeviceClock(torch.device("cpu"))
    assert not clock.on_device
    with clock.timed("a"):
        sum(range(20000))
    with clock.timed("a"):
        pass
    clock.add("b", 0.25)
    seconds = clock.resolve()
    assert 0 < seconds["a"] < 1 and seconds["b"] == 0.25
    clock.reset()
    assert dict(clock.resolve()) == {}


def test_clock_on_cuda_records_events_and_synchronises_once_per_resolve():
    FakeEvent.log, FakeEvent.clock_ms = [], 0.0
    clock = DeviceClock(torch.device("cuda", 0), event=FakeEvent)
    assert clock.on_device
    for _ in range(3):
        with clock.timed("forward"):
            with clock.timed("exchange"):
                pass
    assert FakeEvent.log == ["record"] * 12  # no phase waits for the device
    seconds = clock.resolve()
    assert FakeEvent.log.count("synchronize") == 1
    # forward: record at t, exchange t+2..t+4, forward ends t+6: 6 ms; exchange 2 ms; three times
    assert seconds["forward"] == pytest.approx(3 * 0.006) and seconds["exchange"] == pytest.approx(3 * 0.002)
    clock.resolve()
    assert FakeEvent.log.count("synchronize") == 1  # nothing pending: nothing to wait for


def test_collective_waits_are_timed_on_the_device_clock():
    """Comm times waits (and blocking collectives) on its clock: CUDA events on CUDA."""

    class Work:
        waited = 0

        def wait(self) -> None:
            Work.waited += 1

    FakeEvent.log, FakeEvent.clock_ms = [], 0.0
    comm = Comm(rank=0, world_size=1, local_rank=0, device=torch.device("meta"), timeout=1.0)
    comm.stats.clock = DeviceClock(torch.device("cuda", 0), event=FakeEvent)
    comm.wait(Work(), "features")
    comm.wait(Work(), "gradients")
    assert Work.waited == 2 and "synchronize" not in FakeEvent.log
    assert dict(comm.stats.seconds) == pytest.approx({"features": 0.002, "gradients": 0.002})
    assert FakeEvent.log.count("synchronize") == 1
    comm.stats.reset()
    assert dict(comm.stats.seconds) == {}


def _collectives(config) -> dict:
    """Inside a rank of a 2-rank gloo job: every collective of Comm, run directly and staged
    through host copies (what ranks sharing a GPU do: see Comm.host_staging)."""
    from bnsgcn.comm.communicator import StagedWork, init_from_env

    comm = init_from_env("cpu", timeout=60.0, pipelined=True)
    r, results = comm.rank, {}
    for staging in (False, True):
        comm.host_staging = staging
        comm.stats.reset()
        counts = [1, 2] if r == 0 else [2, 1]  # rows to rank 0, to rank 1 (and as many back)
        send, out = torch.arange(6.0).view(3, 2) + 10 * r, torch.full((3, 2), -1.0)
        work = comm.all_to_all_start(send, counts, counts, out, "features", pipelined=True)
        if staging:
            assert isinstance(work, StagedWork) and work.sent is not send
            work.work.wait()  # the collective itself is done: its rows are on the host only
            assert bool((out == -1).all())
        comm.wait(work, "features")
        reduced = comm.all_reduce(torch.tensor([1.0 + r]))
        flat = torch.arange(4.0) * (r + 1)
        comm.wait(comm.all_reduce_async(flat))
        gathered = comm.all_gather_within_node(torch.tensor([r, 7]), "control")
        results[staging] = {
            "out": out.numpy(),
            "reduced": reduced.numpy(),
            "flat": flat.numpy(),
            "gathered": gathered.numpy(),
            "sent": dict(comm.stats.sent),
        }
    comm.close()
    return results


def test_collectives_staged_through_host_memory_equal_direct_ones():
    """Ranks sharing a GPU run gloo through host copies: each collective gives what it gives
    unstaged, counts the same bytes, and a started one lands in its buffer only on wait."""
    results = run_ranks(2, [None], work=_collectives)
    for r, (result,) in enumerate(results):
        direct, staged = result[False], result[True]
        for key in ("out", "reduced", "flat", "gathered"):
            np.testing.assert_array_equal(staged[key], direct[key], err_msg=key)
        assert staged["sent"] == direct["sent"]
        # rank 0 keeps its row 0 and gets rank 1's rows 0-1; rank 1 gets rank 0's rows 1-2, keeps its row 2
        mine = np.arange(6.0).reshape(3, 2) + 10 * r
        theirs = np.arange(6.0).reshape(3, 2) + 10 * (1 - r)
        expected = np.concatenate([mine[:1], theirs[:2]]) if r == 0 else np.concatenate([theirs[1:], mine[2:]])
        np.testing.assert_array_equal(direct["out"], expected)
        np.testing.assert_array_equal(direct["reduced"], [3.0])
        np.testing.assert_array_equal(direct["flat"], np.arange(4.0) * 3)
        np.testing.assert_array_equal(direct["gathered"], [[0, 7], [1, 7]])


def test_epoch_account_resolves_phases_once():
    from bnsgcn.metrics.accounting import EpochAccount

    FakeEvent.log, FakeEvent.clock_ms = [], 0.0
    account = EpochAccount(clock=DeviceClock(torch.device("cuda", 0), event=FakeEvent))
    with account.timed("epoch"):
        with account.timed("sampling"):
            pass
        with account.timed("forward"):
            pass
    assert "synchronize" not in FakeEvent.log
    comm = Comm(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), timeout=1.0)
    account.values["loss_sum"] = torch.tensor(3.5)  # left on the device until the epoch's end
    row = account.gather(comm)[0].tolist()
    values = dict(zip(__import__("bnsgcn.metrics.accounting").metrics.accounting.COLUMNS, row))
    assert FakeEvent.log.count("synchronize") == 1
    assert values["loss_sum"] == 3.5
    assert (
        values["epoch_time"] == pytest.approx(0.010)
        and values["time_sampling"] == pytest.approx(0.002)
        and values["time_forward"] == pytest.approx(0.002)
    )


def test_all_to_all_refuses_splits_nccl_would_refuse():
    comm = Comm(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), timeout=1.0)
    rows = torch.arange(6.0).view(3, 2)
    assert comm.all_to_all(rows, [3], [3], torch.empty(3, 2), "control").tolist() == rows.tolist()
    empty = torch.empty(0, 2)
    assert comm.all_to_all(empty, [0], [0], torch.empty(0, 2), "control").shape == (0, 2)  # zero rows are fine
    with pytest.raises(RuntimeError, match="must be contiguous with 2 rows"):
        comm.all_to_all(rows, [2], [3], torch.empty(3, 2), "control")
    with pytest.raises(RuntimeError, match="receive buffer"):
        comm.all_to_all(rows, [3], [3], torch.empty(4, 2), "control")
    with pytest.raises(RuntimeError, match="non-negative ints"):
        comm.all_to_all(rows, [3, 0], [3], torch.empty(3, 2), "control")
    with pytest.raises(RuntimeError, match="non-negative ints"):
        comm.all_to_all(rows, [np.int64(3)], [3], torch.empty(3, 2), "control")
    with pytest.raises(RuntimeError, match="sends torch.float32"):
        comm.all_to_all(rows, [3], [3], torch.empty(3, 2, dtype=torch.float16), "control")
    with pytest.raises(RuntimeError, match="contiguous"):
        comm.all_to_all(torch.arange(6.0).view(2, 3).t(), [3], [3], torch.empty(3, 2), "control")


@pytest.mark.parametrize(
    "nccl_says, expected",
    [
        (
            "NCCL error in: NCCLUtils.cpp:93, invalid usage\nLast error:\nDuplicate GPU detected : rank 1 and rank 0 "
            "both on CUDA device 60",
            UserError,
        ),
        ("NCCL error in: NCCLUtils.cpp:93, unhandled system error", torch.distributed.DistBackendError),
    ],
)
def test_two_ranks_on_one_gpu_is_one_line_naming_the_fix(monkeypatch, nccl_says, expected):
    """NCCL refuses a second rank on a GPU (two launchers on one machine, each numbering its
    GPUs from 0): the job ends in one line naming the fix; other NCCL errors pass unchanged."""
    from bnsgcn.comm import communicator as comm_module

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))

    def refuse(**_kwargs):
        raise torch.distributed.DistBackendError(nccl_says)

    monkeypatch.setattr(comm_module.dist, "init_process_group", refuse)
    with pytest.raises(expected) as caught:
        comm_module.init_from_env("cpu", timeout=10.0)
    if expected is UserError:
        message = str(caught.value)
        assert "\n" not in message and message.startswith("rank 0 shares its GPU with another rank")
        assert (
            "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 60" in message
            and "CUDA_VISIBLE_DEVICES" in message
            and "--ranks-per-gpu N" in message
        )


@pytest.mark.parametrize("weighted", [True, False])
def test_select_columns_with_host_sizes_equals_without(monkeypatch, weighted):
    """The torch kernels' selection given sizes from the host (what CUDA runs, no device
    read) equals the one that reads them, entry for entry, dropping everything included."""
    monkeypatch.setenv("BNSGCN_KERNELS", "torch")
    rng = np.random.default_rng(0)
    dense = torch.from_numpy(rng.random((9, 14)) < 0.3)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), dense.sum(1).cumsum(0)])
    indices = dense.nonzero()[:, 1]
    values = torch.rand(indices.numel()) if weighted else None
    adj = Adjacency.from_csr(indptr, indices, 14, values)
    for keep in (
        torch.from_numpy(rng.random(14) < 0.5),
        torch.zeros(14, dtype=torch.bool),
        torch.ones(14, dtype=torch.bool),
    ):
        sizes = (int(keep.sum()), int(dense[:, keep].sum()))
        a, b = adj.select_columns(keep), adj.select_columns(keep, sizes)
        for name in Adjacency.__slots__:
            x, y = getattr(a, name), getattr(b, name)
            if isinstance(x, torch.Tensor):
                assert x.dtype == y.dtype and torch.equal(x, y), name
            else:
                assert x == y, name


def test_recorder_names_engine_reads_and_ignores_others():
    """What the epoch-loop test relies on: a host read made by engine code is recorded under
    its function, one made elsewhere (here, the test) is not, nor anything while paused."""
    from bnsgcn.run import train

    from .helpers.device_syncs import SyncRecorder

    recorder = SyncRecorder()
    with recorder:
        train._scores(torch.ones(3, 3, dtype=torch.float64), False)  # paused: nothing
        recorder.recording = True
        train._scores(torch.ones(3, 3, dtype=torch.float64), False)
        torch.ones(2).tolist()
        torch.ones(2).to("cpu")
        torch.ones(2).to(torch.device("cpu"), non_blocking=True)
        mask = torch.tensor([True, False])
        torch.ones(2)[mask]
    assert recorder.sites == {"run.train._scores:tolist": 1}


def test_no_hidden_device_syncs_in_the_epoch_loop(tmp_path, monkeypatch):
    """Every host read of tensor data in the epoch loop is one of :data:`SITES`, and every
    one of those occurs: a new hidden synchronisation fails here; the device ones are the
    list in docs/training.md."""
    monkeypatch.setenv("BNSGCN_KERNELS", "torch")  # the kernels CUDA runs
    parts = partition(random_graph(num_nodes=90, avg_degree=5, seed=11), 3, tmp_path / "parts")
    base = dict(parts_dir=parts, layers=2, hidden=8, heads=2, epochs=3, eval_every=1, seed=1, device="cpu")
    configs = [
        TrainConfig.from_settings(**base, model="graphsage", p=0.5, exchange="hierarchical", out=tmp_path / "sage"),
        TrainConfig.from_settings(
            **base, model="gat", p=0.5, exchange="direct", dropout=0.3, compress="int8", out=tmp_path / "gat"
        ).replace(optimizer="sgd", momentum=0.9, lr_schedule="cosine", warmup_epochs=1, grad_clip=0.5),
        TrainConfig.from_settings(
            **base, model="gcn", p=0.5, staleness=1, exchange="hierarchical", inductive=True, out=tmp_path / "stale"
        ).replace(optimizer="adamw", weight_decay=0.01, lr_schedule="plateau", plateau_patience=1, grad_clip=0.5),
        TrainConfig.from_settings(**base, model="graphsage", p=1.0, norm="batch", out=tmp_path / "full"),
        TrainConfig.from_settings(
            **(base | dict(layers=3)),
            model="gcn",
            p=0.5,
            exchange="direct",
            nonzero_rows="on",
            out=tmp_path / "nonzero",
        ),
    ]
    results = run_ranks(3, configs, nodes=[0, 0, 1], instrument=instrument)
    seen = {site for rank in results for result in rank for site in result["instrumented"]}
    assert sorted(seen - SITES.keys()) == [], (
        "new host reads in the epoch loop: remove them or list them in SITES and docs/training.md"
    )
    assert sorted(SITES.keys() - seen) == [], "listed sites no longer occur: drop them from SITES and docs/training.md"
    full = {site for rank in results for site in rank[3]["instrumented"]}
    assert {s for s in full if SITES[s] == "device"} == {
        "metrics.accounting.EpochAccount.row:tolist",
        "metrics.accounting.EpochAccount.gather:cpu",
        "run.train._evaluate:cpu",
    }
    documented = DOCS.read_text()
    for site, kind in SITES.items():
        if kind == "device":
            assert f"`{site}`" in documented, site


def test_empty_splits_every_model_with_staleness_and_inductive(tmp_path, monkeypatch):
    """A partition with no boundary node (and whose rows nobody needs) and p = 0.05 (many
    pairs of ranks send nothing): GraphSAGE and GCN, synchronous and stale, inductive, every
    all-to-all runs with zero-sized splits and zero-row totals through the checks NCCL
    needs (Comm's, on gloo), with the pure-torch kernels CUDA runs."""
    monkeypatch.setenv("BNSGCN_KERNELS", "torch")
    parts = graph_with_island(tmp_path / "parts")
    base = dict(parts_dir=parts, layers=2, hidden=4, epochs=3, eval_every=1, seed=1, p=0.05)
    variants = {
        "sage": dict(model="graphsage"),
        "gcn-inductive": dict(model="gcn", inductive=True, exchange="hierarchical"),
        "sage-stale": dict(model="graphsage", staleness=1, compress="fp16", exchange="hierarchical"),
        "gat-stale": dict(model="gat", heads=2, staleness=1),
    }
    configs = [TrainConfig.from_settings(**base, **v, out=tmp_path / name) for name, v in variants.items()]
    run_ranks(4, configs, nodes=[0, 0, 1, 1])
    for config in configs:
        records = [json.loads(line) for line in (config.run.out / "metrics.jsonl").read_text().splitlines()]
        epochs = [r for r in records if "epoch" in r]
        assert len(epochs) == 3 and all(np.isfinite(r["loss"]) for r in epochs), config.run.out.name
        assert min(r["sampled_boundary"] for r in epochs) < 40, config.run.out.name
        report = json.loads((config.run.out / "report.json").read_text())
        island = report["ranks"][3]
        assert (
            island["boundary_nodes"] == 0
            and island["per_epoch"]["received_features"] == island["per_epoch"]["sent_features"] == 0
        )
