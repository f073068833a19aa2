"""The benchmark suite (benchmarks/suite.py): the runs each preset plans."""

from __future__ import annotations

import numpy as np

from benchmarks import suite


def test_benchmark_suite_plans_every_run(capsys):
    plan = suite.plan(suite.PRESETS["quick"])
    trains = [step for step in plan if step.kind == "train"]
    ps = {step.p for step in trains}
    assert {1.0, 0.1, 0.01, 0.0} <= ps
    assert {step.ranks for step in trains} >= {1, 2, 4}
    assert {step.model for step in trains} == {"graphsage", "gat"}
    assert any(step.kind == "pyg" for step in plan) and any(step.kind == "bound" for step in plan)
    assert suite.main(["--preset", "quick", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "bnsgcn-train" in printed and "bnsgcn-partition" in printed
    full = suite.plan(suite.PRESETS["full"])
    assert any("nodes=200000" in step.spec for step in full)
    assert np.unique([step.name for step in full]).size == len(full)


def test_target_preset_is_the_reference_graph_alone():
    plan = suite.plan(suite.PRESETS["target"])
    scaling = [step for step in plan if step.group == "scaling"]
    assert {(step.model, step.ranks, step.p) for step in scaling} == {("graphsage", 2, 1.0), ("graphsage", 2, 0.1)}
    assert all("nodes=200000" in step.spec for step in plan if step.group != "baseline")
    assert {step.kind for step in plan if step.group == "reference"} == {"train", "pyg", "bound"}
    assert not any(step.group == "accuracy" for step in plan)
