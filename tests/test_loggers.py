"""The experiment loggers (--logger): TensorBoard, W&B (offline) and metrics.csv receive the epochs
metrics.jsonl records, a resumed run continues them without repeating an epoch, and a logger whose
package is missing stops the job before any rank starts, in one line."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import pandas as pd
import pytest

from bnsgcn.config import TrainConfig, from_args, to_argv, validate
from bnsgcn.config.flags import add_arguments
from bnsgcn.errors import UserError
from bnsgcn.launch import cli
from bnsgcn.metrics.loggers import CsvLogger

from .helpers.cli import SMALL_RUN
from .helpers.graphs import partition, random_graph
from .helpers.ranks import run_ranks

WORLD = 2
EPOCHS, CHECKPOINT = 3, 2  # the first run; its resumption runs from the checkpoint of epoch 2 to epoch 4
RESUMED_EPOCHS = 4


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    return partition(random_graph(num_nodes=60, seed=3), WORLD, tmp_path_factory.mktemp("parts") / "set")


@pytest.fixture(scope="module")
def logged(parts, tmp_path_factory):
    """A run of 3 epochs with every logger and a checkpoint after epoch 2, then the same run resumed from it
    to epoch 4 with another learning rate (so the epochs it runs again differ in their records)."""
    root = tmp_path_factory.mktemp("logged")
    first = TrainConfig.from_settings(
        parts_dir=parts,
        out=root / "run",
        layers=2,
        hidden=8,
        epochs=EPOCHS,
        eval_every=2,
        checkpoint_every=CHECKPOINT,
        device="cpu",
        threads=1,
        timeout=60.0,
        logger="tensorboard,csv,wandb",
    )
    resumed = first.replace(epochs=RESUMED_EPOCHS, resume=True, lr=0.02)
    with pytest.MonkeyPatch.context() as env:  # the ranks take this process's environment
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_SILENT", "true")
        env.setenv("WANDB_DIR", str(root / "wandb-elsewhere"))  # dir=<run dir> wins over it
        run_ranks(WORLD, [first, resumed])
    run_dir = root / "run"
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, [r for r in lines if not r.get("summary")], lines[-1]


def test_tensorboard_csv_and_wandb_receive_the_epochs_of_metrics_jsonl(logged):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, records, summary = logged
    epochs = list(range(1, RESUMED_EPOCHS + 1))
    assert [r["epoch"] for r in records] == epochs
    loss = np.array([r["loss"] for r in records])

    board = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    board.Reload()
    scalar = {tag: board.Scalars(tag) for tag in board.Tags()["scalars"]}
    assert [e.step for e in scalar["loss"]] == epochs  # the first run's epoch 3, written again, purged
    np.testing.assert_array_equal([e.value for e in scalar["loss"]], loss.astype(np.float32))
    assert [e.step for e in scalar["score/val"]] == [2, 4]  # the evaluated epochs (--eval-every 2, the last)
    np.testing.assert_array_equal(
        [e.value for e in scalar["score/val"]], np.float32([records[1]["val_score"], records[3]["val_score"]])
    )
    np.testing.assert_array_equal(
        [e.value for e in scalar["time/epoch"]], np.float32([r["time"]["epoch"] for r in records])
    )
    assert [e.value for e in scalar["lr"]] == [np.float32(r["lr"]) for r in records]
    for rank in range(WORLD):  # every rank's peak memory, from rank 0's one logger
        assert all(e.value > 1 for e in scalar[f"memory/rank{rank}_peak_mib"])
    assert [e.value for e in scalar["best/val_score"]] == [np.float32(summary["best_val_score"])]
    assert "bytes_sent" in scalar and "bytes_sent/features" in scalar
    assert board.PluginTagToContent("hparams")  # the settings, at the end

    table = pd.read_csv(run_dir / "metrics.csv")
    assert table["epoch"].tolist() == epochs
    assert table["loss"].tolist() == loss.tolist()  # exactly: the text of each float
    assert table["lr"].tolist() == [r["lr"] for r in records]
    assert table["time/epoch"].tolist() == [r["time"]["epoch"] for r in records]
    assert table["bytes_sent"].tolist() == [r["bytes_sent"] for r in records]
    assert table["memory/rank1_peak_mib"].tolist() == [r["per_rank"]["peak_memory_bytes"][1] / 2**20 for r in records]
    assert table["score/val"].isna().tolist() == [True, False, True, False]

    # one W&B run per launch (rank 0's alone), in the run directory; the last one holds the final loss (its
    # history's values are JSON text) and the summary's figures
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2, runs
    assert not (run_dir.parent / "wandb-elsewhere").exists()
    (history,) = runs[-1].glob("run-*.wandb")
    logged_bytes = history.read_bytes()
    assert json.dumps(summary["final_loss"]).encode() in logged_bytes and b"best/val_score" in logged_bytes


def test_a_resumed_run_continues_metrics_csv_without_repeating_an_epoch(logged):
    run_dir, records, _ = logged
    table = pd.read_csv(run_dir / "metrics.csv")
    assert table["epoch"].tolist() == [1, 2, 3, 4]
    # epochs 1 and 2 of the first run (its checkpoint), 3 and 4 of the resumed one at its learning rate: the first
    # run's epoch 3 is gone
    assert table["lr"].tolist() == [0.01, 0.01, 0.02, 0.02] == [r["lr"] for r in records]


def _record(epoch: int, ranks: int) -> dict:
    """An epoch's record as the run writes it, its figures made up."""
    return {
        "epoch": epoch,
        "loss": 1 / epoch,
        "lr": 0.01,
        "time": {"epoch": 0.5, "exchange": 0.1},
        "sampled_boundary": 3,
        "bytes_sent": 10,
        "bytes_received": 10,
        "bytes_sent_by_kind": {"features": 10},
        "bytes_intra_node": 10,
        "bytes_inter_node": 0,
        "per_rank": {"peak_memory_bytes": [2**20] * ranks},
    } | ({"train_score": 0.5, "val_score": 0.4, "test_score": 0.3} if epoch % 2 == 0 else {})


def test_metrics_csv_of_a_resumed_run_keeps_the_checkpointed_rows_and_takes_new_columns(tmp_path):
    path = tmp_path / "metrics.csv"
    first = CsvLogger(path)
    for epoch in (1, 2, 3):
        first.log_epoch(_record(epoch, ranks=1))
    first.close()
    with path.open("a") as torn:
        torn.write("4,0.25")  # a row cut short by a kill
    resumed = CsvLogger(path, keep_epochs=2)
    assert pd.read_csv(path)["epoch"].tolist() == [1, 2]  # at once: a run killed again keeps these alone
    resumed.log_epoch(_record(3, ranks=2))  # resumed with a rank more: a column more
    resumed.close()
    table = pd.read_csv(path)
    assert table["epoch"].tolist() == [1, 2, 3] and table["loss"].tolist() == [1, 1 / 2, 1 / 3]
    assert table["memory/rank1_peak_mib"].isna().tolist() == [True, True, False]
    assert table["score/val"].isna().tolist() == [True, False, True]


@pytest.mark.parametrize("package", ["tensorboard", "wandb"])
def test_a_logger_without_its_package_stops_the_job_before_any_rank_starts(
    package, parts, tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, package, None)  # import fails, as where it is not installed
    argv = ["--procs", "2", "--parts-dir", str(parts), "--out", str(tmp_path / "run"), *SMALL_RUN]
    assert cli.main([*argv, "--logger", f"csv,{package}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"error: --logger {package} needs the {package} package, which is not installed; pip install {package} (or "
        f"pip install 'bnsgcn[loggers]'), or drop {package} from --logger"
    ]
    assert not (tmp_path / "run").exists()


def test_logger_flag_forms_and_refusals():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    repeated = from_args(parser.parse_args(["--logger", "tensorboard", "--logger", "csv"]))
    assert repeated.run.logger == "tensorboard,csv" and repeated.run.loggers == ("tensorboard", "csv")
    assert from_args(parser.parse_args(["--logger", "csv, wandb,csv"])).run.loggers == ("csv", "wandb")
    # bnsgcn.train(logger=[...]): a list reaches the ranks as the comma-separated flag
    listed = TrainConfig.from_settings(logger=["wandb", "csv"], wandb_project="p")
    assert to_argv(listed) == ["--logger=wandb,csv", "--wandb-project=p"]
    assert from_args(parser.parse_args(to_argv(listed))).run.loggers == ("wandb", "csv")
    with pytest.raises(UserError, match=r"^unknown logger 'mlflow'; choose --logger from tensorboard, wandb, csv"):
        validate(TrainConfig.from_settings(logger="csv,mlflow"))
    with pytest.raises(UserError, match=r"^--run-name is for the W&B logger, but --logger has no wandb"):
        validate(TrainConfig.from_settings(logger="csv", run_name="x"))
