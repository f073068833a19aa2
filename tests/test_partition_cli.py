"""``bnsgcn-partition`` end to end (success, reuse, --force, bad input) and its progress display.

Runs ``bnsgcn.partition.cli.main`` in-process (and once as a subprocess) on the real Cora data
in ``../shared/data`` and on small synthetic graphs. Every failure must exit with status 2,
print one ``error:`` line naming the problem and the fix, and leave no output behind.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from bnsgcn.data.format import load_partition, read_manifest
from bnsgcn.errors import UserError
from bnsgcn.metrics.progress import Progress, step
from bnsgcn.partition.cli import default_out_dir, main

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
    assert manifest["partitioner"] == {
        "method": "metis",
        "objective": "cut",
        "seed": 0,
        "balance": ["inner_nodes", "train_nodes"],
        "assignment_file": None,
        "node_order": "blocks",
        "blocks_by": {"block_nodes": 400, "parts": ["metis"] * 3},
    }
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
    assert (
        main(
            [
                CORA_NPZ,
                "--parts",
                "3",
                "--assignment",
                str(tmp_path / "assignment.npy"),
                "--node-order",
                "ids",
                "--out",
                str(out),
            ]
        )
        == 0
    )
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
    # /proc refuses new directories even to root, whatever its permission bits say
    for out in (tmp_path / "file" / "set", read_only / "sub" / "set", Path("/proc/bnsgcn-test/set")):
        assert main([CORA_NPZ, "--method", "random", "--out", str(out)]) == 2
        stderr = capsys.readouterr().err
        assert stderr.splitlines() == [stderr.strip()]  # the error line only: nothing was loaded
        assert str(out) in stderr and "choose a writable --out" in stderr
    assert entries(tmp_path) == before


@pytest.mark.parametrize(
    "args, expected",
    [
        (["no-such-dataset"], "unknown dataset 'no-such-dataset'"),
        (["cora", "--data-dir", "{tmp}"], "ind.cora.x"),
    ],
)
def test_dataset_errors_come_before_any_progress_line(tmp_path, capsys, args, expected):
    args = [arg.format(tmp=tmp_path) for arg in args]
    assert main([*args, "--out", str(tmp_path / "set")]) == 2
    stderr = capsys.readouterr().err
    assert stderr.splitlines() == [stderr.strip()] and stderr.startswith("error: ") and expected in stderr


def write_small_npz(path: Path, seed: int = 0) -> Path:
    """A 200-node graph in the npz layout of docs/datasets.md."""
    from bnsgcn.partition.datasets import load_dataset

    graph = load_dataset(f"synthetic:nodes=200,degree=4,features=3,seed={seed}", None, progress=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(
        path,
        adj_indptr=graph.indptr,
        adj_indices=graph.indices,
        adj_shape=np.array([200, 200]),
        features=graph.features,
        labels=graph.labels,
        train_mask=graph.train_mask,
        val_mask=graph.val_mask,
        test_mask=graph.test_mask,
    )
    return path


def test_reuse_checks_the_input_files(tmp_path, capsys):
    first, second = write_small_npz(tmp_path / "a" / "g.npz"), write_small_npz(tmp_path / "b" / "g.npz")
    out = tmp_path / "set"
    args = ["npz:g.npz", "--method", "random", "--out", str(out), "--data-dir"]
    assert main([*args, str(first.parent)]) == 0
    stat = first.stat()
    assert read_manifest(out)["dataset"]["inputs"] == [
        {"path": str(first.resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    ]
    capsys.readouterr()
    assert main([*args, str(first.parent)]) == 0
    assert "reusing the partition set" in capsys.readouterr().out

    # the same spec on another copy, or on the same file changed since, is not reused
    assert main([*args, str(second.parent)]) == 2
    assert "other or since changed input files" in error_line(capsys)
    write_small_npz(first, seed=1)
    assert main([*args, str(first.parent)]) == 2
    assert "--force" in error_line(capsys)
    assert main([*args, str(first.parent), "--force"]) == 0
    assert read_manifest(out)["dataset"]["inputs"][0]["mtime_ns"] == first.stat().st_mtime_ns


def run_script(script: str, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, capture_output=True, text=True, timeout=240)


# bnsgcn-partition that sends itself SIGTERM in the middle of writing partition 0.
TERMINATE_WHILE_WRITING = """
import os, signal, sys
import bnsgcn.partition.writer as writer
real_write_array, written = writer.write_array, []
def write_array(part_dir, name, array):
    written.append(name)
    if len(written) == 5:
        os.kill(os.getpid(), signal.SIGTERM)
    return real_write_array(part_dir, name, array)
writer.write_array = write_array
from bnsgcn.partition.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_while_writing_cleans_up(tmp_path):
    out = tmp_path / "new" / "set"
    result = run_script(
        TERMINATE_WHILE_WRITING, ["synthetic:nodes=300,degree=4", "--method", "random", "--out", str(out)]
    )
    assert result.returncode == 143, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "error: terminated (SIGTERM); no partition set was written"
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []  # neither <out>.tmp-<host>-<pid> nor the parent made for it


# bnsgcn-partition whose METIS (a stand-in that sleeps) reports where it runs, and which
# sends itself SIGTERM once it does.
TERMINATE_DURING_METIS = """
import os, signal, sys, threading, time
import bnsgcn.partition.partitioner as partitioner
kway, *rest = partitioner._metis_kway()
read_end, write_end = os.pipe()
def sleeping_kway(*args):
    blocked = signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    os.write(write_end, f"{os.getpid()} {blocked}".encode())
    time.sleep(120)
    return 1
partitioner._metis_kway = lambda: (sleeping_kway, *rest)
def terminate_once_metis_runs():
    metis = os.read(read_end, 64).decode()
    print(f"METIS pid, SIGTERM blocked: {metis}; main pid {os.getpid()}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
threading.Thread(target=terminate_once_metis_runs, daemon=True).start()
from bnsgcn.partition.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_during_metis_stops_it_cleanly(tmp_path):
    out = tmp_path / "set"
    result = run_script(TERMINATE_DURING_METIS, ["synthetic:nodes=300,degree=4", "--out", str(out)])
    assert result.returncode == 143, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "error: terminated (SIGTERM); no partition set was written"
    assert "Traceback" not in result.stderr
    match = re.search(r"METIS pid, SIGTERM blocked: (\d+) (\w+); main pid (\d+)", result.stderr)
    metis_pid, blocked, main_pid = int(match[1]), match[2], int(match[3])
    # METIS ran in a child that never saw SIGTERM (its own handler mishandles it) ...
    assert metis_pid != main_pid and blocked == "True"
    with pytest.raises(ProcessLookupError):  # ... and that child was stopped with the run
        os.kill(metis_pid, 0)
    assert list(tmp_path.iterdir()) == []


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
        [sys.executable, "-m", "bnsgcn.partition.cli", "--parts", "0", CORA_NPZ, "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: --parts 0 must be at least 1; pass e.g. --parts 2"]
    assert "Traceback" not in result.stderr and not out.exists()


def test_subprocess_success(tmp_path):
    out = tmp_path / "set"
    result = subprocess.run(
        [sys.executable, "-m", "bnsgcn.partition.cli", CORA_NPZ, "--parts", "2", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
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
    frames = [frame.replace("\x1b[K", "") for frame in stream.getvalue().split("\r") if frame]
    assert (
        frames[0] == "METIS ..."
        and frames[-1].startswith("METIS ... failed after ")
        and stream.getvalue().count("\n") == 1
    )


def heartbeat_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("heartbeat")]


def test_step_heartbeat_on_a_terminal_redraws_the_elapsed_time():
    stream = FakeTerminal()
    with step("METIS", stream, interval=0.02):
        assert len(heartbeat_threads()) == 1
        time.sleep(0.3)
    assert heartbeat_threads() == []
    frames = [frame.replace("\x1b[K", "") for frame in stream.getvalue().split("\r") if frame]
    beats = [
        float(match[1]) for frame in frames if (match := re.fullmatch(r"METIS \.\.\. running for (\d+\.\d)s", frame))
    ]
    assert len(beats) >= 3 and beats == sorted(beats) and len(beats) == len(frames) - 2
    assert (
        frames[0] == "METIS ..." and frames[-1].startswith("METIS ... done in ") and stream.getvalue().count("\n") == 1
    )
    time.sleep(0.1)
    assert stream.getvalue().count("running for") == len(beats)  # nothing after the step ended


def test_step_heartbeat_in_a_log_and_nested_steps():
    stream = io.StringIO()
    with step("loading", stream, interval=0.02):
        time.sleep(0.15)
        with step("reading", stream, interval=3600):  # only the innermost step beats
            time.sleep(0.2)
    lines = stream.getvalue().splitlines()
    inner = lines.index("reading ...")
    assert lines[0] == "loading ..." and inner >= 3
    assert all(re.fullmatch(r"loading \.\.\. running for \d+\.\ds", line) for line in lines[1:inner])
    assert lines[inner + 1].startswith("reading ... done in ")
    assert all("running for" in line for line in lines[inner + 2 : -1])  # the outer beats again afterwards
    assert lines[-1].startswith("loading ... done in ")


def test_step_shorter_than_the_heartbeat_shows_none():
    for stream in (io.StringIO(), FakeTerminal()):
        with step("quick", stream):  # default periods: 1 s on a terminal, 30 s in a log
            time.sleep(0.05)
        assert "running for" not in stream.getvalue()


def test_synthetic_dataset_end_to_end(tmp_path, capsys):
    from bnsgcn.partition.datasets import load_dataset

    from .helpers.partition_sets import check_partition_set

    spec = "synthetic:nodes=600,degree=8,features=4,classes=3,seed=2"
    out = tmp_path / "set"
    assert main([spec, "--parts", "3", "--objective", "vol", "--out", str(out)]) == 0
    assert read_manifest(out)["partitioner"]["objective"] == "vol"
    check_partition_set(load_dataset(spec, None, progress=False), out, 3, "as written")
