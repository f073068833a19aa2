"""``bnsgcn-partition`` end to end (success, reuse, --force, bad input) and its progress display.

Runs ``partition.cli.main`` in-process (and once as a subprocess) on the real Cora data
in ``../shared/data`` and on small synthetic graphs. Every failure must exit with status 2,
print one ``error:`` line naming the problem and the fix, and leave no output behind.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bnsgcn.errors import UserError
from bnsgcn.format import load_partition, read_manifest
from bnsgcn.progress import Progress, step
from partition.cli import default_out_dir, main

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
CORA_NPZ = f"npz:{DATA / 'cora.npz'}"
CORA_NODES = 2708


def error_line(capsys) -> str:
    """The single ``error:`` line on stderr (progress lines may precede it)."""
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    return errors[0]


def entries(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def test_writes_set_and_report(tmp_path, capsys):
    out = tmp_path / "cora-3"
    assert main([CORA_NPZ, "--parts", "3", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert f"partition set written to {out}" in stdout
    manifest = read_manifest(out)
    for row in manifest["report"]["rows"]:
        assert f"{row['inner']:,}" in stdout and f"{row['boundary']:,}" in stdout
    assert manifest["dataset"]["num_nodes"] == CORA_NODES and manifest["dataset"]["spec"] == CORA_NPZ
    assert manifest["partitioner"] == {"method": "metis", "objective": "cut", "seed": 0,
                                       "balance": ["inner_nodes", "train_nodes"], "assignment_file": None}
    inner = [load_partition(out, k, verify=True)["inner_nodes"] for k in range(3)]
    assert np.array_equal(np.sort(np.concatenate(inner)), np.arange(CORA_NODES))


def test_reuse_then_force(tmp_path, capsys):
    out = tmp_path / "set"
    args = [CORA_NPZ, "--parts", "2", "--method", "random", "--seed", "4", "--out", str(out)]
    assert main(args) == 0
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    capsys.readouterr()
    assert main(args) == 0
    assert "reusing the partition set" in capsys.readouterr().out
    assert stamps == {p: p.stat().st_mtime_ns for p in out.rglob("*")}

    assert main(args[:-2] + ["--seed", "5", "--out", str(out)]) == 2
    assert "--force" in error_line(capsys)
    assert read_manifest(out)["partitioner"]["seed"] == 4

    assert main(args[:-2] + ["--seed", "5", "--out", str(out), "--force"]) == 0
    assert read_manifest(out)["partitioner"]["seed"] == 5
    assert entries(tmp_path)[0] == "set" and not any(".tmp-" in e or ".old-" in e for e in entries(tmp_path))


def test_default_out_dir(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([CORA_NPZ, "--method", "random"]) == 0
    expected = default_out_dir(CORA_NPZ, 2)
    assert expected.parent == Path("parts") and expected.name.startswith("npz-cora-") and expected.name.endswith("-2")
    assert (tmp_path / expected / "manifest.json").is_file()
    assert default_out_dir("reddit", 8) == Path("parts/reddit-8")
    assert default_out_dir("synthetic", 2) == Path("parts/synthetic-2")
    assert default_out_dir("synthetic:nodes=10", 2) != default_out_dir("synthetic:nodes=20", 2)


def test_assignment_file(tmp_path, capsys):
    assignment = np.arange(CORA_NODES) % 3
    np.save(tmp_path / "assignment.npy", assignment)
    out = tmp_path / "set"
    assert main([CORA_NPZ, "--parts", "3", "--assignment", str(tmp_path / "assignment.npy"), "--out", str(out)]) == 0
    assert read_manifest(out)["partitioner"]["method"] == "file"
    assert np.array_equal(load_partition(out, 1)["inner_nodes"], np.flatnonzero(assignment == 1))


def write_corrupt_npz(tmp_path: Path) -> Path:
    path = tmp_path / "corrupt.npz"
    path.write_bytes((DATA / "cora.npz").read_bytes()[:4000])
    return path


BAD_INPUTS = {
    "unknown dataset": (lambda tmp: ["no-such-dataset"], "unknown dataset"),
    "missing data files": (lambda tmp: ["cora", "--data-dir", str(tmp / "empty")], "ind.cora"),
    "corrupt file": (lambda tmp: [f"npz:{write_corrupt_npz(tmp)}"], "corrupt.npz"),
    "parts zero": (lambda tmp: [CORA_NPZ, "--parts", "0"], "--parts 0"),
    "parts above nodes": (lambda tmp: [CORA_NPZ, "--parts", str(CORA_NODES + 1)], f"--parts {CORA_NODES}"),
    "missing assignment": (lambda tmp: [CORA_NPZ, "--assignment", str(tmp / "nope.npy")], "nope.npy"),
    "assignment length": (lambda tmp: [CORA_NPZ, "--assignment", str(tmp / "short.txt")], "2708 nodes"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_exits_2_and_leaves_nothing(tmp_path, capsys, case):
    (tmp_path / "empty").mkdir()
    (tmp_path / "short.txt").write_text("0\n1\n")
    make_args, expected = BAD_INPUTS[case]
    args = make_args(tmp_path) + ["--out", str(tmp_path / "out" / "set")]
    before = entries(tmp_path)
    assert main(args) == 2
    line = error_line(capsys)
    assert expected in line
    assert entries(tmp_path) == before


def test_unwritable_output(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("not a directory")
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    real_mkdir = Path.mkdir

    def refuse_under_read_only(self, *args, **kwargs):
        # chmod does not stop root, so the permission error is simulated.
        if read_only in self.parents:
            raise PermissionError(13, "Permission denied", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refuse_under_read_only)
    before = entries(tmp_path)
    for out in (tmp_path / "file" / "set", read_only / "sub" / "set", Path("/proc/bnsgcn-test/set")):
        assert main([CORA_NPZ, "--method", "random", "--out", str(out)]) == 2
        line = error_line(capsys)
        assert str(out) in line and "choose a writable --out" in line
    assert entries(tmp_path) == before


def test_existing_foreign_directory_is_refused(tmp_path, capsys):
    out = tmp_path / "data"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert main([CORA_NPZ, "--out", str(out), "--force"]) == 2
    assert "not a partition set" in error_line(capsys)
    assert entries(out) == ["keep.txt"]


def test_debug_shows_the_exception(tmp_path):
    with pytest.raises(UserError, match="unknown dataset"):
        main(["no-such-dataset", "--out", str(tmp_path / "set"), "--debug"])


def test_subprocess_error_is_one_line(tmp_path):
    out = tmp_path / "set"
    result = subprocess.run(
        [sys.executable, "-m", "partition.cli", "--parts", "0", CORA_NPZ, "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: --parts 0 must be at least 1; pass e.g. --parts 2"
    ]
    assert "Traceback" not in result.stderr and not out.exists()


def test_subprocess_success(tmp_path):
    out = tmp_path / "set"
    result = subprocess.run(
        [sys.executable, "-m", "partition.cli", CORA_NPZ, "--parts", "2", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert f"partition set written to {out}" in result.stdout
    assert "writing partitions: 2/2 (100%)" in result.stderr
    assert load_partition(out, 1, verify=True).num_parts == 2


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_updates_one_line():
    stream = FakeTerminal()
    with Progress(4, "writing", stream) as bar:
        for _ in range(4):
            bar.update()
    text = stream.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")
    frames = [frame.replace("\x1b[K", "") for frame in text.strip().split("\r") if frame]
    assert frames[0].startswith("writing: 0/4 (0%)")
    assert "2/4 (50%)" in frames[2] and "ETA" in frames[2]
    assert frames[-1].startswith("writing: 4/4 (100%)") and "done in" in frames[-1]


def test_progress_in_a_log_is_throttled():
    stream = io.StringIO()
    with Progress(1000, "epochs", stream, interval=3600) as bar:
        for _ in range(1000):
            bar.update()
    assert stream.getvalue().splitlines() == [stream.getvalue().strip()]
    assert stream.getvalue().startswith("epochs: 1000/1000 (100%)")
    stream = io.StringIO()
    with Progress(None, "batches", stream, interval=0) as bar:
        bar.update(3)
        bar.update(2)
    lines = stream.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["3", "5"]  # the last update is not repeated on close
    silent = io.StringIO()
    with Progress(3, "quiet", silent, enabled=False) as bar:
        bar.update(3)
    assert silent.getvalue() == "" and bar.count == 3


def test_step_reports_time_and_failure():
    stream = io.StringIO()
    with step("loading reddit", stream):
        pass
    assert stream.getvalue().splitlines()[0] == "loading reddit ..."
    assert re.fullmatch(r"loading reddit \.\.\. done in \d+\.\ds", stream.getvalue().splitlines()[1])
    stream = FakeTerminal()
    with pytest.raises(RuntimeError):
        with step("METIS", stream):
            raise RuntimeError("boom")
    assert stream.getvalue().startswith("METIS ...\rMETIS ... failed after ") and stream.getvalue().count("\n") == 1


def test_synthetic_dataset_end_to_end(tmp_path, capsys):
    from partition.datasets import load_dataset
    from tests.test_partition import check_partition_set

    spec = "synthetic:nodes=600,degree=8,features=4,classes=3,seed=2"
    out = tmp_path / "set"
    assert main([spec, "--parts", "3", "--objective", "vol", "--out", str(out)]) == 0
    assert read_manifest(out)["partitioner"]["objective"] == "vol"
    check_partition_set(load_dataset(spec, None, progress=False), out, 3)
