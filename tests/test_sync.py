"""When some ranks are slower: ``--inject-delay`` and ``--sync`` (bnsgcn.sync.stragglers, bnsgcn.sync.averaging).

* flags: bad values refused in one line, on the parser and in the launcher before any rank starts;
* injected delay: its own phase in the epoch records and report.json, never compute; seeded draws;
* ``allreduce``: bit-identical with and without the flag (and with a delay injected);
* each decoupled mode against an independent path to the same numbers: ``grouped`` with one
  group and ``partial`` with a round of every rank (a sync step of every rank) equal
  ``allreduce`` (to float rounding: one flat sum instead of buckets);
  ``gossip:1`` on two ranks equals ``partial:2`` exactly (pairing by store locks vs. rounds by
  arrival count: both average the two ranks every step); a ``partial`` round's average does
  not depend on who arrives first (different delays, identical parameters);
* gossip pairing over many rounds with random delays: never deadlocks (bounded time), every
  pair is mutual, exactly ``world mod 2`` rank is left alone per round; and the interleaving
  in which two ranks take the same pair at once, replayed operation by operation;
* steps per rank, waits in sync and the final single model in the records and report;
* Cora (public split, 4 ranks, p = 0, 4 seeds): every mode's mean held-out accuracy (of the
  model the run ends with) within 1.5 points of synchronous all-reduce training;
* a rank killed (any mode) or hung (store-based modes) ends the job with the rank named.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import numpy as np
import pytest
import torch.distributed as dist

from bnsgcn.config import TrainConfig, check_world, parse_delays, parse_sync, validate
from bnsgcn.errors import UserError
from bnsgcn.sync import averaging as paramsync
from bnsgcn.sync.averaging import find_partner
from bnsgcn.sync.delay import InjectedDelay

from .helpers.cli import TRAIN, assert_user_error, run_cli
from .helpers.faults import (
    assert_killed_rank_is_named,
    check_hung_rank_named,
    in_background_if_selected,
    run_with_rank_hung,
    train_args,
)
from .helpers.graphs import cora_metis, partition, random_graph
from .helpers.ranks import free_port, held_out_score, run_ranks

MODES = ("grouped:2", "partial:2", "gossip:1")


@pytest.fixture(scope="module")
def parts3(tmp_path_factory):
    return partition(random_graph(120, avg_degree=4, seed=8), 3, tmp_path_factory.mktemp("sync") / "parts3")


@pytest.fixture(scope="module")
def parts2(tmp_path_factory):
    return partition(random_graph(100, avg_degree=4, seed=9), 2, tmp_path_factory.mktemp("sync") / "parts2")


def small(parts, **kw) -> TrainConfig:
    base = TrainConfig.from_settings(
        parts_dir=parts,
        p=0.0,
        layers=2,
        hidden=8,
        dropout=0.2,
        epochs=6,
        eval_every=3,
        device="cpu",
        timeout=60,
        seed=2,
    )
    return base.replace(**kw)


def params_of(results, config_index: int = 0, rank: int = 0) -> dict:
    return results[rank][config_index]["params"]


# --- flags -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(sync="bogus"), "unknown --sync 'bogus'"),
        (dict(sync="partial:0", p=0.0), "needs positive integers"),
        (dict(sync="grouped:2:x", p=0.0), "needs positive integers"),
        (dict(sync="allreduce:2"), "takes no number"),
        (dict(sync="partial:2", p=0.1), "add --staleness 1 (stale exchange) or pass --p 0"),
        (dict(sync="gossip:3", p=0.0, norm="batch"), "--norm batch"),
        (dict(inject_delay="0:x"), "is not R:S or R:LO-HI"),
        (dict(inject_delay="0:0.5-0.2"), "needs 0 <= LO <= HI"),
        (dict(inject_delay="0:nan"), "needs 0 <= LO <= HI"),
        (dict(inject_delay="-1:0.5"), "ranks are 0 or more"),
        (dict(inject_delay="1:0.5,1:0.2"), "names rank 1 twice"),
    ],
)
def test_bad_values_are_refused_in_one_line(kw, words):
    with pytest.raises(UserError) as info:
        validate(TrainConfig.from_settings(**kw))
    assert words in str(info.value) and "\n" not in str(info.value)


def test_world_dependent_checks():
    for delays, sync, words in (
        ("3:1", "allreduce", "names rank 3, but the job has 3 ranks"),
        ("", "partial:4", "pass P <= 3"),
        ("", "grouped:2:4", "pass N <= 3"),
    ):
        with pytest.raises(UserError, match=re.escape(words)):
            check_world(parse_delays(delays), parse_sync(sync), 3)
    check_world(parse_delays("2:0.1-0.2"), parse_sync("grouped:5:3"), 3)  # accepted
    assert parse_sync("grouped:5") == parse_sync("grouped:5:2")  # two groups by default


def test_launcher_refuses_before_any_rank_starts(tmp_path, parts2):
    outcome = run_cli(
        TRAIN,
        [
            "--procs",
            "2",
            "--parts-dir",
            str(parts2),
            "--p",
            "0",
            "--inject-delay",
            "2:0.5",
            "--out",
            str(tmp_path / "run"),
        ],
        tmp_path,
    )
    assert_user_error(outcome, "--inject-delay names rank 2, but the job has 2 ranks")
    assert not (tmp_path / "run").exists()


def test_delay_draws_are_seeded_and_in_range():
    draws = [InjectedDelay({1: (0.4, 0.45)}, 1, seed=3).seconds() for _ in range(2)]
    assert draws[0] == draws[1] and 0.4 <= draws[0] <= 0.45
    many = InjectedDelay({1: (0.4, 0.45)}, 1, seed=3)
    values = [many.seconds() for _ in range(50)]
    assert min(values) >= 0.4 and max(values) <= 0.45 and len(set(values)) > 1
    assert InjectedDelay({1: (0.8, 0.8)}, 1, seed=3).seconds() == 0.8
    assert not InjectedDelay({1: (0.8, 0.8)}, 0, seed=3)  # an unnamed rank does not sleep


# --- injected delay, allreduce unchanged -----------------------------------------------------


def test_injected_delay_is_reported_as_such_and_allreduce_is_unchanged(tmp_path, parts2):
    plain = small(parts2, p=0.5, out=tmp_path / "plain")
    flagged = plain.replace(sync="allreduce", inject_delay="1:0.15", out=tmp_path / "flagged")
    results = run_ranks(2, [plain, flagged])
    for rank in range(2):
        for name, value in params_of(results, 0, rank).items():
            assert np.array_equal(value, params_of(results, 1, rank)[name]), name  # bit-identical
    lines = [json.loads(line) for line in (flagged.run.out / "metrics.jsonl").read_text().splitlines()[:-1]]
    plain_lines = [json.loads(line) for line in (plain.run.out / "metrics.jsonl").read_text().splitlines()[:-1]]
    assert [r["loss"] for r in lines] == [r["loss"] for r in plain_lines]
    for record in lines:
        delay = record["per_rank"]["injected_delay"]
        assert delay[0] == 0.0 and 0.15 <= delay[1] < 0.3, delay
        assert record["time"]["injected_delay"] == delay[1]
        assert record["time"]["compute"] < 0.15  # the sleep is not compute
        assert record["per_rank"]["steps"] == [1, 1]
    report = json.loads((flagged.run.out / "report.json").read_text())
    slow = report["ranks"][1]
    assert slow["time_injected_delay"] >= 0.15 and slow["time_split"]["injected_delay"] >= 0.15
    assert slow["time_split"]["compute_forward"] + slow["time_split"]["compute_backward"] < 0.15
    assert [r["steps"] for r in report["ranks"]] == [plain.run.epochs] * 2
    assert report["summary"]["time_injected_delay"]["straggler"] == 1


# --- each mode against an independent path -----------------------------------------------------


def test_one_group_and_a_round_of_every_rank_equal_allreduce(tmp_path, parts3):
    """``grouped:2:1`` sums gradients over every rank; ``partial:3`` of 3 ranks averages
    every rank's state and gradient (weighted by training nodes) before each step: both are
    the synchronous step, to float rounding (one flat sum, a float64 sum of float32 blobs)."""
    sync = small(parts3, out=tmp_path / "allreduce")
    others = [sync.replace(sync=mode, out=tmp_path / mode.replace(":", "-")) for mode in ("grouped:2:1", "partial:3")]
    results = run_ranks(3, [sync, *others])
    for index in (1, 2):
        for name, value in params_of(results, 0).items():
            np.testing.assert_allclose(
                params_of(results, index)[name], value, rtol=1e-5, atol=1e-6, err_msg=(others[index - 1].sync, name)
            )


def test_gossip_on_two_ranks_equals_partial_two(tmp_path, parts2):
    partial = small(parts2, sync="partial:2", inject_delay="0:0.02", out=tmp_path / "partial")
    gossip = partial.replace(sync="gossip:1", inject_delay="1:0.02", out=tmp_path / "gossip")
    results = run_ranks(2, [partial, gossip])
    for name, value in params_of(results, 0).items():
        assert np.array_equal(params_of(results, 1)[name], value), name


def test_partial_round_does_not_depend_on_arrival_order(tmp_path, parts3):
    first = small(parts3, sync="partial:3", inject_delay="0:0.03", out=tmp_path / "a")
    second = first.replace(inject_delay="2:0.01-0.05", out=tmp_path / "b")
    results = run_ranks(3, [first, second])
    for name, value in params_of(results, 0).items():
        assert np.array_equal(params_of(results, 1)[name], value), name


@pytest.mark.parametrize("mode", MODES)
def test_decoupled_modes_end_with_one_model_and_report_waits(tmp_path, parts3, mode):
    """With --staleness 1 (p > 0) and an injected straggler: every rank ends with the same
    parameters; steps and waits per rank are in the records and the report."""
    config = small(
        parts3, p=0.5, staleness=1, sync=mode, inject_delay="2:0.05", eval_every=2, epochs=5, out=tmp_path / "run"
    )
    results = run_ranks(3, [config])
    for rank in (1, 2):
        for name, value in params_of(results).items():
            assert np.array_equal(params_of(results, 0, rank)[name], value), (rank, name)
    lines = [json.loads(line) for line in (config.run.out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in lines[:-1]] == list(range(1, 6)) and lines[-1]["summary"]
    assert all(len(r["per_rank"]["sync"]) == 3 and r["per_rank"]["steps"] == [1, 1, 1] for r in lines[:-1])
    report = json.loads((config.run.out / "report.json").read_text())
    assert [r["steps"] for r in report["ranks"]] == [5, 5, 5]
    assert all(r["time_sync"] >= 0 and "sync" in r["time_split"] for r in report["ranks"])


# --- gossip pairing --------------------------------------------------------------------------


def _pairing_rank(rank: int, world: int, port: int, rounds: int, queue) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=60))
    rng = random.Random(rank)
    partners = []
    for step in range(rounds):
        time.sleep(rng.random() * 0.01)  # random delays: ranks arrive in every order
        partners.append(find_partner(store, rank, world, f"g/{step}/", random.Random(f"{rank}/{step}"), timeout=60))
    queue.put((rank, partners))
    store.set(f"done/{rank}", "1")
    if rank == 0:  # the store lives here: stay until every rank is done with it
        store.wait([f"done/{r}" for r in range(world)])


@pytest.mark.parametrize("world", [4, 5])
def test_gossip_pairing_never_deadlocks(world):
    rounds = 150
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_pairing_rank, args=(r, world, port, rounds, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = dict(queue.get(timeout=120) for _ in range(world))  # bounded: a deadlock fails here
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for step in range(rounds):
        partners = [got[r][step] for r in range(world)]
        assert all(j is None or partners[j] == r for r, j in enumerate(partners)), (step, partners)
        assert partners.count(None) == world % 2, (step, partners)


class _Scripted:
    """Runs the store operations of several threads one at a time, in the order ``turns``
    names (then lowest thread first): an interleaving that real ranks meet once in
    thousands of rounds, every time. A thread that makes more than ``max_ops`` operations
    in one call is stuck (it waits for a pair that can never be made) and fails."""

    def __init__(self, store: dist.Store, threads: int, turns: list[int], max_ops: int = 300):
        self.store, self.turns, self.max_ops = store, iter(turns), max_ops
        self.cond = threading.Condition()
        self.live, self.waiting, self.turn = set(range(threads)), set(), None
        self.ops = [0] * threads

    def view(self, me: int):
        """A store for thread ``me``: each operation waits for that thread's turn."""
        sched = self

        class View:
            def __getattr__(self, name):
                def op(*args):
                    sched.wait_turn(me)
                    try:
                        return getattr(sched.store, name)(*args)
                    finally:
                        with sched.cond:
                            sched.turn = None
                            sched.cond.notify_all()

                return op

        return View()

    def wait_turn(self, me: int) -> None:
        self.ops[me] += 1
        if self.ops[me] > self.max_ops:
            raise AssertionError(f"rank {me}: no partner after {self.max_ops} store operations")
        with self.cond:
            self.waiting.add(me)
            self.cond.notify_all()
            while self.turn != me:
                self.cond.wait()

    def leave(self, me: int) -> None:
        with self.cond:
            self.live.discard(me)
            self.cond.notify_all()

    def run(self) -> None:
        """Grant turns until every thread has left."""
        with self.cond:
            while self.live:
                self.cond.wait_for(lambda: self.turn is None and self.waiting >= self.live)
                if self.live:
                    wanted = next(self.turns, None)
                    self.turn = wanted if wanted in self.waiting else min(self.waiting)
                    self.waiting.discard(self.turn)
                    self.cond.notify_all()


class _Picks:
    """A rank's draws: it chooses ``partner`` whenever that one is free; no jitter."""

    def __init__(self, partner: int):
        self.partner = partner

    def choice(self, free: list[int]) -> int:
        return self.partner if self.partner in free else free[0]

    def random(self) -> float:
        return 0.0


def test_gossip_pairing_survives_two_ranks_taking_the_same_pair(monkeypatch):
    """Ranks 0 and 1 try pair 0:1 at once while 2 tries 1:2 and 3 tries 2:3; 0 takes its
    lock first, 1 finds it held by the same pair, fails on its own lock (held by 2),
    releases 0's lock and goes on waiting; 2 fails and releases 1's lock, then 0 takes it.
    The first version read the pair alone from a lock, so 1 took 0's lock for its own:
    0 left paired with 1 while 1 waited forever for 0's lock to name the pair."""
    monkeypatch.setattr(paramsync, "POLL_S", 0.0)  # the script, not sleeps, orders the ranks
    world, picks = 4, {0: 1, 1: 0, 2: 1, 3: 2}
    arrive, look = [0, 0, 1, 1, 2, 2, 3, 3], [r for r in range(world) for _ in range(2 * world - 1)]
    race = [2, 3, 0, 1, 1, 1, 2, 2, 0, 3]  # each rank's lock attempts, in the order above
    sched = _Scripted(dist.HashStore(), world, arrive + look + race)
    got, errors = {}, []

    def rank(r: int) -> None:
        try:
            got[r] = find_partner(sched.view(r), r, world, "g/", _Picks(picks[r]), timeout=600)
        except AssertionError as exc:
            errors.append(str(exc))
        finally:
            sched.leave(r)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    sched.run()
    assert not errors, (errors, got)
    assert all(got[got[r]] == r for r in range(world)), got


# --- Cora: accuracy of every mode against synchronous training -------------------------------

CORA_SEEDS = (0, 1, 2, 3)
# The target: each mode within 1.5 points of synchronous all-reduce training, on the mean over
# the seeds of the accuracy of the model a run ends with (after the final average of every
# rank's parameters), here on Cora's 1,500 held-out nodes (validation and test together) and
# averaged over the run's last two evaluations (helpers.ranks.held_out_score): a sharper
# statistic than the last test score alone. Not the score at the best-validation epoch:
# picking one of 20 evaluations by the validation nodes adds noise of its own. Cora's features
# are its 64 leading principal components (helpers.graphs.cora_metis): the modes are compared
# with each other, not with a published score, at a third of the time of 1,433 columns.
#
# Measured 2026-11-29, 4 ranks on 2 cores of a machine that other jobs kept busy (load 6-8),
# seeds 0-19, 100 epochs; all-reduce repeats exactly. Per mode, the mean and standard
# deviation over the 20 runs of (mode - all-reduce, same seed), in points:
#
#   held-out, last two evaluations:  grouped:5 +0.12 (0.38), partial:3 +0.08 (0.59), gossip:1 +0.23 (0.52)
#
# so with 4 seeds a mean below -1.5 is more than 5 standard deviations of the mean away for
# every mode. 200 epochs measured the same gaps (grouped:5 +0.07 (0.34), partial:3 -0.03
# (0.41), gossip:1 -0.01 (0.54), seeds 0-9) at twice the time. Averaging that is wrong (e.g.
# parameters without Adam's moments: 59% against 81% on the full features) fails by far.
CORA_TOLERANCE = 0.015
# Evaluating every 5 epochs makes every 5th epoch a sync point (one full average) for the
# decoupled modes; with every 10 they measured 1.4-1.7 points below all-reduce.


@pytest.fixture(scope="module")
def cora_parts(tmp_path_factory):
    return cora_metis(4, tmp_path_factory.mktemp("cora") / "cora-4", components=64)


def cora_scores(parts, sync: str, out) -> list[float]:
    configs = [
        TrainConfig.from_settings(
            parts_dir=parts,
            p=0.0,
            model="graphsage",
            layers=2,
            norm="none",
            hidden=16,
            dropout=0.5,
            lr=0.01,
            weight_decay=5e-4,
            epochs=100,
            eval_every=5,
            seed=seed,
            device="cpu",
            sync=sync,
            out=out / f"{seed}",
        )
        for seed in CORA_SEEDS
    ]
    run_ranks(4, configs, timeout=600)
    return [held_out_score(c.run.out / "metrics.jsonl", parts) for c in configs]


@pytest.fixture(scope="module")
def cora_sync_scores(cora_parts, tmp_path_factory):
    return cora_scores(cora_parts, "allreduce", tmp_path_factory.mktemp("cora-allreduce"))


# partial:3 rather than 2 of the 4 ranks: rounds form in arrival order, which without delays
# is the scheduler's, and partial:2 measured 0.8-1.4 points below all-reduce (at the
# best-validation epoch, 2026-11-24): too near the bound for a test that must not fail by chance.
@pytest.mark.parametrize("mode", ("grouped:5", "partial:3", "gossip:1"))
def test_cora_accuracy_matches_synchronous_training(cora_parts, cora_sync_scores, tmp_path, mode):
    scores = cora_scores(cora_parts, mode, tmp_path)
    print(f"cora p=0 held-out scores: allreduce {cora_sync_scores} {mode} {scores}")  # pytest -rP
    assert np.mean(scores) >= np.mean(cora_sync_scores) - CORA_TOLERANCE, (mode, scores, cora_sync_scores)


# --- a rank dies or hangs --------------------------------------------------------------------


STORE_MODES = ("partial:2", "gossip:1")
HANG_TIMEOUT_S = 5


@pytest.fixture(scope="module")
def hung_store_rounds(request, parts2, tmp_path_factory):
    """For each store-based mode, the job of test_hung_rank_in_a_store_round_is_named: rank 1
    suspended after the first epoch (helpers.faults.run_with_rank_hung). Both start in the
    background with the first test that asks for them, the killed-rank tests (each job mostly
    waits: --timeout, then the launcher's grace periods), not earlier: the module's earlier
    tests time epochs and sleeps."""

    def hang(mode: str) -> tuple:
        cwd = tmp_path_factory.mktemp(f"hung-{mode.replace(':', '-')}")
        run_dir = cwd / "run"
        # between evaluations (every 50 epochs) ranks meet only in the store's rounds
        args = train_args(
            parts2,
            run_dir,
            "--epochs",
            "100000",
            "--checkpoint-every",
            "0",
            "--timeout",
            str(HANG_TIMEOUT_S),
            "--p",
            "0",
            "--sync",
            mode,
            "--eval-every",
            "50",
        )
        return cwd, run_dir, run_with_rank_hung(cwd, args, HANG_TIMEOUT_S)

    def both() -> dict:
        with ThreadPoolExecutor(len(STORE_MODES)) as pool:
            return dict(zip(STORE_MODES, pool.map(hang, STORE_MODES)))

    with in_background_if_selected(request, "test_hung_rank_in_a_store_round_is_named", both) as jobs:
        yield jobs


@pytest.mark.usefixtures("hung_store_rounds")
@pytest.mark.parametrize("mode", MODES)
def test_rank_killed_in_any_mode_ends_the_job_naming_it(tmp_path, parts2, mode):
    assert_killed_rank_is_named(
        tmp_path,
        train_args(
            parts2, tmp_path / "run", "--epochs", "100000", "--checkpoint-every", "0", "--p", "0", "--sync", mode
        ),
    )


@pytest.mark.parametrize("mode", STORE_MODES)
def test_hung_rank_in_a_store_round_is_named(hung_store_rounds, mode):
    """The waits of partial and gossip are in the job's store, not in a collective: they too
    end after --timeout and name the rank that stopped."""
    cwd, run_dir, hung = hung_store_rounds.result()[mode]
    check_hung_rank_named(cwd, run_dir, hung, HANG_TIMEOUT_S, r"rank 1 stopped at epoch \d+ while the others waited$")
