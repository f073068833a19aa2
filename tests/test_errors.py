"""The bad-input catalogue of docs/errors.md, one test per entry, through the real CLIs.

Every entry runs ``bnsgcn-partition`` or ``bnsgcn-train`` as a subprocess (``python -m
bnsgcn.partition.cli`` / ``python -m bnsgcn.launch.cli``) and checks what the user sees: exit status 2,
a last stderr line ``error: ...`` with the entry's key words, no traceback (two entries
check that ``--debug`` adds it), and that earlier good outputs (a partition set, a run
directory) keep every file byte for byte (a run's ``log.txt`` may only grow).

Small graphs and two-epoch runs keep the module fast; the only real training run is the
module fixture that proves the good partition set trains.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bnsgcn.data.shard import load_shard
from bnsgcn.errors import UserError

from .helpers.cli import (
    PARTITION,
    SMALL_RUN,
    TRAIN,
    Outcome,
    assert_kept,
    assert_user_error,
    run_cli,
    snapshot,
    train_on,
)
from .helpers.graphs import NUM_CLASSES, partition, random_graph, write_npz
from .helpers.partition_sets import edit_array

# --- fixtures: one good partition set and one good run, made once -----------------------


@pytest.fixture(scope="module")
def good_set(tmp_path_factory) -> Path:
    graph = random_graph(num_nodes=120, avg_degree=4, classes=NUM_CLASSES, seed=1)
    return partition(graph, 2, tmp_path_factory.mktemp("good") / "parts" / "good-2")


@pytest.fixture(scope="module")
def good_run(good_set: Path, tmp_path_factory) -> Path:
    """A finished run (with checkpoints) on ``good_set``: the set is fine as it is."""
    work = tmp_path_factory.mktemp("good-run")
    run_dir = work / "run"
    outcome = run_cli(
        TRAIN,
        ["--procs", "2", "--parts-dir", str(good_set), "--out", str(run_dir), "--checkpoint-every", "1", *SMALL_RUN],
        work,
    )
    assert outcome.code == 0, outcome.stderr
    assert (run_dir / "checkpoints" / "checkpoint-000002.pt").is_file()
    return run_dir


@pytest.fixture
def parts(good_set: Path, tmp_path: Path) -> Path:
    """A private copy of the good set, to damage."""
    return Path(shutil.copytree(good_set, tmp_path / "parts" / "set-2"))


@pytest.fixture
def unwritable_dir(tmp_path: Path) -> Path:
    """A directory nobody may create files in, root included: a link to sysfs."""
    if not os.access("/sys", os.F_OK):
        pytest.fail("this test needs Linux sysfs at /sys as a directory no user can write")
    link = tmp_path / "read-only"
    link.symlink_to("/sys")
    return link


def expect_train_error(cwd: Path, parts_dir: Path, run_dir: Path, args: list[str], *keywords: str) -> Outcome:
    """Run bnsgcn-train; check the error, and that the partition set and the earlier run
    directory it was given are left as they were."""
    before_set, before_run = snapshot(parts_dir), snapshot(run_dir)
    outcome = run_cli(TRAIN, args, cwd)
    assert_user_error(outcome, *keywords)
    assert_kept(before_set, parts_dir)
    assert_kept(before_run, run_dir)
    return outcome


# --- bnsgcn-partition --------------------------------------------------------------------


def expect_partition_error(tmp_path: Path, parts: Path, args: list[str], *keywords: str) -> Outcome:
    """Run bnsgcn-partition with ``--out`` at an existing good set and ``--force``: the
    error must leave that set as it was."""
    before = snapshot(parts.parent)
    outcome = run_cli(PARTITION, [*args, "--out", str(parts), "--force"], tmp_path)
    assert_user_error(outcome, *keywords)
    assert_kept(before, parts.parent)
    return outcome


def test_partition_unknown_or_abbreviated_flag(tmp_path, parts):
    outcome = expect_partition_error(
        tmp_path, parts, ["--part", "4", "--meth", "random", "cora"], "unknown flag --part; did you mean --parts?"
    )
    assert outcome.stderr.strip() == outcome.last_line
    expect_partition_error(
        tmp_path,
        parts,
        ["cora", "--sampling-rate", "0.1"],
        "unknown flag --sampling-rate for bnsgcn-partition",
        "it is a flag of bnsgcn-train: pass it there (as --p)",
    )


def test_partition_unknown_dataset(tmp_path, parts):
    outcome = expect_partition_error(
        tmp_path, parts, ["no-such-dataset"], "unknown dataset 'no-such-dataset'", "choose one of", "cora"
    )
    assert outcome.stderr.strip() == outcome.last_line  # no progress line before it


def test_partition_missing_dataset_files(tmp_path, parts):
    (tmp_path / "empty").mkdir()
    outcome = expect_partition_error(
        tmp_path,
        parts,
        ["cora", "--data-dir", str(tmp_path / "empty")],
        "ind.cora.x",
        str(tmp_path / "empty"),
        "--data-dir",
    )
    assert outcome.stderr.strip() == outcome.last_line  # no progress line before it


def test_partition_labels_out_of_range(tmp_path, parts):
    labels = random_graph(num_nodes=40, avg_degree=4, classes=NUM_CLASSES, seed=2).labels.copy()
    labels[7] = -1
    path = write_npz(tmp_path / "bad-labels.npz", labels=labels)
    expect_partition_error(
        tmp_path, parts, [f"npz:{path}"], "bad-labels.npz", "label -1 of node 7", "outside [0, 3)", "fix the labels"
    )


@pytest.mark.parametrize("bad_value", [np.nan, np.inf])
def test_partition_nan_or_infinite_features(tmp_path, parts, bad_value):
    features = random_graph(num_nodes=40, avg_degree=4, classes=NUM_CLASSES, seed=2).features.copy()
    features[5, 2] = bad_value
    path = write_npz(tmp_path / "bad-features.npz", features=features)
    expect_partition_error(
        tmp_path, parts, [f"npz:{path}"], "bad-features.npz", "NaN or infinite", "first at node 5", "clean the features"
    )


def test_partition_unwritable_output(tmp_path, unwritable_dir):
    write_npz(tmp_path / "good.npz")
    (tmp_path / "a-file").write_text("not a directory\n")
    for out in (unwritable_dir / "set", tmp_path / "a-file" / "set"):
        before = snapshot(tmp_path)
        outcome = run_cli(PARTITION, [f"npz:{tmp_path / 'good.npz'}", "--out", str(out)], tmp_path)
        assert_user_error(outcome, f"cannot write the partition set to {out}", "choose a writable --out")
        assert outcome.stderr.strip() == outcome.last_line  # refused before loading anything
        assert_kept(before, tmp_path)  # no temporary directory left behind


def test_partition_debug_shows_the_traceback(tmp_path, parts):
    outcome = run_cli(PARTITION, ["no-such-dataset", "--out", str(parts), "--force", "--debug"], tmp_path)
    assert outcome.code != 0
    assert "Traceback (most recent call last)" in outcome.stderr
    assert "UserError: unknown dataset 'no-such-dataset'" in outcome.stderr


# --- bnsgcn-train: flags and machine, checked before any rank starts ----------------------


@pytest.mark.parametrize(
    ("flags", "keywords"),
    [
        (["--model", "gcnn"], ["unknown model 'gcnn'", "choose --model from graphsage, gat, gcn"]),
        (["--p", "1.5"], ["--p 1.5 is outside [0, 1]", "--p 0.1"]),
        (["--p", "-0.1"], ["--p -0.1 is outside [0, 1]"]),
        (["--layers", "0"], ["--layers 0 must be a positive integer"]),
        (["--hidden", "-8"], ["--hidden -8 must be a positive integer"]),
        (["--epochs", "0"], ["--epochs 0 must be a positive integer"]),
        (["--lr", "nan"], ["--lr nan is not a finite number", "pass a finite value"]),
        (["--p", "nan"], ["--p nan is not a finite number"]),
        (["--timeout", "inf"], ["--timeout inf is not a finite number"]),
        (["--bucket-mb=-inf"], ["--bucket-mb -inf is not a finite number"]),
        (["--seed", str(2**64)], [f"--seed {2**64} does not fit in 64 bits"]),
        (["--epoch", "2"], ["unknown flag --epoch; did you mean --epochs?"]),
        (["--backend", "nccl"], ["--backend nccl:", "--gpus N (NCCL) or --procs N (gloo)"]),
        (["--model", "my_gnn:APPNP", "--remat"], ["--remat applies to the built-in models", "drop --remat"]),
    ],
    ids=[
        "unknown-model",
        "p-above-1",
        "p-below-0",
        "layers-0",
        "hidden-negative",
        "epochs-0",
        "lr-nan",
        "p-nan",
        "timeout-inf",
        "bucket-minus-inf",
        "seed-too-big",
        "abbreviated-flag",
        "original-backend",
        "remat-with-own-model",
    ],
)
def test_train_bad_flags(tmp_path, good_set, good_run, flags, keywords):
    # The flag comes last so that it overrides SMALL_RUN's value.
    expect_train_error(tmp_path, good_set, good_run, train_on(good_set, good_run, *flags), *keywords)


def test_train_model_class_that_is_no_module(tmp_path, good_set, good_run):
    """The installed command, a console script, has its own directory on the path, not the
    current one: the class is found in the current directory all the same, and refused."""
    (tmp_path / "my_gnn.py").write_text("def propagate(x, graph):\n    return x\n")
    command = [str(Path(sys.executable).parent / "bnsgcn-train")]
    before_set, before_run = snapshot(good_set), snapshot(good_run)
    outcome = run_cli(command, train_on(good_set, good_run, "--model", "my_gnn:propagate"), tmp_path)
    assert_user_error(outcome)
    assert outcome.last_line == (
        "error: --model my_gnn:propagate is a function, not a subclass of torch.nn.Module; name your model's class"
    )
    assert_kept(before_set, good_set)
    assert_kept(before_run, good_run)


def test_train_resume_without_out(tmp_path, good_set, good_run):
    args = ["--procs", "2", "--parts-dir", str(good_set), *SMALL_RUN, "--resume"]
    expect_train_error(tmp_path, good_set, good_run, args, "--resume continues the run in --out", "pass --out RUN_DIR")
    assert not (tmp_path / "runs").exists()  # no new run directory either


def test_train_debug_shows_the_traceback(tmp_path, good_set, good_run):
    outcome = run_cli(TRAIN, train_on(good_set, good_run, "--p", "1.5", "--debug"), tmp_path)
    assert outcome.code == 2
    assert "Traceback (most recent call last)" in outcome.stderr
    assert outcome.last_line == "error: --p 1.5 is outside [0, 1]; pass a probability such as --p 0.1"


def test_train_more_gpus_than_present(tmp_path, good_set, good_run):
    wanted = torch.cuda.device_count() + 1
    args = ["--gpus", str(wanted), "--parts-dir", str(good_set), "--out", str(good_run), *SMALL_RUN]
    expect_train_error(
        tmp_path,
        good_set,
        good_run,
        args,
        f"--gpus {wanted} needs {wanted} CUDA GPU",
        f"this machine has {wanted - 1}",
        f"--procs {wanted}",
    )


def test_train_ranks_not_matching_parts(tmp_path, good_set, good_run):
    args = ["--procs", "3", "--parts-dir", str(good_set), "--out", str(good_run), *SMALL_RUN]
    expect_train_error(
        tmp_path,
        good_set,
        good_run,
        args,
        "3 ranks but partition set",
        "has 2 partitions",
        "--procs 2",
        "re-partition into 3 parts",
    )


def test_train_master_port_in_use(tmp_path, good_set, good_run):
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = train_on(good_set, good_run, "--master-port", str(port))
        expect_train_error(tmp_path, good_set, good_run, args, f"master port {port} is already in use", "--master-port")


def test_train_newer_format_version(tmp_path, parts, good_run):
    manifest_path = parts / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["version"] = 99
    manifest_path.write_text(json.dumps(manifest))
    expect_train_error(
        tmp_path,
        parts,
        good_run,
        train_on(parts, good_run),
        "format version 99",
        "newer than this bnsgcn reads",
        "upgrade bnsgcn",
    )


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_train_manifest_missing_or_corrupt(tmp_path, parts, good_run, damage):
    manifest_path = parts / "manifest.json"
    if damage == "missing":
        manifest_path.unlink()
        keywords = ["manifest.json not found", "is not a partition set", "bnsgcn-partition"]
    else:
        manifest_path.write_text(manifest_path.read_text()[:100])
        keywords = ["manifest.json is not valid JSON", "re-run bnsgcn-partition"]
    expect_train_error(tmp_path, parts, good_run, train_on(parts, good_run), *keywords)


# --- bnsgcn-train: the partition set's files, checked by each rank ----------------------


def test_train_incomplete_set(tmp_path, parts, good_run):
    shutil.rmtree(parts / "part-1")
    expect_train_error(
        tmp_path,
        parts,
        good_run,
        train_on(parts, good_run),
        "rank 1 failed (exit code 2)",
        "part-1",
        "is missing",
        "incomplete",
        "bnsgcn-partition --force",
    )


def test_train_truncated_array_is_caught_by_the_size_check(tmp_path, parts, good_run):
    features = parts / "part-1" / "features.npy"
    size = features.stat().st_size
    with open(features, "r+b") as handle:
        handle.truncate(size - 64)
    expect_train_error(
        tmp_path,
        parts,
        good_run,
        train_on(parts, good_run),
        "rank 1 failed",
        str(features),
        f"has {size - 64} bytes, the manifest says {size}",
        "truncated or corrupt",
    )


def test_train_flipped_bytes_are_caught_with_verify(tmp_path, parts, good_run):
    indices = parts / "part-0" / "adj_indices.npy"
    data = bytearray(indices.read_bytes())
    data[-8:] = bytes(255 - b for b in data[-8:])  # same size, different content
    indices.write_bytes(bytes(data))
    expect_train_error(
        tmp_path,
        parts,
        good_run,
        train_on(parts, good_run, "--verify"),
        "rank 0 failed",
        str(indices),
        "fails its SHA-256 checksum",
        "corrupt",
    )


def test_train_labels_out_of_range_in_an_edited_set(tmp_path, parts, good_run):
    labels = parts / "part-0" / "labels.npy"
    edit_array(labels, lambda array: array.__setitem__(3, NUM_CLASSES + 4))
    node = int(np.load(parts / "part-0" / "inner_nodes.npy")[3])
    expect_train_error(
        tmp_path,
        parts,
        good_run,
        train_on(parts, good_run),
        "rank 0 failed",
        str(labels),
        f"labels that are not in [0, {NUM_CLASSES}) (first at node {node})",
        "re-partition",
    )


def test_train_adjacency_out_of_range_in_an_edited_set(tmp_path, parts, good_run):
    # A column id past the partition's inner and boundary nodes: one line naming the files,
    # not a traceback from deep inside the graph code.
    indices = parts / "part-1" / "adj_indices.npy"
    edit_array(indices, lambda array: array.__setitem__(0, 10**6))
    expect_train_error(
        tmp_path,
        parts,
        good_run,
        train_on(parts, good_run),
        "rank 1 failed",
        str(parts / "part-1" / "adj_indptr.npy"),
        "adj_indices.npy do not form this partition's adjacency",
        "CSR column ids must lie in",
        "re-run bnsgcn-partition --force",
    )


def test_train_nan_features_in_an_edited_set(tmp_path, parts, good_run):
    features = parts / "part-1" / "features.npy"
    edit_array(features, lambda array: array.__setitem__((2, 1), np.nan))
    node = int(np.load(parts / "part-1" / "inner_nodes.npy")[2])
    expect_train_error(
        tmp_path,
        parts,
        good_run,
        train_on(parts, good_run),
        "rank 1 failed",
        str(features),
        f"NaN or infinite values (first at node {node})",
        "re-partition",
    )


def test_multilabel_targets_outside_0_1_in_an_edited_set(tmp_path):
    # In-process: the same check as above, for multi-label sets (a 0/1 matrix per node).
    parts = partition(random_graph(num_nodes=40, avg_degree=4, seed=2, multilabel=True), 2, tmp_path / "set")
    labels = parts / "part-1" / "labels.npy"
    edit_array(labels, lambda array: array.__setitem__((4, 2), 2))
    node = int(np.load(parts / "part-1" / "inner_nodes.npy")[4])
    with pytest.raises(UserError, match=re.escape(f"{labels} holds labels that are not 0 or 1 (first at node {node})")):
        load_shard(parts, 1, 2)
    load_shard(parts, 0, 2)  # the other partition is fine


# --- bnsgcn-train: output directories ----------------------------------------------------


def test_train_unwritable_output_dir(tmp_path, good_set, good_run, unwritable_dir):
    out = unwritable_dir / "run"
    expect_train_error(
        tmp_path, good_set, good_run, train_on(good_set, out), f"cannot write {out}", "pass a writable --out"
    )


def test_train_unwritable_checkpoint_dir(tmp_path, good_set, good_run, unwritable_dir):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").symlink_to(unwritable_dir)
    expect_train_error(
        tmp_path,
        good_set,
        good_run,
        train_on(good_set, run_dir, "--checkpoint-every", "1"),
        f"cannot write {run_dir / 'checkpoints'}",
        "pass a writable --out",
    )
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints"]  # nothing trained, nothing written


def test_train_fresh_run_over_an_earlier_runs_checkpoints(tmp_path, good_set, good_run):
    # Without --resume a new run would mix its checkpoints with the earlier run's, and a
    # later --resume could continue the wrong one.
    expect_train_error(
        tmp_path,
        good_set,
        good_run,
        train_on(good_set, good_run),
        f"{good_run} holds the checkpoints of an earlier run",
        "pass --resume",
        "a new --out",
    )


def test_train_failed_start_leaves_no_run_directory(tmp_path, parts):
    shutil.rmtree(parts / "part-1")
    args = ["--procs", "2", "--parts-dir", str(parts), *SMALL_RUN]  # no --out: runs/<time> here
    assert_user_error(run_cli(TRAIN, args, tmp_path), "part-1", "is missing")
    assert not (tmp_path / "runs").exists()
