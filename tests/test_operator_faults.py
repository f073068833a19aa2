"""Faults an operator meets around a run directory: damaged checkpoints, a second run into
the same ``--out``, a full disk, links planted where temporary files go, and an ``--out``
whose name is not UTF-8.

* Every checkpoint and every rank's part has a SHA-256 checksum file next to it.
  ``--resume`` skips a checkpoint that fails it, naming it, for the one before; with
  checkpoints present but none usable it stops with one line listing them, and deletes
  nothing. Rotation deletes only older checkpoints it verified. A checkpoint without a
  checksum (an older bnsgcn's) loads with a warning. A checkpoint whose tensors do not fit
  the model is one line naming it.
* A run into an ``--out`` that holds an earlier run is refused, unless it resumes that run
  (``--resume``, also the one a restart implies) or is told to move it aside (``--force``:
  into ``<out>/previous-<n>/``, nothing mixed).
* A full disk at any file a run writes ends the run with one line naming that file; no
  temporary file is left, earlier files stay intact and ``metrics.jsonl`` holds whole lines.
  In-process, the write of that one file fails with ENOSPC (every byte of a run's files
  goes through ``os.write``, which the rank replaces); where mounting is permitted, a small
  tmpfs fills up for real.
* Temporary files get names of their own: a link planted at an old fixed temporary name
  is not followed.
* A run whose ``--out`` is not valid UTF-8 runs and writes its files.

Checks through ``bnsgcn-train`` (a subprocess) read its exit status and last stderr line;
in-process runs (:func:`tests.helpers.ranks.run_ranks`) read the rank's error.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import logging
import logging.handlers
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from bnsgcn.config import TrainConfig
from bnsgcn.errors import UserError
from bnsgcn.run import checkpoint

from .helpers.cli import TRAIN, assert_kept, assert_user_error, run_cli, snapshot, train_on
from .helpers.graphs import partition, random_graph
from .helpers.ranks import run_ranks

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


def in_process(parts: Path, run_dir: Path, **settings) -> TrainConfig:
    defaults = dict(layers=2, hidden=8, epochs=4, eval_every=1, checkpoint_every=2, device="cpu")
    return TrainConfig.from_settings(parts_dir=parts, out=run_dir, **(defaults | settings))


def disk_full_at(target: str, room: int) -> None:
    """In a rank: the disk holding the file named ``target`` (or a temporary file of it) is
    full once ``room`` bytes of it are written. ``os.write`` writes what fits, then fails
    with ENOSPC, as a write to a full disk does."""
    write = os.write
    names = re.compile(rf"{re.escape(target)}|\.{re.escape(target)}\.[0-9a-f]+\.tmp")
    left = room

    def write_until_full(fd: int, data) -> int:
        nonlocal left
        if not names.fullmatch(os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))):
            return write(fd, data)
        if left <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written = write(fd, memoryview(data).cast("B")[:left])
        left -= written
        return written

    os.write = write_until_full


# --- fixtures ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def parts2(tmp_path_factory) -> Path:
    return partition(random_graph(num_nodes=120, avg_degree=4, seed=1), 2, tmp_path_factory.mktemp("set") / "set-2")


@pytest.fixture(scope="module")
def parts1(tmp_path_factory) -> Path:
    return partition(random_graph(num_nodes=120, avg_degree=4, seed=1), 1, tmp_path_factory.mktemp("set") / "set-1")


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


# --- a second run into the same --out ----------------------------------------------------


def test_a_second_run_into_an_out_holding_a_run_is_refused(tmp_path, parts2):
    run_dir = tmp_path / "run"
    args = train_on(parts2, run_dir)  # no checkpoints
    assert run_cli(TRAIN, args, tmp_path).code == 0
    before = snapshot(run_dir)
    again = run_cli(TRAIN, args, tmp_path)
    assert_user_error(
        again,
        f"{run_dir} holds an earlier run (config.json, log.txt, metrics.jsonl, report.json, best_model.pt",
        f"pass --force to move it into {run_dir / 'previous-1'}",
        "or a new --out",
    )
    assert_kept(before, run_dir)
    # A restart (torchrun, a requeued SLURM job) resumes: it continues in place, from epoch 0 without a checkpoint.
    resumed = run_cli(TRAIN, [*args, "--resume"], tmp_path)
    assert resumed.code == 0, resumed.stderr
    assert [r["epoch"] for r in epoch_records(run_dir)] == [1, 2]


def test_force_moves_the_earlier_run_into_previous(tmp_path, parts2):
    run_dir = tmp_path / "run"
    args = train_on(parts2, run_dir, "--checkpoint-every", "2")
    assert run_cli(TRAIN, args, tmp_path).code == 0
    before = snapshot(run_dir)
    refused = run_cli(TRAIN, args, tmp_path)
    assert_user_error(
        refused,
        f"{run_dir} holds the checkpoints of an earlier run; pass --resume to continue it, --force to move it into "
        f"{run_dir / 'previous-1'}, or a new --out",
    )
    forced = run_cli(TRAIN, [*args, "--force"], tmp_path)
    assert forced.code == 0, forced.stderr
    assert snapshot(run_dir / "previous-1") == before  # the earlier run whole, as it was
    log = (run_dir / "log.txt").read_text()
    assert log.count("best val") == 1 and f"moved the earlier run into {run_dir / 'previous-1'}" in log, log
    assert [r["epoch"] for r in epoch_records(run_dir)] == [1, 2]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "checkpoint-000002.pt",
        "checkpoint-000002.pt.sha256",
    ]


# --- a full disk -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "room"),
    [
        ("checkpoints/checkpoint-000004.pt", 0),
        ("checkpoints/checkpoint-000004.pt.sha256", 0),
        ("metrics.jsonl", 1500),  # in the middle of the second line
        ("log.txt", 40),  # in the middle of the first line
        ("config.json", 100),
        ("report.json", 1000),
        ("best_model.pt", 0),
        ("memory.png", 0),
    ],
)
def test_a_full_disk_is_one_line_naming_the_file(tmp_path, parts1, target, room):
    if target.endswith(".png"):
        pytest.importorskip("matplotlib", reason="figures are drawn with matplotlib alone")
    run_dir = tmp_path / "run"
    instrument = functools.partial(disk_full_at, Path(target).name, room)
    with pytest.raises(AssertionError) as failed:
        run_ranks(1, [in_process(parts1, run_dir)], instrument=instrument)
    last = str(failed.value).strip().splitlines()[-1]
    assert last.startswith(
        f"bnsgcn.errors.UserError: cannot write {run_dir / target}: the disk is full (No space left on device)"
    ), failed.value
    assert not [p for p in run_dir.rglob("*") if p.name.endswith(".tmp")]
    for name in ("metrics.jsonl", "log.txt"):  # whole lines or none
        text = (run_dir / name).read_text() if (run_dir / name).exists() else ""
        assert text == "" or text.endswith("\n"), (name, text[-200:])
    for line in (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []:
        json.loads(line)
    for written in (run_dir / "checkpoints").glob("checkpoint-*.pt"):
        assert_verifies(written)
    if "checkpoint" in target:
        assert not (run_dir / "checkpoints" / "checkpoint-000004.pt").exists()  # never without its checksum


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of 8 MiB mounted for the test (skipped where mounting is not permitted)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = exc.stderr.decode().strip() if isinstance(exc, subprocess.CalledProcessError) else exc
        pytest.skip(f"mounting a tmpfs is not permitted here ({detail}); the in-process tests simulate a full disk")
    yield disk
    subprocess.run(["umount", "--lazy", str(disk)], check=True)


def test_a_full_disk_at_a_checkpoint_on_a_real_file_system(tmp_path, parts2, small_disk):
    run_dir = small_disk / "run"
    big = ["--layers", "3", "--hidden", "192"]  # checkpoints of about 1 MiB
    args = train_on(parts2, run_dir, *big, "--checkpoint-every", "2")
    assert run_cli(TRAIN, args, tmp_path).code == 0
    stat = os.statvfs(small_disk)
    room = 256 * 1024  # for log and metrics lines, not for a checkpoint
    with open(small_disk / "filler", "wb") as filler:
        filler.write(b"\0" * (stat.f_bavail * stat.f_frsize - room))
    outcome = run_cli(TRAIN, [*args, "--epochs", "4", "--resume"], tmp_path)
    path = run_dir / "checkpoints" / "checkpoint-000004.pt"
    assert_user_error(outcome, f"cannot write {path}: the disk is full (No space left on device)")
    assert not [p for p in run_dir.rglob("*") if p.name.endswith(".tmp")]
    assert not path.exists()
    assert_verifies(run_dir / "checkpoints" / "checkpoint-000002.pt")
    assert [r["epoch"] for r in epoch_records(run_dir)] == [1, 2, 3, 4]


# --- temporary files ---------------------------------------------------------------------


def test_temporary_files_do_not_follow_links_planted_at_their_old_names(tmp_path, parts1):
    run_dir, victim = tmp_path / "run", tmp_path / "victim"
    victim.write_text("not to be written\n")
    (run_dir / "checkpoints").mkdir(parents=True)
    planted = [
        run_dir / ".write-test",
        run_dir / "checkpoints" / ".write-test",
        run_dir / "checkpoints" / "checkpoint-000002.pt.tmp",
        run_dir / "metrics.jsonl.tmp",
        run_dir / "report.json.tmp",
        run_dir / "memory.png.tmp",
    ]
    for link in planted:
        link.symlink_to(victim)
    run_ranks(1, [in_process(parts1, run_dir, epochs=2)])
    assert victim.read_text() == "not to be written\n"
    assert all(link.is_symlink() and link.readlink() == victim for link in planted)
    assert not (run_dir / "checkpoints" / "checkpoint-000002.pt").is_symlink()
    assert_verifies(run_dir / "checkpoints" / "checkpoint-000002.pt")


# --- an --out that is not UTF-8 ----------------------------------------------------------


def test_an_out_whose_name_is_not_utf8(tmp_path, parts2):
    run_dir = tmp_path / os.fsdecode(b"run-\xff")
    outcome = run_cli(TRAIN, train_on(parts2, run_dir), tmp_path)
    assert outcome.code == 0, outcome.stderr
    assert "Logging error" not in outcome.stderr and "Traceback" not in outcome.stderr, outcome.stderr
    log = (run_dir / "log.txt").read_bytes().decode("utf-8").splitlines()
    assert log[-1].endswith(f"run directory {tmp_path}/run-\\udcff"), log
    assert json.loads((run_dir / "config.json").read_text())["out"] == str(run_dir)
    assert [r["epoch"] for r in epoch_records(run_dir)] == [1, 2]
    assert (run_dir / "report.json").is_file() and (run_dir / "best_model.pt").is_file()
