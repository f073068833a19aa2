"""The compression accuracy benchmark (benchmarks/compression.py): its summary of hand-made runs
against the targets it states."""

from __future__ import annotations

import pytest

from benchmarks.compression import summarise


def test_accuracy_benchmark_summary_states_the_targets():
    scores = {
        ("none", 0): (0.80, 0.82),
        ("int8", 0): (0.80, 0.81),
        ("fp16", 0): (0.79, 0.80),
        ("int4", 0): (0.5, 0.5),
        ("none", 1): (0.79, 0.81),
        ("int8", 1): (0.78, 0.78),
    }
    runs = [
        {"graph": "cora", "format": f, "p": 1.0, "staleness": st, "seed": s, "test_score": score}
        for (f, st), pair in scores.items()
        for s, score in enumerate(pair)
    ]
    rows = {
        (r["format"], r["staleness"]): r
        for r in summarise(
            runs + [{"graph": "cora", "format": "int8", "p": 1.0, "staleness": 0, "seed": 9, "error": "x"}]
        )
    }
    assert (
        rows["int8", 0]["points_vs_none"] == pytest.approx(-0.5)
        and rows["int8", 0]["met"] is True
        and rows["int8", 0]["seeds"] == 2
    )
    assert rows["fp16", 0]["points_vs_none"] == pytest.approx(-1.5) and rows["fp16", 0]["met"] is False
    assert rows["int4", 0]["met"] is None  # no target for int4
    assert rows["int8", 0]["stale_met"] is None  # staleness 0 is the baseline
    assert rows["none", 1]["points_vs_staleness_0"] == pytest.approx(-1.0) and rows["none", 1]["stale_met"] is True
    assert rows["int8", 1]["points_vs_staleness_0"] == pytest.approx(-2.5) and rows["int8", 1]["stale_met"] is False
    assert rows["int8", 1]["points_vs_none"] == pytest.approx(-2.0)  # against none at the same staleness
