"""Every boundary exchange strategy behind one interface (bnsgcn.exchange): the same short job
through each, the strategy built by the factory from the configuration, driven by the train
loop through the interface alone."""

from __future__ import annotations

import json
import math

import pytest

from bnsgcn.config import TrainConfig

from .helpers.graphs import partition, random_graph
from .helpers.ranks import run_ranks

WORLD, EPOCHS = 3, 3
# setting -> (the strategy the factory must build, whether rows move)
STRATEGIES = {
    "local": (dict(p=0.0), "LocalExchange", False),
    "synchronous": (dict(p=0.5), "BoundaryExchange", True),
    "stale": (dict(p=0.5, staleness=1), "StaleExchange", True),
    "bounded lag": (dict(p=0.5, staleness=1, max_lag=2), "LagExchange", True),
}


def record_strategy():
    """In a rank: wrap the factory the train loop calls, recording which strategy it built,
    every sample it drew and whether it was closed."""
    import bnsgcn.run.train as train

    make, seen = train.make_exchange, {"draws": [], "closed": 0}

    def making(*args, **kwargs):
        exchange = make(*args, **kwargs)
        seen["strategy"] = type(exchange).__name__
        draw, close = exchange.draw, exchange.close

        def drawing(epoch):
            keep, plan = draw(epoch)
            seen["draws"].append((epoch, int(keep.sum()), plan.num_received))
            return keep, plan

        def closing():
            seen["closed"] += 1
            close()

        exchange.draw, exchange.close = drawing, closing
        return exchange

    train.make_exchange = making

    def collect():
        train.make_exchange = make
        return seen

    return collect


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("strategies")
    parts = partition(random_graph(num_nodes=72, avg_degree=5, seed=5), WORLD, tmp / "parts")
    base = dict(
        parts_dir=parts, model="graphsage", layers=2, hidden=8, epochs=EPOCHS, eval_every=1, seed=2, device="cpu"
    )
    configs = [
        TrainConfig.from_settings(**base, **settings, out=tmp / name) for name, (settings, _, _) in STRATEGIES.items()
    ]
    results = run_ranks(WORLD, configs, instrument=record_strategy)
    return {name: ([rank[i] for rank in results], config) for i, (name, config) in enumerate(zip(STRATEGIES, configs))}


def _records(run_dir) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "epoch" in r and "summary" not in r]


@pytest.mark.parametrize("name", STRATEGIES)
def test_the_factory_builds_the_strategy_the_loop_drives_through_the_interface(runs, name):
    ranks, config = runs[name]
    _, expected, moves_rows = STRATEGIES[name]
    for rank in ranks:
        seen = rank["instrumented"]
        assert seen["strategy"] == expected, name
        assert [epoch for epoch, _, _ in seen["draws"]] == list(range(EPOCHS)), name  # one sample per epoch
        for _, kept, received in seen["draws"]:
            assert received == kept, name  # the plan brings exactly the sampled rows
            assert (kept > 0) == moves_rows, name
        assert seen["closed"] == 1, name  # closed once, at the end
    records = _records(config.run.out)
    assert [r["epoch"] for r in records] == list(range(1, EPOCHS + 1))
    assert all(math.isfinite(r["loss"]) for r in records), name
    # what the records count is what the strategy drew, summed over ranks
    drawn = [sum(rank["instrumented"]["draws"][e][2] for rank in ranks) for e in range(EPOCHS)]
    assert [r["sampled_boundary"] for r in records] == drawn, name


def test_stale_strategies_start_with_the_synchronous_epoch(runs):
    """The first epoch has no stale rows yet: stale and bounded-lag exchanges run it
    synchronously, on the same sample, so its loss is the synchronous exchange's exactly;
    at p = 0 no boundary row contributes, and the loss differs."""
    first = {name: _records(config.run.out)[0]["loss"] for name, (_, config) in runs.items()}
    assert first["stale"] == first["bounded lag"] == first["synchronous"]
    assert first["local"] != first["synchronous"]
