"""Damaged, mixed-up or malformed partition sets, and faults while writing one.

What is covered:

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

Most cases call the loaders in-process (``load_shard``, the launcher's
``choose_partition_set``); a few run ``bnsgcn-train`` or ``bnsgcn-partition`` to check the
one line the user sees.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

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

from .helpers.cli import PARTITION, SMALL_RUN, TRAIN, assert_user_error, run_cli
from .helpers.graphs import partition, random_graph, write_npz
from .helpers.partition_sets import edit_array

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
