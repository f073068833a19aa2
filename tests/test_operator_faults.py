"""Faults an operator meets around a run directory: damaged checkpoints.

* Every checkpoint and every rank's part has a SHA-256 checksum file next to it.
  ``--resume`` skips a checkpoint that fails it, naming it, for the one before; with
  checkpoints present but none usable it stops with one line listing them, and deletes
  nothing. Rotation deletes only older checkpoints it verified. A checkpoint without a
  checksum (an older bnsgcn's) loads with a warning. A checkpoint whose tensors do not fit
  the model is one line naming it.

Checks through ``bnsgcn-train`` (a subprocess) read its exit status and last stderr line;
in-process runs (:func:`tests.distributed.run_ranks`) read the rank's error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import logging.handlers
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from bnsgcn.errors import UserError
from bnsgcn.run import checkpoint

from .distributed import partition, random_graph
from .test_errors import TRAIN, assert_kept, assert_user_error, run_cli, snapshot, train_on

SIGNATURE = {"model": "graphsage"}
CHECKPOINTED = ["--checkpoint-every", "2", "--epochs", "4"]  # a finished run: checkpoints of epochs 2 and 4


# --- helpers -----------------------------------------------------------------------------


def flip_middle(path: Path, count: int = 64) -> None:
    """Invert ``count`` bytes in the middle of ``path``: damage of the file's size."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, middle + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def epoch_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "epoch" in r and not r.get("summary")]


def assert_verifies(path: Path) -> None:
    """``path`` has its checksum file, as ``sha256sum`` writes and checks it, and agrees with it."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert Path(f"{path}.sha256").read_text() == f"{digest}  {path.name}\n"


def save(run_dir: Path, epoch: int, keep: int = 5) -> Path:
    return checkpoint.save(run_dir, epoch, {"model": {}, "optimizer": {}, "best": {}, "signature": SIGNATURE}, keep)


def save_legacy(run_dir: Path, epoch: int) -> Path:
    """A checkpoint as a bnsgcn before checksums wrote it: no checksum file."""
    path = checkpoint.checkpoint_dir(run_dir) / f"checkpoint-{epoch:06d}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"epoch": epoch, "model": {}, "optimizer": {}, "best": {}, "signature": SIGNATURE}
    torch.save(state, path)
    return path


@pytest.fixture
def bnsgcn_log():
    """The records logged to the ``bnsgcn`` logger during the test."""
    logger = logging.getLogger("bnsgcn")
    handler = logging.handlers.BufferingHandler(capacity=1000)
    logger.addHandler(handler)
    yield handler.buffer
    logger.removeHandler(handler)


# --- fixtures ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def parts2(tmp_path_factory) -> Path:
    return partition(random_graph(num_nodes=120, avg_degree=4, seed=1), 2, tmp_path_factory.mktemp("set") / "set-2")


@pytest.fixture(scope="module")
def finished_run(parts2, tmp_path_factory) -> Path:
    """A finished two-rank run with the checkpoints of epochs 2 and 4, to copy and damage."""
    work = tmp_path_factory.mktemp("finished")
    outcome = run_cli(TRAIN, train_on(parts2, work / "run", *CHECKPOINTED), work)
    assert outcome.code == 0, outcome.stderr
    return work / "run"


@pytest.fixture
def run_copy(finished_run, tmp_path) -> Path:
    return Path(shutil.copytree(finished_run, tmp_path / "run"))


# --- checkpoints -------------------------------------------------------------------------


def test_resume_skips_a_damaged_checkpoint_for_the_one_before(tmp_path, parts2, run_copy, finished_run):
    newest = checkpoint.checkpoint_dir(run_copy) / "checkpoint-000004.pt"
    flip_middle(newest)
    outcome = run_cli(TRAIN, train_on(parts2, run_copy, *CHECKPOINTED, "--epochs", "6", "--resume"), tmp_path)
    assert outcome.code == 0, outcome.stderr
    assert f"skipping {newest}: it fails its SHA-256 checksum" in outcome.stderr, outcome.stderr
    assert "resumed from epoch 2" in outcome.stderr, outcome.stderr
    records = epoch_records(run_copy)
    assert [r["epoch"] for r in records] == list(range(1, 7))
    assert all(math.isfinite(r["loss"]) for r in records)
    # epochs 3 and 4 done again from the good checkpoint: as the first time
    assert [r["loss"] for r in records[:4]] == [r["loss"] for r in epoch_records(finished_run)]


def test_resume_with_no_usable_checkpoint_stops_listing_them(tmp_path, parts2, run_copy):
    folder = checkpoint.checkpoint_dir(run_copy)
    flip_middle(folder / "checkpoint-000004.pt")
    (folder / "checkpoint-000002.pt").write_bytes(b"torn")
    before = snapshot(run_copy)
    outcome = run_cli(TRAIN, train_on(parts2, run_copy, *CHECKPOINTED, "--resume"), tmp_path)
    assert_user_error(
        outcome,
        f"--resume found no usable checkpoint in {folder}",
        "checkpoint-000004.pt (it fails its SHA-256 checksum",
        "checkpoint-000002.pt (it fails its SHA-256 checksum",
        "restore one",
        "pass a new --out",
    )
    assert_kept(before, run_copy)  # nothing deleted, nothing started over


def test_rotation_deletes_only_older_checkpoints_it_verified(tmp_path):
    save_legacy(tmp_path, 1)
    save(tmp_path, 2)
    save(tmp_path, 4)
    folder = checkpoint.checkpoint_dir(tmp_path)
    (folder / "checkpoint-000002.pt").write_bytes(b"torn")
    save(tmp_path, 6, keep=1)
    save(tmp_path, 8, keep=1)
    # 4 and 6 were good and older than the one kept; 2 is damaged and 1 has no checksum: left to the operator
    assert sorted(p.name for p in folder.iterdir()) == [
        "checkpoint-000001.pt",
        "checkpoint-000002.pt",
        "checkpoint-000002.pt.sha256",
        "checkpoint-000008.pt",
        "checkpoint-000008.pt.sha256",
    ]
    assert_verifies(folder / "checkpoint-000008.pt")


def test_a_checkpoint_with_a_damaged_part_is_skipped(tmp_path, bnsgcn_log):
    for epoch in (2, 4):
        for rank in (0, 1):
            checkpoint.save_part(tmp_path, epoch, rank, {"rows": torch.arange(1000.0) + rank})
        save(tmp_path, epoch)
    for epoch in (2, 4):
        for path in (
            checkpoint.part_path(tmp_path, epoch, 1),
            checkpoint.checkpoint_dir(tmp_path) / f"checkpoint-{epoch:06d}.pt",
        ):
            assert_verifies(path)
    damaged = checkpoint.part_path(tmp_path, 4, 1)
    flip_middle(damaged)
    path, state = checkpoint.newest(tmp_path, SIGNATURE, parts=2)
    assert state["epoch"] == 2
    newest = checkpoint.checkpoint_dir(tmp_path) / "checkpoint-000004.pt"
    assert [r.getMessage() for r in bnsgcn_log] == [
        f"skipping {newest}: its part {damaged.name} fails its SHA-256 checksum: the file is damaged"
    ]
    with pytest.raises(UserError, match=re.escape(f"{damaged} cannot be read (it fails its SHA-256 checksum")):
        checkpoint.load_part(tmp_path, 4, 1)


def test_a_checkpoint_without_a_checksum_loads_with_a_warning(tmp_path, bnsgcn_log):
    legacy = save_legacy(tmp_path, 2)
    path, state = checkpoint.newest(tmp_path, SIGNATURE)
    assert path == legacy and state["epoch"] == 2
    assert [r.getMessage() for r in bnsgcn_log] == [
        f"{legacy} has no checksum (written by an older bnsgcn): loading it unverified"
    ]


def test_a_checkpoint_that_does_not_fit_the_model_is_one_line(tmp_path, parts2, run_copy):
    path = checkpoint.checkpoint_dir(run_copy) / "checkpoint-000004.pt"
    state = torch.load(path, weights_only=True)
    name = next(k for k, v in state["model"].items() if v.dim() == 2)
    rows, columns = state["model"][name].shape
    state["model"][name] = torch.zeros(rows + 1, columns)
    checkpoint.save(run_copy, 4, {k: v for k, v in state.items() if k != "epoch"}, keep=2)
    outcome = run_cli(TRAIN, train_on(parts2, run_copy, *CHECKPOINTED, "--epochs", "6", "--resume"), tmp_path)
    assert_user_error(outcome, f"{path} does not fit this model (size mismatch for {name}", "pass a new --out")
