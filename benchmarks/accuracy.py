"""Time to accuracy: how long a run trains until its validation score reaches a target.

Epoch time alone flatters a method that makes epochs cheaper but needs more of them
(Bajaj et al., PVLDB 2025, found mini-batch training reaching the accuracy of the
partition-parallel systems sooner in wall-clock time). So the benchmarks also state, per
run, the epochs and the training seconds until the validation score first reaches a
target, by default 99% of the best validation score of the p = 1 run of the same
configuration (exact full-graph training: what sampling must come close to).

Training seconds exclude evaluation: they are the sum over epochs of ``time.epoch -
time.evaluation`` (the slowest rank's, as ``metrics.jsonl`` records them), so a run that
evaluates every epoch is not charged for measuring itself.

    from benchmarks.accuracy import validation_curve, time_to_accuracy
    curve = validation_curve(epoch_records)          # metrics.jsonl epoch lines
    time_to_accuracy(curve, target=0.95)            # {"target", "epochs", "seconds"} or None
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable

# A run that evaluated only once (e.g. ``--eval-every 0``: after the last epoch) can only
# say "by the end or never": it gets no time to accuracy.
MIN_EVALUATIONS = 2
TARGET_FRACTION = 0.99

# One evaluated epoch: (epoch, training seconds up to and including it, validation score).
Point = tuple[int, float, float]


def validation_curve(records: Iterable[dict]) -> list[Point]:
    """The evaluated epochs of a run, from its ``metrics.jsonl`` lines.

    Lines without ``time`` (the summary) are skipped; every epoch line adds its training
    seconds (``time.epoch - time.evaluation``) whether or not it evaluated.
    """
    curve: list[Point] = []
    seconds = 0.0
    for record in records:
        if "time" not in record:
            continue
        seconds += record["time"]["epoch"] - record["time"].get("evaluation", 0.0)
        if record.get("val_score") is not None:
            curve.append((record["epoch"], seconds, record["val_score"]))
    return curve


def time_to_accuracy(curve: list[Point], target: float) -> dict | None:
    """``{"target", "epochs", "seconds"}`` at the first evaluated epoch whose validation
    score reaches ``target``; None when none does."""
    for epoch, seconds, score in curve:
        if score >= target:
            return {"target": target, "epochs": epoch, "seconds": seconds}
    return None


def attach_time_to_accuracy(
    runs: list[dict], config: Callable[[dict], Hashable], fraction: float = TARGET_FRACTION
) -> None:
    """Set ``time_to_accuracy`` on every run that holds a ``val_curve``.

    The target is ``fraction`` times the best validation score of the p = 1 run with the
    same ``config(run)`` (a key of everything but p: graph, partitioning, ranks, model,
    link, ...). None where no such p = 1 run exists, where the run evaluated fewer than
    :data:`MIN_EVALUATIONS` times; ``{"target", "epochs": None, "seconds": None}`` where
    it never reached the target. Failed runs (holding ``error``) are left alone.
    """
    runs = [r for r in runs if "error" not in r and "val_curve" in r]
    best = {config(r): max(score for _, _, score in r["val_curve"]) for r in runs if r["p"] == 1 and r["val_curve"]}
    for run in runs:
        key = config(run)
        if key not in best or len(run["val_curve"]) < MIN_EVALUATIONS:
            run["time_to_accuracy"] = None
        else:
            target = fraction * best[key]
            run["time_to_accuracy"] = time_to_accuracy(run["val_curve"], target) or {
                "target": target,
                "epochs": None,
                "seconds": None,
            }
