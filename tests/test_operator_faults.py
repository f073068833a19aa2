"""The faults an operator meets, each reproduced as it happens: the one line that ends the
run, its exit status and what it leaves behind. Three parts, each with its own fixtures.

**Run files** (``--out``, checkpoints, the disk):

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

**A running job:** a stopped rank (rank 0, which holds the job's store, included) ends the
job within twice ``--timeout`` naming it; the store listens on loopback and a stranger
cannot plant the job's error; a run gone non-finite stops naming the epoch and rank and
keeps the earlier checkpoints; end-of-run work longer than ``--timeout`` does not fail a
finished run.

**Partition sets** (damaged, mixed up or malformed, and faults while writing one):

* a set's identity: every ``part-k/partition.json`` and the manifest carry the set id; a
  partition (or manifest entry) taken from another set, reordered entries and swapped
  directories are refused by the launcher and by the rank, naming the file;
* offsets and indices: offsets that do not start at 0, decrease, end elsewhere than the
  array they index, give a partition its own nodes or disagree with the per-owner counts
  the manifest records; node ids and send indices out of range (always checked); repeated
  nodes, missing self-loops and degrees that disagree with the adjacency (``--verify``);
* degrees that are 0, negative, NaN or infinite;
* malformed manifest values (wrong types, short or null lists), at the launcher and in ranks;
* partition directories outside the set (``..``, absolute, a symbolic link out of it);
* sets written before the id existed, which still load;
* temporary files and directories that never follow a symbolic link planted at their name;
* a class count far above the distinct labels, refused unless ``--num-classes`` says so;
* a full disk while writing a set: one line naming the file, nothing left behind.

Checks through ``bnsgcn-train`` or ``bnsgcn-partition`` (a subprocess) read the exit status
and the last stderr line; in-process runs (:func:`tests.helpers.ranks.run_ranks`) read the
rank's error; the partition set's loaders (``load_shard``, the launcher's
``choose_partition_set``) are mostly called in-process.
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
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from bnsgcn.config import TrainConfig
from bnsgcn.data.format import (
    MANIFEST_NAME,
    PART_ARRAYS,
    PART_META_NAME,
    read_manifest,
    set_id,
    sha256_file,
    write_array,
    write_manifest,
    write_part_meta,
)
from bnsgcn.data.shard import load_shard
from bnsgcn.errors import UserError
from bnsgcn.launch.discover import choose_partition_set
from bnsgcn.partition import cli as partition_cli
from bnsgcn.partition.datasets import CLASS_COUNT_FLOOR, with_class_count
from bnsgcn.partition.graph import Graph
from bnsgcn.run import checkpoint

from .helpers.cli import PARTITION, SMALL_RUN, TRAIN, assert_kept, assert_user_error, run_cli, snapshot, train_on
from .helpers.faults import (
    START_S,
    assert_all_gone,
    descendants,
    kill_job,
    last_epoch,
    rank_process,
    run_with_rank_hung,
    start,
    stderr_of,
    train_args,
    wait_for,
)
from .helpers.graphs import partition, random_graph, write_npz
from .helpers.partition_sets import edit_array
from .helpers.ranks import run_ranks

# === Run files: checkpoints, --out, a full disk, planted links, names =============================================

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


# === A running job: stopped ranks, the store, non-finite values, end-of-run work ==================================

WORLD = 2


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> Path:
    return partition(random_graph(num_nodes=120, avg_degree=5, seed=8), WORLD, tmp_path_factory.mktemp("job") / "parts")


@pytest.mark.parametrize("stopped", [0, 1])
def test_a_stopped_rank_ends_the_job_within_twice_the_timeout_naming_it(tmp_path, parts, stopped):
    """SIGSTOP one rank after the first epoch: alive, silent, and, for rank 0, holding the
    job's store. The other rank's collective times out, it asks the store who stopped (a
    store that does not answer is the stopped rank 0's) and the job ends naming the rank."""
    timeout_s = 8
    run_dir = tmp_path / "run"
    args = train_args(parts, run_dir, "--epochs", "100000", "--checkpoint-every", "0", "--timeout", str(timeout_s))
    job, processes, elapsed = run_with_rank_hung(tmp_path, args, timeout_s, rank=stopped)
    assert elapsed < 2 * timeout_s, f"the job took {elapsed:.1f} s to end after rank {stopped} stopped"
    assert job.returncode == 4
    last_line = stderr_of(tmp_path, "job").strip().splitlines()[-1]
    other = 1 - stopped
    named = "rank 0 stopped (it holds the job's store, which does not answer)" if stopped == 0 else "rank 1 stopped at"
    assert re.match(rf"^error: rank {other} failed \(exit code 4\): .*{re.escape(named)}", last_line), last_line
    assert "Traceback" not in stderr_of(tmp_path, "job")
    assert_all_gone(processes, run_dir)


def test_the_store_listens_on_loopback_and_a_stranger_cannot_plant_the_jobs_error(tmp_path, parts):
    """A job on one machine: every socket its ranks listen on is on the loopback interface,
    and its keys are under a secret: a value a stranger writes where the job's first failure
    would be, without the secret, is never shown as the job's error."""
    import torch.distributed as dist

    run_dir = tmp_path / "run"
    args = train_args(parts, run_dir, "--epochs", "100000", "--checkpoint-every", "0", "--timeout", "20")
    job = start([*TRAIN, *args], tmp_path, "job")
    try:
        wait_for(lambda: last_epoch(run_dir) >= 1, job, START_S, "first epoch in metrics.jsonl")
        processes = descendants(job.pid)
        ranks = [p for p in processes if "bnsgcn.launch.rank" in " ".join(p.cmdline())]
        listening = [
            (c.laddr.ip, c.laddr.port)
            for p in ranks
            for c in p.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        ]
        assert listening and all(ip in ("127.0.0.1", "::1") for ip, _ in listening), listening
        port = int(rank_process(processes, 0).environ()["MASTER_PORT"])
        stranger = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=10))
        for key in ("bnsgcn/attempt-0/first-failure", "first-failure"):
            stranger.set(key, "rank 7 failed first: planted by a stranger")
        assert not stranger.check(["bnsgcn/attempt-0/progress/0"])  # the job's keys are not where a guess looks
        rank_process(processes, 1).kill()
        job.wait(60)
    finally:
        kill_job(job)
    job_stderr = stderr_of(tmp_path, "job")
    assert "planted" not in job_stderr
    assert job_stderr.strip().splitlines()[-1].startswith("error: rank 1 failed (killed by SIGKILL)")


def _config(parts: Path, out: Path, **settings) -> TrainConfig:
    base = dict(parts_dir=parts, model="graphsage", layers=2, hidden=8, epochs=4, eval_every=1, seed=1, device="cpu")
    return TrainConfig.from_settings(**(base | settings), out=out)


def poison_rank_one_loss_at_epoch_two():
    """In a rank: rank 1's loss of its second epoch is NaN."""
    import os

    import bnsgcn.run.train as train

    real, calls = train._loss_sum, []

    def loss_sum(*args):
        calls.append(None)
        value = real(*args)
        return value * float("nan") if os.environ["RANK"] == "1" and len(calls) == 2 else value

    train._loss_sum = loss_sum
    return lambda: None


def poison_rank_one_gradient_at_epoch_two():
    """In a rank: one entry of rank 1's gradients of its second epoch is infinite, its loss
    finite."""
    import os

    import bnsgcn.run.train as train

    real, calls = train._grad_norm, []

    def grad_norm(model):
        calls.append(None)
        if os.environ["RANK"] == "1" and len(calls) == 2:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        return real(model)

    train._grad_norm = grad_norm
    return lambda: None


@pytest.mark.parametrize(
    ("poison", "what"),
    [(poison_rank_one_loss_at_epoch_two, "loss sum nan"), (poison_rank_one_gradient_at_epoch_two, "gradient norm inf")],
)
def test_a_run_gone_non_finite_stops_naming_the_epoch_and_rank_and_keeps_earlier_checkpoints(
    tmp_path, parts, poison, what
):
    config = _config(parts, tmp_path / "run", checkpoint_every=1)
    with pytest.raises(AssertionError) as failed:
        run_ranks(WORLD, [config], instrument=poison)
    assert re.search(
        rf"UserError: epoch 2: training went non-finite on (rank 0 [^;]*, )?rank 1 \([^)]*{what}", str(failed.value)
    )
    checkpoints = sorted(p.name for p in (config.run.out / "checkpoints").iterdir())
    assert checkpoints == [
        "checkpoint-000001.pt",
        "checkpoint-000001.pt.sha256",
    ]  # the last good epoch's; nothing of epoch 2
    assert not (config.run.out / "best_model.pt").exists()
    epochs = [line for line in (config.run.out / "metrics.jsonl").read_text().splitlines() if '"epoch"' in line]
    assert len(epochs) == 1


def slow_figures():
    """In a rank: drawing the report's figures takes longer than the job's --timeout."""
    import bnsgcn.metrics.report as report

    real = report.write_figures

    def write_figures(*args, **kwargs):
        time.sleep(SLOW_FIGURES_S)
        return real(*args, **kwargs)

    report.write_figures = write_figures
    return lambda: None


SLOW_FIGURES_S = 6


def test_end_of_run_work_longer_than_the_timeout_does_not_fail_a_finished_run(tmp_path, parts):
    """Rank 0 draws the report's figures after the ranks have parted: the others do not wait
    for it in a barrier bounded by --timeout."""
    config = _config(parts, tmp_path / "run", epochs=2, timeout=SLOW_FIGURES_S / 2)
    results = run_ranks(WORLD, [config], instrument=slow_figures)
    assert [rank[0]["epochs"] for rank in results] == [2, 2]
    assert (config.run.out / "report.json").exists() and (config.run.out / "best_model.pt").exists()


# === Partition sets: damaged, mixed up or malformed sets, and faults while writing one ============================

# --- sets to damage ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def originals(tmp_path_factory) -> dict[str, Path]:
    """Sets of one graph: two of 2 parts (random assignment, seeds 0 and 1: equal part sizes,
    different boundaries) and one of 3 parts."""
    graph = random_graph(num_nodes=120, avg_degree=4, seed=1)
    root = tmp_path_factory.mktemp("originals")
    return {
        "two": partition(graph, 2, root / "two"),
        "other-two": partition(graph, 2, root / "other-two", seed=1),
        "three": partition(graph, 3, root / "three"),
    }


@pytest.fixture
def sets(originals: dict[str, Path], tmp_path: Path) -> dict[str, Path]:
    """Private copies of the original sets, to damage."""
    return {name: Path(shutil.copytree(path, tmp_path / "parts" / name)) for name, path in originals.items()}


def edit_manifest(parts_dir: Path, edit) -> None:
    path = parts_dir / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest, indent=1))


def reseal(parts_dir: Path) -> None:
    """Record the files as they are now: sizes, checksums and a new set id in the manifest
    and every partition.json, as a tool writing a set with these contents would. Only the
    checks of values can then find what is wrong."""
    manifest = read_manifest(parts_dir)
    for entry in manifest["partitions"]:
        for name in PART_ARRAYS:
            path = parts_dir / entry["dir"] / f"{name}.npy"
            entry["files"][name] |= {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    manifest["set_id"] = set_id(manifest)
    for k, entry in enumerate(manifest["partitions"]):
        write_part_meta(parts_dir / entry["dir"], manifest["set_id"], k, manifest["parts"])
    write_manifest(parts_dir, {key: value for key, value in manifest.items() if key not in ("format", "version")})


def strip_identity(parts_dir: Path) -> None:
    """Make the set look like one written before set ids: no set_id, boundary_counts or partition.json."""

    def edit(manifest: dict) -> None:
        del manifest["set_id"]
        for entry in manifest["partitions"]:
            del entry["boundary_counts"]

    edit_manifest(parts_dir, edit)
    for meta in parts_dir.glob(f"part-*/{PART_META_NAME}"):
        meta.unlink()


def refused(parts_dir: Path, part: int, pattern: str, verify: bool = False) -> None:
    """Loading ``part`` raises one UserError matching ``pattern``."""
    with pytest.raises(UserError, match=pattern) as caught:
        load_shard(parts_dir, part, None, verify=verify)
    assert "\n" not in str(caught.value)


def train(parts_dir: Path, cwd: Path) -> list[str]:
    return ["--procs", "2", "--parts-dir", str(parts_dir), "--out", str(cwd / "run"), *SMALL_RUN]


# --- a partition set's identity -------------------------------------------------------------


def test_sets_carry_their_id_in_the_manifest_and_every_partition(originals):
    manifest = read_manifest(originals["two"])
    assert manifest["set_id"] == set_id(manifest)
    for k in range(2):
        meta = json.loads((originals["two"] / f"part-{k}" / PART_META_NAME).read_text())
        assert (meta["set_id"], meta["part"], meta["parts"]) == (manifest["set_id"], k, 2)
    assert read_manifest(originals["other-two"])["set_id"] != manifest["set_id"]


def test_partition_taken_from_another_set_is_refused(sets, tmp_path):
    # The whole directory copied over: the launcher refuses before any rank starts.
    base, other = sets["two"], sets["other-two"]
    shutil.rmtree(base / "part-1")
    shutil.copytree(other / "part-1", base / "part-1")
    meta = base / "part-1" / PART_META_NAME
    with pytest.raises(UserError, match=re.escape(f"{meta} belongs to partition set")):
        choose_partition_set(base, 2)
    refused(base, 1, re.escape(str(meta)) + ".*taken from another set")
    outcome = run_cli(TRAIN, train(base, tmp_path), tmp_path)
    assert_user_error(outcome, str(meta), "belongs to partition set", "copy whole partition sets only")
    assert not (tmp_path / "run").exists()


def test_partition_and_its_manifest_entry_from_another_set_are_refused(sets, tmp_path):
    # Directory and manifest entry copied: every size matches the entry, so without the id only the
    # ranks' exchanges would notice (gloo aborts on their mismatched sizes).
    base, other = sets["two"], sets["other-two"]
    shutil.rmtree(base / "part-1")
    shutil.copytree(other / "part-1", base / "part-1")
    entry = read_manifest(other)["partitions"][1]
    edit_manifest(base, lambda manifest: manifest["partitions"].__setitem__(1, entry))
    outcome = run_cli(TRAIN, train(base, tmp_path), tmp_path)
    assert_user_error(outcome, str(base / "part-1" / PART_META_NAME), "belongs to partition set")
    # A rank, which does not read the other partitions' metadata, finds the manifest inconsistent.
    refused(base, 0, re.escape(f"{base / MANIFEST_NAME}: the partitions' checksums do not give the set id"))


def test_reordered_manifest_entries_are_refused(sets):
    base = sets["two"]
    edit_manifest(base, lambda manifest: manifest["partitions"].reverse())
    pattern = re.escape(f"{base / MANIFEST_NAME}: partitions[0].boundary_counts has ") + ".*own partition.*reordered"
    with pytest.raises(UserError, match=pattern):
        choose_partition_set(base, 2)
    refused(base, 0, pattern)


def test_swapped_partition_directories_are_refused(sets):
    # Only the "dir" fields swapped: the checksums are in order, the directories are not.
    base = sets["two"]

    def swap(manifest: dict) -> None:
        first, second = manifest["partitions"]
        first["dir"], second["dir"] = second["dir"], first["dir"]

    edit_manifest(base, swap)
    pattern = re.escape(f"{base / 'part-1' / PART_META_NAME} is partition 1 of its set") + ".*lists it as partition 0"
    with pytest.raises(UserError, match=pattern):
        choose_partition_set(base, 2)
    refused(base, 0, pattern)


def test_set_written_before_ids_still_loads(sets):
    base = sets["three"]
    strip_identity(base)
    assert choose_partition_set(base, 3).parts == 3
    for k in range(3):
        load_shard(base, k, 3, verify=True)


def test_reordered_entries_of_a_set_without_id_are_refused_by_the_offsets(sets):
    base = sets["two"]
    strip_identity(base)
    edit_manifest(base, lambda manifest: manifest["partitions"].reverse())
    refused(base, 0, re.escape(str(base / "part-1" / "boundary_offsets.npy")) + ".*partition 0, the partition itself")


# --- offsets and indices ---------------------------------------------------------------------


def shift(offsets: np.ndarray, at: int, by: int) -> None:
    offsets[at] += by


@pytest.mark.parametrize(
    "name, edit, problem",
    [
        ("boundary_offsets", lambda o: shift(o, 0, 1), "starts at 1, not 0"),
        ("boundary_offsets", lambda o: shift(o, 2, 1000), "decreases at partition 2"),
        ("boundary_offsets", lambda o: shift(o, 3, -1), "ends at"),
        (
            "boundary_offsets",
            lambda o: shift(o, 1, 1),
            "has 1 boundary nodes owned by partition 0, the partition itself",
        ),
        # monotone and within bounds, but not what partition 2's owners send: only the counts say so
        ("boundary_offsets", lambda o: shift(o, 2, -1), "owned by partition 1, where the manifest records"),
        ("send_offsets", lambda o: shift(o, 2, -1), "rows to partition 1, where the manifest records"),
        ("send_offsets", lambda o: shift(o, 3, 1), "ends at"),
    ],
    ids=["start", "decreasing", "end", "own-nodes", "boundary-counts", "send-counts", "send-end"],
)
def test_edited_offsets_are_refused(sets, name, edit, problem):
    base = sets["three"]
    path = base / "part-0" / f"{name}.npy"
    edit_array(path, edit)
    refused(base, 0, re.escape(f"{path} ") + ".*" + re.escape(problem) + ".*edited or damaged")


def test_edited_offsets_end_in_one_line_not_a_gloo_traceback(sets, tmp_path):
    base = sets["two"]
    path = base / "part-1" / "send_offsets.npy"
    edit_array(path, lambda offsets: shift(offsets, 1, -1))  # a row of partition 0's moved to partition 1 itself
    outcome = run_cli(TRAIN, train(base, tmp_path), tmp_path)
    assert_user_error(outcome, "rank 1 failed (exit code 2)", f"[rank 1] {path} sends 1 rows to partition 1", "edited")


@pytest.mark.parametrize(
    "name, value, within",
    [
        ("send_nodes", lambda n_inner, n: n_inner, "outside the partition's"),
        ("send_nodes", lambda n_inner, n: -1, "outside the partition's"),
        ("inner_nodes", lambda n_inner, n: n, "outside the dataset's 120 nodes"),
        ("boundary_nodes", lambda n_inner, n: -3, "outside the dataset's 120 nodes"),
    ],
    ids=["send-high", "send-negative", "inner", "boundary"],
)
def test_node_ids_out_of_range_are_refused(sets, name, value, within):
    base = sets["two"]
    path = base / "part-0" / f"{name}.npy"
    n_inner = np.load(base / "part-0" / "inner_nodes.npy").shape[0]
    edit_array(path, lambda ids: ids.__setitem__(0, value(n_inner, 120)))
    refused(base, 0, re.escape(f"{path} holds ") + ".*" + re.escape(within))


def repeat_first(ids: np.ndarray) -> None:
    ids[1] = ids[0]


def drop_first_self_loop(indices: np.ndarray) -> None:
    indices[indices == 0] = 1  # row 0 lists column 1 instead of itself (both inner columns)


@pytest.mark.parametrize(
    "name, edit, problem",
    [
        ("boundary_nodes", repeat_first, "and boundary_nodes.npy list node"),
        ("send_nodes", repeat_first, "twice to partition 1"),
        ("adj_indices", drop_first_self_loop, "has no self-loop in the row of node"),
        ("degree", lambda degree: degree.__setitem__(0, degree[0] + 1), "but its adjacency row holds"),
    ],
    ids=["repeated-node", "repeated-send", "self-loop", "degree-vs-row"],
)
def test_full_checks_come_with_verify(sets, name, edit, problem):
    # Sealed with matching checksums, as a set written by a faulty tool would be.
    base = sets["two"]
    path = base / "part-0" / f"{name}.npy"
    edit_array(path, edit)
    reseal(base)
    load_shard(base, 0, 2)  # not a cheap check
    file = "inner_nodes" if name == "boundary_nodes" else name
    refused(base, 0, re.escape(str(base / "part-0" / f"{file}.npy")) + ".*" + re.escape(problem), verify=True)


# --- degrees -----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0.0, -2.0, np.nan, np.inf], ids=["zero", "negative", "nan", "inf"])
def test_bad_degree_is_refused(sets, bad):
    base = sets["two"]
    path = base / "part-1" / "degree.npy"
    node = int(np.load(base / "part-1" / "inner_nodes.npy")[3])
    edit_array(path, lambda degree: degree.__setitem__(3, bad))
    refused(
        base,
        1,
        re.escape(f"{path} holds degree {np.float32(bad)} for node {node} (local column 3)")
        + ".*finite number >= 1.*re-run bnsgcn-partition --force",
    )


# --- malformed manifests -------------------------------------------------------------------------


def set_field(*keys_and_value):
    *keys, value = keys_and_value

    def edit(manifest: dict) -> None:
        target = manifest
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value

    return edit


@pytest.mark.parametrize(
    "edit, field",
    [
        (set_field("parts", "two"), "parts is 'two', expected an integer >= 1"),
        (set_field("parts", 0), "parts is 0, expected an integer >= 1"),
        (set_field("partitions", None), "partitions is missing or null, expected a list of 2 entries"),
        (lambda m: m["partitions"].pop(), "partitions is a list of 1, expected a list of 2 entries"),
        (set_field("partitions", 1, "not an entry"), "partitions[1] is 'not an entry', expected an object"),
        (set_field("partitions", 0, "n_inner", "60"), "partitions[0].n_inner is '60', expected an integer >= 0"),
        (set_field("partitions", 1, "files", "degree", "bytes", None), "partitions[1].files.degree.bytes is missing"),
        (set_field("partitions", 1, "files", "labels", "shape", [1e3]), "partitions[1].files.labels.shape is a list"),
        (set_field("partitions", 0, "boundary_counts", [0]), "partitions[0].boundary_counts is a list of 1"),
        (set_field("dataset", "num_classes", "seven"), "dataset.num_classes is 'seven', expected an integer >= 1"),
        (set_field("dataset", None), "dataset is missing or null, expected an object"),
        (set_field("set_id", 7), "set_id is 7, expected a string"),
    ],
    ids=[
        "parts-string",
        "parts-zero",
        "partitions-null",
        "partitions-short",
        "entry-string",
        "count-string",
        "bytes-null",
        "shape-float",
        "counts-short",
        "classes-string",
        "dataset-null",
        "id-number",
    ],
)
def test_malformed_manifest_values_are_refused(sets, edit, field):
    base = sets["two"]
    edit_manifest(base, edit)
    pattern = re.escape(f"{base / MANIFEST_NAME}: {field}") + ".*re-run bnsgcn-partition --force"
    with pytest.raises(UserError, match=pattern):
        choose_partition_set(base, 2)
    refused(base, 0, pattern)


def test_malformed_manifest_is_one_line_at_the_launcher(sets, tmp_path):
    base = sets["two"]
    edit_manifest(base, set_field("parts", "two"))
    outcome = run_cli(TRAIN, train(base, tmp_path), tmp_path)
    assert_user_error(outcome, f"{base / MANIFEST_NAME}: parts is 'two', expected an integer >= 1")


def test_shapes_must_agree_with_the_recorded_counts(sets):
    base = sets["two"]
    edit_manifest(base, set_field("partitions", 0, "n_inner", 7))
    with pytest.raises(UserError, match=re.escape("partitions[0].files.inner_nodes.shape is [")):
        choose_partition_set(base, 2)


# --- partition directories outside the set -----------------------------------------------------------


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_partition_directory_outside_the_set_is_refused(sets, tmp_path, how):
    base = sets["two"]
    outside = tmp_path / "elsewhere" / "part-1"
    outside.parent.mkdir()
    shutil.move(base / "part-1", outside)  # a complete partition, only not inside the set
    if how == "symlink":
        (base / "part-1").symlink_to(outside, target_is_directory=True)
        pattern = re.escape(f"partitions[1].dir 'part-1' leads out of the set, to {outside}")
    else:
        target = "../../elsewhere/part-1" if how == "dotdot" else str(outside)
        edit_manifest(base, set_field("partitions", 1, "dir", target))
        pattern = re.escape(f"partitions[1].dir is {target!r}, which is not inside the set")
    pattern = re.escape(f"{base / MANIFEST_NAME}: ") + pattern
    with pytest.raises(UserError, match=pattern):
        choose_partition_set(base, 2)
    refused(base, 1, pattern)


def test_symbolic_link_inside_the_set_is_followed(sets):
    base = sets["two"]
    (base / "data").mkdir()
    shutil.move(base / "part-1", base / "data" / "part-1")
    (base / "part-1").symlink_to(Path("data") / "part-1", target_is_directory=True)
    load_shard(base, 1, 2, verify=True)


# --- temporary files ------------------------------------------------------------------------------


def test_manifest_is_not_written_through_a_planted_symbolic_link(sets, tmp_path):
    base = sets["two"]
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    (base / (MANIFEST_NAME + ".tmp")).symlink_to(victim)  # a fixed, guessable temporary name
    manifest = read_manifest(base)
    write_manifest(base, {key: value for key, value in manifest.items() if key not in ("format", "version")})
    assert victim.read_text() == "keep me\n"
    assert read_manifest(base) == manifest
    assert sorted(p.name for p in base.iterdir() if p.is_file()) == [MANIFEST_NAME, MANIFEST_NAME + ".tmp"]


def test_array_is_not_written_through_a_planted_symbolic_link(tmp_path):
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"keep me")
    part_dir = tmp_path / "part-0"
    part_dir.mkdir()
    (part_dir / "features.npy").symlink_to(victim)
    features = np.arange(12, dtype=np.float32).reshape(4, 3)
    write_array(part_dir, "features", features)
    assert victim.read_bytes() == b"keep me"
    assert not (part_dir / "features.npy").is_symlink()
    assert np.array_equal(np.load(part_dir / "features.npy"), features)
    assert [p.name for p in part_dir.iterdir()] == ["features.npy"]


def test_temporary_directory_is_not_a_planted_symbolic_link(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    out = tmp_path / "set"
    # the guessable part of the temporary directory's name
    (tmp_path / f"set.tmp-{socket.gethostname()}-{os.getpid()}").symlink_to(victim, target_is_directory=True)
    partition(random_graph(num_nodes=40, seed=3), 2, out)
    assert list(victim.iterdir()) == []
    assert out.is_dir() and not out.is_symlink()
    load_shard(out, 0, 2, verify=True)


def test_streamed_graph_is_not_written_through_a_planted_symbolic_link(tmp_path):
    from bnsgcn.partition.datasets import Progress
    from bnsgcn.partition.datasets.csr import write_synthetic_csr
    from bnsgcn.partition.datasets.synthetic import parse_synthetic_spec

    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / "graph.tmp").symlink_to(victim, target_is_directory=True)  # the name it once wrote into
    write_synthetic_csr(parse_synthetic_spec("nodes=200,degree=4"), tmp_path / "graph", Progress("csr", False))
    assert list(victim.iterdir()) == []
    assert (tmp_path / "graph").is_dir() and not (tmp_path / "graph").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["graph", "graph.tmp", "victim"]  # no scratch left


def test_failed_array_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError, match=re.escape(str(tmp_path / "degree.npy"))) as caught:
        write_array(tmp_path, "degree", np.ones(10, dtype=np.float32))
    monkeypatch.undo()
    assert caught.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


# --- class counts --------------------------------------------------------------------------------------


def labelled(labels: list[int], num_classes: int | None = None) -> Graph:
    graph = random_graph(num_nodes=len(labels), seed=4)
    graph.labels = np.asarray(labels, dtype=np.int64)
    graph.num_classes = num_classes if num_classes is not None else int(max(labels)) + 1
    return graph


def test_class_count_far_above_the_labels_is_refused():
    floor = CLASS_COUNT_FLOOR
    assert with_class_count(labelled([0, floor - 1] * 10), None, "g").num_classes == floor  # at the floor
    assert with_class_count(labelled(list(range(17)) + [floor]), None, "g").num_classes == floor + 1  # 2 x 18 >= 33
    with pytest.raises(UserError, match=re.escape(f"g: {floor + 1} classes but only 16 distinct labels")):
        with_class_count(labelled(list(range(15)) + [floor] * 5), None, "g")
    with pytest.raises(UserError, match="100 classes but only 3 distinct labels"):
        with_class_count(labelled([0, 1, 2] * 5, num_classes=100), None, "g")  # declared by the dataset
    assert with_class_count(labelled([0, 1, 2, 99]), 100, "g").num_classes == 100
    with pytest.raises(UserError, match=re.escape("g: label 99 of node 3 is outside [0, 50)")):
        with_class_count(labelled([0, 1, 2, 99]), 50, "g")


def test_stray_label_is_refused_unless_num_classes_says_so(tmp_path):
    labels = random_graph(num_nodes=40, avg_degree=4, seed=2).labels.copy()
    labels[9] = 10_000_000
    data = write_npz(tmp_path / "stray.npz", labels=labels)
    out = tmp_path / "parts" / "stray-2"
    outcome = run_cli(PARTITION, [f"npz:{data}", "--parts", "2", "--out", str(out)], tmp_path)
    assert_user_error(
        outcome,
        "10,000,001 classes but only 4 distinct labels (the largest 10,000,000)",
        "likely stray label",
        "--num-classes 10000001",
    )
    assert not out.exists()
    given = ["--num-classes", "10000001"]
    outcome = run_cli(PARTITION, [f"npz:{data}", "--parts", "2", "--out", str(out), *given], tmp_path)
    assert outcome.code == 0, outcome.stderr
    dataset = read_manifest(out)["dataset"]
    assert (dataset["num_classes"], dataset["num_classes_given"]) == (10_000_001, 10_000_001)
    # Reuse is per class count: the same count reuses, another one is another set.
    outcome = run_cli(PARTITION, [f"npz:{data}", "--parts", "2", "--out", str(out), *given], tmp_path)
    assert outcome.code == 0 and "reusing the partition set" in outcome.stdout
    outcome = run_cli(
        PARTITION, [f"npz:{data}", "--parts", "2", "--out", str(out), "--num-classes", "20000000"], tmp_path
    )
    assert_user_error(outcome, "holds a different partition set")


# --- a full disk ------------------------------------------------------------------------------------------


def fill_disk_after(monkeypatch, directory: Path, free_bytes: int, code: int) -> None:
    """``os.write`` to files under ``directory`` fails with ``code`` once ``free_bytes`` are written."""
    real_write = os.write
    left = [free_bytes]

    def write(fd: int, data) -> int:
        if not os.readlink(f"/proc/self/fd/{fd}").startswith(str(directory)):
            return real_write(fd, data)
        if left[0] <= 0:
            raise OSError(code, os.strerror(code))
        count = real_write(fd, memoryview(data)[: left[0]])
        left[0] -= count
        return count

    monkeypatch.setattr(os, "write", write)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT], ids=["ENOSPC", "EDQUOT"])
def test_full_disk_names_the_file_and_leaves_nothing(tmp_path, monkeypatch, capsys, code):
    out = tmp_path / "parts" / "set"
    args = ["synthetic:nodes=400", "--parts", "2", "--out", str(out), "--node-order", "ids"]
    assert partition_cli.main(args) == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    fill_disk_after(monkeypatch, tmp_path, 5_000, code)
    assert partition_cli.main([*args, "--seed", "1", "--force"]) == 2
    monkeypatch.undo()
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(
        re.escape(f"error: {out}/part-")
        + r"\d/\w+\.npy"
        + re.escape(
            f": the disk is full ({os.strerror(code)}); free space there or choose an --out on another file system"
        )
        + re.escape(" (no partition set was written)"),
        line,
    ), line
    assert sorted(p.name for p in out.parent.iterdir()) == ["set"]  # no temporary directory left
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # the old set untouched


def test_full_disk_on_a_small_file_system(tmp_path):
    # A real ENOSPC: a 256 KiB tmpfs mounted in a private mount namespace (needs user namespaces).
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) to mount a tmpfs in a user namespace")
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs",
         str(mount_point)],
        capture_output=True,
    )  # fmt: skip
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here ({probe.stderr.decode().strip()})")
    out = mount_point / "set"
    script = (
        f"mount -t tmpfs -o size=256k tmpfs {mount_point} && "
        f"{sys.executable} -m bnsgcn.partition.cli synthetic:nodes=3000 --parts 2 --node-order ids --out {out}; "
        f"status=$?; ls -A {mount_point}; exit $status"
    )
    done = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {out}/") and ": the disk is full (No space left on device)" in last, last
    assert done.stdout.strip() == ""  # nothing left on the small file system
