"""--optimizer, --lr-schedule, --warmup-epochs and --grad-clip in training jobs of 2 CPU ranks.

* every optimizer with every schedule (and clipping) on a sampled, dropped-out run: every
  rank holds the same parameters after every step and steps at the same rate, the rate
  metrics.jsonl records; with a work pool too, and a decoupled --sync ends with one model;
* at p = 1 without dropout a run equals the float64 single-process reference trained with
  torch.optim's optimizers, schedulers and clip_grad_norm_ (and the clipping did clip);
* a run stopped after epoch k (fewer --epochs, a checkpoint) and resumed equals the
  uninterrupted run bit for bit, losses, rates and parameters, for each schedule (the
  plateau's cuts on both sides of the checkpoint), with stale exchange and a decoupled
  --sync among them;
* a resumed run steps with its own flags (a new --lr), but another --optimizer is refused;
* bad combinations are refused in one line, on the parser and by the launcher.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bnsgcn.config import TrainConfig, validate
from bnsgcn.errors import UserError
from bnsgcn.nn.schedules import SCHEDULES

from .helpers import reference
from .helpers.cli import TRAIN, assert_user_error, run_cli
from .helpers.graphs import partition, random_graph
from .helpers.ranks import record_steps, run_ranks

OPTIMIZERS = {
    "adam": dict(optimizer="adam", weight_decay=5e-4),
    "adamw": dict(optimizer="adamw", weight_decay=0.05),
    "sgd": dict(optimizer="sgd", lr=0.1, momentum=0.9, nesterov=True),
}
SCHEDULE_FLAGS = {
    "none": dict(warmup_epochs=2),
    "cosine": dict(lr_schedule="cosine", warmup_epochs=1),
    "step": dict(lr_schedule="step", lr_step_epochs=2, lr_gamma=0.5),
    "plateau": dict(lr_schedule="plateau", plateau_patience=1, plateau_factor=0.5),
}


@pytest.fixture(scope="module")
def graph():
    return random_graph(num_nodes=60, avg_degree=5, seed=4)


@pytest.fixture(scope="module")
def parts(graph, tmp_path_factory):
    return partition(graph, 2, tmp_path_factory.mktemp("parts"))


def _small(parts: Path, out: Path, **settings) -> TrainConfig:
    base = dict(
        parts_dir=parts,
        p=0.5,
        layers=2,
        hidden=8,
        dropout=0.5,
        epochs=6,
        eval_every=1,
        device="cpu",
        seed=1,
        out=out,
    )
    config = TrainConfig.from_settings(**(base | settings))
    validate(config)
    return config


def _records(run_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "loss" in r and not r.get("summary")]


def _assert_same_params(a: dict, b: dict) -> None:
    """Equal to float32 rounding: rarely two runs of one multi-rank job differ in the last
    place (see test_lag's seed test)."""
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=1e-9, err_msg=name)


def test_every_rank_steps_alike_with_each_optimizer_and_schedule(parts, tmp_path):
    combos = list(itertools.product(OPTIMIZERS, SCHEDULE_FLAGS))
    configs = [
        _small(
            parts,
            tmp_path / f"{o}-{s}",
            **OPTIMIZERS[o],
            **SCHEDULE_FLAGS[s],
            grad_clip=0.3 if (i + i // len(SCHEDULE_FLAGS)) % 2 else None,  # each with and without clipping
        )
        for i, (o, s) in enumerate(combos)
    ]
    results = run_ranks(2, configs, instrument=record_steps)
    for i, ((o, s), config) in enumerate(zip(combos, configs)):
        steps = [results[rank][i]["instrumented"] for rank in range(2)]
        assert len(steps[0]) == len(steps[1]) == config.run.epochs, (o, s)
        for step, (mine, theirs) in enumerate(zip(*steps)):
            assert mine["lr"] == theirs["lr"], (o, s, step)
            for a, b in zip(mine["params"], theirs["params"]):
                assert np.array_equal(a, b), (o, s, step)  # the same parameters after every step
        rates = [step["lr"] for step in steps[0]]
        assert [r["lr"] for r in _records(config.run.out)] == rates, (o, s)
        if s != "plateau":  # a function of the epoch alone
            schedule = SCHEDULES[config.optim.lr_schedule](config.optim, config.run.epochs)
            assert rates == [schedule.lr(e) for e in range(config.run.epochs)], (o, s)
        assert len(set(rates)) > 1 or s == "plateau", (o, s)  # the schedule did change the rate


def test_a_work_pool_steps_alike_and_a_decoupled_sync_ends_with_one_model(graph, tmp_path):
    parts4 = partition(graph, 4, tmp_path / "parts4")
    settings = dict(p=0.0, **OPTIMIZERS["sgd"], **SCHEDULE_FLAGS["cosine"], grad_clip=0.3)
    configs = [
        _small(parts4, tmp_path / "pool", work_pool=True, **settings),
        _small(parts4, tmp_path / "pool-partial", work_pool=True, sync="partial:2", **settings),
        _small(parts4, tmp_path / "pool-gossip", work_pool=True, sync="gossip:1", p=0.0, **OPTIMIZERS["adamw"]),
    ]
    results = run_ranks(2, configs, instrument=record_steps)
    pool = [results[rank][0]["instrumented"] for rank in range(2)]
    assert len(pool[0]) == len(pool[1]) >= configs[0].run.epochs * 2  # lockstep rounds of one partition each
    for mine, theirs in zip(*pool):
        assert mine["lr"] == theirs["lr"]
        for a, b in zip(mine["params"], theirs["params"]):
            assert np.array_equal(a, b)
    for i in (1, 2):  # ranks step apart, and are averaged into one model at the end
        _assert_same_params(results[0][i]["params"], results[1][i]["params"])
    cosine = SCHEDULES["cosine"](configs[1].optim, configs[1].run.epochs)
    assert [r["lr"] for r in _records(configs[1].run.out)] == [cosine.lr(e) for e in range(configs[1].run.epochs)]


def test_p1_matches_torch_optim_in_float64(graph, parts, tmp_path):
    cases = {
        "sgd-step": dict(
            optimizer="sgd",
            lr=0.05,
            momentum=0.9,
            nesterov=True,
            weight_decay=5e-4,
            lr_schedule="step",
            lr_step_epochs=2,
            lr_gamma=0.5,
            warmup_epochs=1,
        ),
        "adamw-cosine-clip": dict(
            optimizer="adamw", weight_decay=0.05, lr_schedule="cosine", warmup_epochs=1, grad_clip=0.05
        ),
        "adam-clip": dict(grad_clip=0.05),
        "sgd": dict(optimizer="sgd", lr=0.1),
    }
    configs = [
        reference.exact_config("graphsage", True, parts, tmp_path / name, epochs=6, **flags)
        for name, flags in cases.items()
    ]
    results = run_ranks(2, configs)
    for i, config in enumerate(configs):
        reference.assert_run_matches(config, graph, [results[rank][i]["params"] for rank in range(2)])
        _assert_same_params(results[0][i]["params"], results[1][i]["params"])
        if config.optim.grad_clip is not None:  # the check can fail: clipping changed the run
            clipped, unclipped = (reference.train(c, graph)[1] for c in (config, config.replace(grad_clip=None)))
            assert max(float((clipped[k] - unclipped[k]).abs().max()) for k in clipped) > 1e-3


RESUMED = {
    "sgd-cosine": dict(**OPTIMIZERS["sgd"], **SCHEDULE_FLAGS["cosine"], eval_every=2),
    "adamw-step-clip": dict(**OPTIMIZERS["adamw"], **SCHEDULE_FLAGS["step"], grad_clip=0.3, eval_every=2),
    "adam-plateau-clip": dict(**OPTIMIZERS["adam"], **SCHEDULE_FLAGS["plateau"], grad_clip=0.3),
    "sgd-plateau-partial": dict(
        **OPTIMIZERS["sgd"], **SCHEDULE_FLAGS["plateau"], p=0.0, sync="partial:2", grad_clip=0.3
    ),
    "adam-cosine-stale": dict(**SCHEDULE_FLAGS["cosine"], staleness=1, eval_every=2),
}


def test_a_resumed_run_equals_the_uninterrupted_one(parts, tmp_path):
    """Stopped after epoch 4 of 8 (a run of 4 epochs writing its checkpoint), resumed to 8."""
    whole, first, rest = [], [], []
    for name, flags in RESUMED.items():
        # the cosine's length is that of the whole run; each run has the checkpoint of epoch 4
        flags = flags | ({"cosine_epochs": 8 - flags["warmup_epochs"]} if "cosine" in name else {})
        whole.append(_small(parts, tmp_path / f"{name}-whole", epochs=8, checkpoint_every=4, **flags))
        first.append(_small(parts, tmp_path / f"{name}-resumed", epochs=4, checkpoint_every=4, **flags))
        rest.append(first[-1].replace(epochs=8, resume=True))
    results = run_ranks(2, whole + first + rest)
    n = len(RESUMED)
    for i, name in enumerate(RESUMED):
        uninterrupted, resumed = _records(whole[i].run.out), _records(rest[i].run.out)
        assert [r["epoch"] for r in resumed] == list(range(1, 9)), name
        losses = [r["loss"] for r in resumed], [r["loss"] for r in uninterrupted]
        np.testing.assert_allclose(*losses, rtol=1e-6, atol=0, err_msg=name)  # to float32 rounding, as the params
        assert [r["lr"] for r in resumed] == [r["lr"] for r in uninterrupted], name
        for rank in range(2):
            _assert_same_params(results[rank][2 * n + i]["params"], results[rank][i]["params"])
        rates = [r["lr"] for r in uninterrupted]
        if "plateau" in name:  # the state the checkpoint carries mattered: cuts before it and after
            assert rates[4] < rates[0] and rates[7] < rates[4], (name, rates)


def test_a_resumed_run_takes_its_own_flags_but_not_another_optimizer(parts, tmp_path):
    written = _small(parts, tmp_path / "run", epochs=2, checkpoint_every=2, **SCHEDULE_FLAGS["step"])
    extended = written.replace(epochs=4, resume=True, lr=0.004)  # how a run is extended: the new rate
    run_ranks(2, [written, extended])
    assert [r["lr"] for r in _records(extended.run.out)] == [0.01, 0.01, 0.002, 0.002]
    assert (
        "optimizer flags changed since the checkpoint: --lr 0.01 (this run: --lr 0.004)"
        in (extended.run.out / "log.txt").read_text()
    )
    with pytest.raises(AssertionError) as failed:
        run_ranks(2, [written.replace(epochs=6, resume=True, optimizer="sgd")])
    assert (
        "checkpoint-000004.pt holds the state of --optimizer adam, which --optimizer sgd cannot continue; resume "
        "with --optimizer adam, or pass a new --out"
    ) in str(failed.value)


@pytest.mark.parametrize(
    "settings, words",
    [
        (dict(optimizer="lamb"), "unknown optimizer 'lamb'; choose --optimizer from adam, adamw, sgd"),
        (dict(momentum=0.9), "--momentum is for --optimizer sgd, but the optimizer is adam"),
        (dict(optimizer="adamw", nesterov=True), "add --optimizer sgd or drop --nesterov"),
        (dict(optimizer="sgd", nesterov=True), "--nesterov needs momentum, but --momentum is 0"),
        (dict(optimizer="sgd", momentum=1.0), "--momentum 1.0 is outside [0, 1)"),
        (dict(grad_clip=0.0), "--grad-clip 0.0 must be a positive gradient norm"),
        (dict(grad_clip=float("nan")), "--grad-clip nan is not a finite number"),
        (dict(lr_schedule="linear"), "unknown --lr-schedule 'linear'; choose from none, cosine, step, plateau"),
        (dict(warmup_epochs=-1), "--warmup-epochs -1 must be 0 or a positive integer"),
        (dict(lr_gamma=0.5), "--lr-gamma sets the step schedule, but --lr-schedule is none"),
        (dict(lr_schedule="cosine", plateau_patience=5), "add --lr-schedule plateau or drop --plateau-patience"),
        (dict(cosine_epochs=10, lr_schedule="step"), "--cosine-epochs sets the cosine schedule"),
        (dict(lr_schedule="cosine", cosine_epochs=100), "pass --cosine-epochs 200 or more"),
        (dict(lr_schedule="cosine", epochs=5, warmup_epochs=5), "leaves no epoch of --epochs 5 for the cosine"),
        (dict(lr_schedule="step", lr_step_epochs=0), "--lr-step-epochs 0 must be a positive integer"),
        (dict(lr_schedule="step", lr_gamma=1.5), "--lr-gamma 1.5 is outside (0, 1]"),
        (dict(lr_schedule="plateau", plateau_factor=1.0), "--plateau-factor 1.0 is outside (0, 1)"),
        (dict(lr_schedule="plateau", plateau_patience=0), "--plateau-patience 0 must be a positive number"),
        (dict(lr_schedule="plateau", eval_every=0), "--lr-schedule plateau acts on the validation score"),
    ],
)
def test_bad_values_are_refused_in_one_line(settings, words):
    with pytest.raises(UserError) as info:
        validate(TrainConfig.from_settings(**settings))
    assert words in str(info.value) and "\n" not in str(info.value)


def test_good_values_pass():
    for settings in (
        dict(optimizer="sgd", momentum=0.9, nesterov=True, grad_clip=1.0),
        dict(optimizer="adamw", weight_decay=0.01, lr_schedule="cosine", warmup_epochs=5, cosine_epochs=300),
        dict(lr_schedule="step", lr_step_epochs=30, lr_gamma=1.0),
        dict(lr_schedule="plateau", plateau_patience=2, plateau_factor=0.5, warmup_epochs=10),
        dict(warmup_epochs=500),  # a warm-up longer than the run: the rate never reaches --lr
    ):
        validate(TrainConfig.from_settings(**settings))


def test_the_launcher_refuses_before_any_rank_starts(parts, tmp_path):
    outcome = run_cli(
        TRAIN,
        ["--procs", "2", "--parts-dir", str(parts), "--out", str(tmp_path / "run"), "--momentum", "0.9"],
        tmp_path,
    )
    assert_user_error(outcome, "--momentum is for --optimizer sgd", "add --optimizer sgd or drop --momentum")
    assert not (tmp_path / "run").exists()


def test_sgd_state_is_averaged_by_a_decoupled_sync():
    """What a decoupled --sync averages covers SGD's momentum, as Adam's moments."""
    from bnsgcn.nn.optim import SGD
    from bnsgcn.sync.averaging import Decoupled

    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    sync = Decoupled.__new__(Decoupled)  # only what averaged() reads
    sync.params, sync.optimizer = params, SGD(params, lr=0.1, momentum=0.9)
    covered = sync.averaged()
    assert len(covered) == 4 and covered[2] is sync.optimizer.state[params[0]]["momentum_buffer"]
