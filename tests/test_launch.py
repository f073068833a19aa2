"""The launcher: supervisor, rank error handling, environment detection, set discovery, CLI checks.

Supervisor tests use small ``python -c`` stand-ins for ranks; no training runs here.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from bnsgcn.config import TrainConfig, from_args, to_argv
from bnsgcn.device import backend_for, gpu_index, gpus_needed, resolve_device
from bnsgcn.errors import JobStopped, PeerLost, UserError
from bnsgcn.launch import cli
from bnsgcn.launch.discover import (
    PartitionSet,
    check_world_size,
    choose_partition_set,
    find_partition_sets,
)
from bnsgcn.launch.environment import (
    RankEnvironment,
    detect_rank_environment,
    expand_slurm_nodelist,
    first_slurm_host,
    restart_count,
    threads_per_rank,
)
from bnsgcn.launch.network import default_master_port, free_port, port_in_use
from bnsgcn.launch.rank import report_errors, training_parser
from bnsgcn.launch.supervisor import Child, supervise
from bnsgcn.run.provenance import launch_info, run_name_suffix

from .helpers.graphs import partition, random_graph

PY = sys.executable
PRINT_PID = "import os; print('pid', os.getpid(), flush=True)"
SLEEP = PRINT_PID + "; import time; time.sleep(60)"
# Variables that would switch bnsgcn-train into one-rank mode, or that it exports.
LAUNCH_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_STEP_ID",
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
    "SLURM_STEP_NODELIST",
    "SLURM_NNODES",
    "SLURM_STEP_NUM_NODES",
    "SLURM_JOB_NUM_NODES",
    "SLURM_CPUS_PER_TASK",
    "SLURM_JOB_ID",
    "SLURM_RESTART_COUNT",
    "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_RUN_ID",
    "BNSGCN_LAUNCH",
)


def pids_in(text: str) -> list[int]:
    return [int(p) for p in re.findall(r"^pid (\d+)$", text, flags=re.MULTILINE)]


def is_gone(pid: int, within_s: float = 5.0) -> bool:
    """Whether ``pid`` is dead (or a zombie awaiting its reaper) within ``within_s``: a
    grandchild sent SIGKILL with its process group may take a moment to die on a loaded
    machine, as nobody waits for it."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def run_supervised(children: list[Child], grace_s: float = 5.0) -> tuple[int, str, str, float]:
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    status = supervise(children, grace_s=grace_s, stdout=out, stderr=err)
    return status, out.getvalue(), err.getvalue(), time.monotonic() - start


def make_set(directory: Path, parts: int) -> Path:
    """A small real partition set: the launcher checks the whole manifest and every partition.json."""
    return partition(random_graph(num_nodes=10 * parts), parts, directory)


@pytest.fixture
def clean_environment():
    """os.environ without launcher variables; restored in full afterwards (the one-rank
    mode exports MASTER_ADDR, RANK, ... into it)."""
    saved = dict(os.environ)
    for name in LAUNCH_VARIABLES:
        os.environ.pop(name, None)
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)


# --- supervisor -------------------------------------------------------------------------


def test_all_ranks_succeed_and_output_is_forwarded():
    code = "import os, sys; r = os.environ['R']; print('hello from', r); print('note', r, file=sys.stderr)"
    children = [Child(r, [PY, "-c", code], os.environ | {"R": str(r)}) for r in range(3)]
    status, out, err, _ = run_supervised(children)
    assert status == 0
    assert sorted(out.splitlines()) == ["hello from 0", "hello from 1", "hello from 2"]
    assert sorted(err.splitlines()) == ["note 0", "note 1", "note 2"]


def test_failing_rank_stops_the_others_quickly():
    failing = (
        PRINT_PID
        + "; import sys, time; print('warming up', file=sys.stderr); time.sleep(1.0); print('ValueError: boom', "
        "file=sys.stderr); sys.exit(3)"
    )
    children = [Child(0, [PY, "-c", SLEEP]), Child(1, [PY, "-c", failing]), Child(2, [PY, "-c", SLEEP])]
    status, out, err, elapsed = run_supervised(children)
    assert status == 3
    assert err.splitlines()[-1] == "error: rank 1 failed (exit code 3): ValueError: boom"
    assert elapsed < 5.0  # 1 s until the failure, then SIGTERM ends the sleepers at once
    pids = pids_in(out)
    assert len(pids) == 3
    assert all(is_gone(pid) for pid in pids)


def test_rank_killed_by_signal_is_reported_by_name():
    dying = (
        PRINT_PID
        + "; import os, signal, sys, time; time.sleep(0.5); print('about to die', file=sys.stderr, flush=True); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    status, out, err, _ = run_supervised([Child(0, [PY, "-c", SLEEP]), Child(1, [PY, "-c", dying])])
    assert status == 128 + signal.SIGKILL
    assert err.splitlines()[-1] == "error: rank 1 failed (killed by SIGKILL): about to die"
    assert all(is_gone(pid) for pid in pids_in(out))


def test_rank_ignoring_sigterm_and_its_grandchild_are_killed_after_the_grace_period():
    # The grandchild inherits the ignored SIGTERM: only SIGKILL to the process group ends it.
    stubborn = (
        "import os, signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print('pid', os.getpid(), flush=True); print('pid', g.pid, flush=True); time.sleep(60)"
    )
    failing = "import sys, time; time.sleep(1.5); sys.exit('fatal: lost peer')"
    status, out, err, elapsed = run_supervised(
        [Child(0, [PY, "-c", stubborn]), Child(1, [PY, "-c", failing])], grace_s=0.5
    )
    assert status == 1
    assert err.splitlines()[-1] == "error: rank 1 failed (exit code 1): fatal: lost peer"
    assert elapsed < 6.0
    pids = pids_in(out)
    assert len(pids) == 2
    assert all(is_gone(pid) for pid in pids)


def test_grandchild_of_a_successful_rank_is_not_left_behind():
    spawner = (
        "import subprocess, sys; g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print('pid', g.pid, flush=True)"
    )
    status, out, _, _ = run_supervised([Child(0, [PY, "-c", spawner])])
    assert status == 0
    [grandchild] = pids_in(out)
    assert is_gone(grandchild)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_launcher_stops_every_rank(signum):
    script = (
        "import sys\nfrom bnsgcn.launch.supervisor import Child, supervise\n"
        f"sys.exit(supervise([Child(r, [sys.executable, '-c', {SLEEP!r}]) for r in range(2)]))\n"
    )
    launcher = subprocess.Popen([PY, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(30, launcher.kill)  # a hung test must not hang the suite
    watchdog.start()
    try:
        pids = [int(launcher.stdout.readline().split()[1]) for _ in range(2)]
        launcher.send_signal(signum)
        _, err = launcher.communicate(timeout=20)
    finally:
        watchdog.cancel()
        launcher.kill()
    assert launcher.returncode == 128 + signum
    assert f"error: interrupted by {signal.Signals(signum).name}; stopped all 2 local ranks" in err
    assert all(is_gone(pid) for pid in pids)


def test_signal_while_a_rank_is_being_started_stops_that_rank_too(monkeypatch):
    """SIGTERM arriving while the last rank is being started (after its process exists,
    before the supervisor lists it) still stops every rank: the signal waits for the start."""
    from bnsgcn.launch import supervisor

    start, pids = supervisor._Running.__init__, []

    def start_then_signal(self, child, *args):
        start(self, child, *args)
        pids.append(self.process.pid)
        if child.rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # handled at once, in this (the main) thread

    monkeypatch.setattr(supervisor._Running, "__init__", start_then_signal)
    status, _, err, _ = run_supervised([Child(r, [PY, "-c", SLEEP]) for r in range(2)], grace_s=2.0)
    assert status == 128 + signal.SIGTERM
    assert err.splitlines()[-1] == "error: interrupted by SIGTERM; stopped all 2 local ranks"
    assert len(pids) == 2 and all(is_gone(pid) for pid in pids)


def test_rank_entry_reports_user_errors_through_the_supervisor():
    env = os.environ | {"RANK": "0"}
    status, _, err, _ = run_supervised([Child(0, [PY, "-m", "bnsgcn.launch.rank", "--p", "2"], env)])
    assert status == 2
    assert err.splitlines()[-1].startswith(
        "error: rank 0 failed (exit code 2): error: [rank 0] --p 2.0 is outside [0, 1]"
    )


# --- error handling shared by every rank ------------------------------------------------


def _raise(exc: BaseException):
    def work() -> int:
        raise exc

    return work


def test_report_errors_user_error_is_one_line_with_rank(capsys):
    assert report_errors(_raise(UserError("bad input; fix it")), rank=3, debug=False) == 2
    assert capsys.readouterr().err == "error: [rank 3] bad input; fix it\n"
    assert report_errors(_raise(UserError("bad input")), rank=None, debug=False) == 2
    assert capsys.readouterr().err == "error: bad input\n"


def test_report_errors_debug_adds_traceback(capsys):
    assert report_errors(_raise(UserError("bad input")), rank=1, debug=True) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "[rank 1] Traceback (most recent call last):"
    assert lines[-1] == "error: [rank 1] bad input"


def test_report_errors_other_exception_prints_prefixed_traceback(capsys):
    assert report_errors(_raise(RuntimeError("kaput")), rank=2, debug=False) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "[rank 2] Traceback (most recent call last):"
    assert lines[-1] == "[rank 2] RuntimeError: kaput"
    assert all(line.startswith("[rank 2] ") for line in lines)
    assert report_errors(lambda: 7, rank=0, debug=False) == 7


# --- torchrun / SLURM environment -------------------------------------------------------


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a1,b[8-10],c", ["a1", "b8", "b9", "b10", "c"]),
        ("gpu[1-2]-r[08-09]", ["gpu1-r08", "gpu1-r09", "gpu2-r08", "gpu2-r09"]),
        ("host-01.example.org", ["host-01.example.org"]),
        ("n[7],m[001-002]", ["n7", "m001", "m002"]),
    ],
)
def test_slurm_nodelist_expansion(nodelist, hosts):
    assert expand_slurm_nodelist(nodelist) == hosts
    assert first_slurm_host(nodelist) == hosts[0]


@pytest.mark.parametrize("nodelist", ["", "node[1-", "node[3-1]", "a,,b", "a,", ",a", "n[x]", "n[1--2]"])
def test_slurm_nodelist_malformed(nodelist):
    with pytest.raises(UserError, match="MASTER_ADDR"):
        expand_slurm_nodelist(nodelist)


def test_detect_torchrun():
    env = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "1234",
        "TORCHELASTIC_RESTART_COUNT": "2",
    }
    ranks = detect_rank_environment(env, master_addr="127.0.0.1", master_port=29500, nnodes=1)
    assert ranks == RankEnvironment("torchrun", 3, 4, 1, 2, "10.0.0.1", 1234, threads_per_rank(2), restart_count=2)


def test_detect_slurm():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NODELIST": "gpu[03-04,09]",
        "SLURM_NNODES": "2",
        "SLURM_CPUS_PER_TASK": "6",
    }
    ranks = detect_rank_environment(env, master_addr=None, master_port=29511, nnodes=1)
    assert ranks == RankEnvironment("slurm", 5, 8, 1, 4, "gpu03", 29511, 6)
    # --master-addr given: it wins over the node list; SLURM_RESTART_COUNT: a requeued job
    requeued = detect_rank_environment(
        env | {"SLURM_RESTART_COUNT": "1"}, master_addr="10.1.1.1", master_port=29511, nnodes=1
    )
    assert (requeued.master_addr, requeued.restart_count) == ("10.1.1.1", 1)
    exported: dict[str, str] = {}
    ranks.export(exported)
    assert exported == {
        "MASTER_ADDR": "gpu03",
        "MASTER_PORT": "29511",
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
    }
    with_address = detect_rank_environment(
        env | {"MASTER_ADDR": "10.9.9.9", "MASTER_PORT": "4000"}, master_addr="127.0.0.1", master_port=29511, nnodes=1
    )
    assert (with_address.master_addr, with_address.master_port) == ("10.9.9.9", 4000)
    # A batch script or salloc shell (no srun step), one launcher per node, or a one-task step:
    # bnsgcn-train starts the ranks itself.
    for other in (
        {k: v for k, v in env.items() if k != "SLURM_STEP_ID"},
        env | {"SLURM_NTASKS": "1", "SLURM_PROCID": "0"},
    ):
        assert detect_rank_environment(other, master_addr="127.0.0.1", master_port=29500, nnodes=1) is None
    assert detect_rank_environment(env, master_addr="127.0.0.1", master_port=29500, nnodes=2) is None
    assert detect_rank_environment({}, master_addr="127.0.0.1", master_port=29500, nnodes=1) is None
    with pytest.raises(UserError, match="SLURM_NTASKS"):
        detect_rank_environment(env | {"SLURM_NTASKS": "eight"}, master_addr="127.0.0.1", master_port=29500, nnodes=1)


# --- partition-set discovery ------------------------------------------------------------


def test_discovery_takes_the_one_matching_set(tmp_path):
    root = tmp_path / "parts"
    make_set(root / "cora-2", 2)
    make_set(root / "cora-4", 4)
    (root / "empty").mkdir()
    (root / "broken").mkdir()
    (root / "broken" / "manifest.json").write_text("{not json")
    assert find_partition_sets(root) == [PartitionSet(root / "cora-2", 2), PartitionSet(root / "cora-4", 4)]
    assert choose_partition_set(None, 4, root) == PartitionSet(root / "cora-4", 4)
    assert choose_partition_set(root / "cora-2", 4, root) == PartitionSet(root / "cora-2", 2)  # named: no matching


def test_discovery_finds_the_root_itself(tmp_path):
    root = make_set(tmp_path / "parts", 3)
    assert choose_partition_set(None, None, root) == PartitionSet(root, 3)


def test_discovery_none_matching(tmp_path):
    root = tmp_path / "parts"
    make_set(root / "cora-2", 2)
    with pytest.raises(UserError, match=r"no partition set with 5 parts .*cora-2 \(2 parts\).*--parts-dir"):
        choose_partition_set(None, 5, root)
    with pytest.raises(UserError, match=r"no partition set found .*--parts-dir"):
        choose_partition_set(None, 2, tmp_path / "elsewhere")


def test_discovery_several_matching(tmp_path):
    root = tmp_path / "parts"
    make_set(root / "metis-2", 2)
    make_set(root / "random-2", 2)
    with pytest.raises(UserError, match=r"2 partition sets with 2 parts .*metis-2.*random-2.*--parts-dir"):
        choose_partition_set(None, 2, root)
    with pytest.raises(UserError, match="--parts-dir"):
        choose_partition_set(None, None, root)


def test_world_size_must_equal_parts(tmp_path):
    check_world_size(PartitionSet(tmp_path, 4), 4)
    with pytest.raises(UserError, match=r"3 ranks but partition set .* has 4 partitions; .*--procs 4"):
        check_world_size(PartitionSet(tmp_path, 4), 3)


# --- command line -----------------------------------------------------------------------


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    status = cli.main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_gpus_beyond_this_machine_names_the_cpu_alternative(tmp_path, monkeypatch, capsys, clean_environment):
    import torch

    monkeypatch.chdir(tmp_path)
    n = torch.cuda.device_count() + 1
    status, _, err = run_cli(["--gpus", str(n)], capsys)
    assert status == 2
    # where there are GPUs the line also names sharing them (tested in test_ranks_per_gpu_refused_in_one_line)
    share = "" if n == 1 else f"share {'it' if n == 2 else 'them'} with --gpus "
    gpus = f"{n} CUDA GPU{'s' if n > 1 else ''}"
    assert err.startswith(f"error: --gpus {n} needs {gpus} but this machine has {n - 1}; {share}")
    assert err.endswith(f"run on CPU with --procs {n} instead\n")


def test_master_port_in_use(tmp_path, monkeypatch, capsys, clean_environment):
    monkeypatch.chdir(tmp_path)
    make_set(tmp_path / "parts" / "two", 2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert port_in_use(port)
        status, out, err = run_cli(["--procs", "2", "--master-port", str(port)], capsys)
    assert status == 2
    assert "using partition set parts/two (2 parts)" in out
    assert err.startswith(
        f"error: master port {port} is already in use on this machine; pass a free one, e.g. --master-port "
    )
    assert not port_in_use(free_port())


def test_ranks_must_match_partitions(tmp_path, monkeypatch, capsys, clean_environment):
    monkeypatch.chdir(tmp_path)
    two = make_set(tmp_path / "two", 2)
    status, _, err = run_cli(["--procs", "3", "--parts-dir", str(two)], capsys)
    assert status == 2
    assert (
        err
        == f"error: 3 ranks but partition set {two} has 2 partitions; run 2 ranks (e.g. --procs 2 on one machine) or "
        "re-partition into 3 parts with bnsgcn-partition\n"
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nnodes", "0"], "--nnodes 0 must be at least 1"),
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank 2 is outside [0, 2)"),
        (["--node-rank", "-1"], "--node-rank -1 is outside [0, 1)"),
        (["--procs", "0"], "--procs 0 must be a positive integer"),
        (["--procs", "2", "--device", "cuda"], "--procs starts CPU ranks but --device cuda"),
        (["--master-port", "70000"], "--master-port 70000 is not a TCP port"),
        (["--p", "1.5"], "--p 1.5 is outside [0, 1]"),
    ],
)
def test_bad_launch_flags(argv, message, tmp_path, monkeypatch, capsys, clean_environment):
    monkeypatch.chdir(tmp_path)
    status, _, err = run_cli(argv, capsys)
    assert status == 2
    assert err.startswith(f"error: {message}")


def test_parts_must_split_over_nodes(tmp_path, monkeypatch, capsys, clean_environment):
    monkeypatch.chdir(tmp_path)
    make_set(tmp_path / "parts" / "three", 3)
    status, _, err = run_cli(["--nnodes", "2", "--master-addr", "10.0.0.1"], capsys)
    assert status == 2
    assert "does not split evenly over --nnodes 2" in err


def test_training_argv_drops_launch_flags():
    argv = [
        "--epochs",
        "5",
        "--procs=2",
        "--seed",
        "-1",
        "--nnodes",
        "1",
        "--out",
        "x",
        "--master-addr",
        "h",
        "--no-precompute",
    ]
    assert cli.training_argv(argv) == ["--epochs", "5", "--seed", "-1", "--out", "x", "--no-precompute"]


def test_second_node_children(tmp_path, monkeypatch, clean_environment):
    monkeypatch.chdir(tmp_path)
    make_set(tmp_path / "parts" / "four", 4)
    make_set(tmp_path / "parts" / "two", 2)
    argv = [
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--procs",
        "2",
        "--master-addr",
        "10.1.2.3",
        "--master-port",
        "29555",
        "--epochs",
        "7",
        "--threads",
        "3",
    ]
    children = cli.prepare_local_ranks(cli.build_parser().parse_args(argv), argv)
    assert [c.rank for c in children] == [2, 3]
    for local, child in enumerate(children):
        assert {
            k: child.env[k]
            for k in (
                "RANK",
                "LOCAL_RANK",
                "WORLD_SIZE",
                "LOCAL_WORLD_SIZE",
                "MASTER_ADDR",
                "MASTER_PORT",
                "OMP_NUM_THREADS",
            )
        } == {
            "RANK": str(2 + local),
            "LOCAL_RANK": str(local),
            "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "10.1.2.3",
            "MASTER_PORT": "29555",
            "OMP_NUM_THREADS": "3",
        }
        assert child.argv[:3] == [PY, "-m", "bnsgcn.launch.rank"]
        config = training_parser("rank").parse_args(child.argv[3:])
        assert (config.epochs, config.threads, config.device, config.parts_dir) == (
            7,
            3,
            "cpu",
            (tmp_path / "parts" / "four").resolve(),
        )


def test_one_cpu_rank_per_partition_by_default(tmp_path, monkeypatch, clean_environment):
    monkeypatch.chdir(tmp_path)
    make_set(tmp_path / "parts" / "three", 3)
    children = cli.prepare_local_ranks(cli.build_parser().parse_args([]), [])
    assert [c.env["RANK"] for c in children] == ["0", "1", "2"]
    assert {c.env["WORLD_SIZE"] for c in children} == {"3"}
    assert {c.env["OMP_NUM_THREADS"] for c in children} == {str(threads_per_rank(3))}
    assert children[0].argv[-6:] == [
        "--parts-dir",
        str((tmp_path / "parts" / "three").resolve()),
        "--device",
        "cpu",
        "--threads",
        str(threads_per_rank(3)),
    ]
    assert not port_in_use(int(children[0].env["MASTER_PORT"]))


def test_cpu_ranks_and_refused_flags_cost_the_launcher_no_torch_import(tmp_path, clean_environment):
    """Importing torch takes about 2 s: the launcher checks the flags, finds the set and
    prepares CPU ranks without it (every job starts that much sooner; a refused flag answers
    at once). Run in a fresh interpreter, as ``bnsgcn-train`` starts."""
    make_set(tmp_path / "parts" / "two", 2)
    probe = (
        "import sys\n"
        "from bnsgcn.launch import cli\n"
        "children = cli.prepare_local_ranks(cli.build_parser().parse_args(sys.argv[1:]), sys.argv[1:])\n"
        "assert len(children) == 2, children\n"
        "try:\n"
        "    cli.prepare_local_ranks(cli.build_parser().parse_args(['--lr', '-1']), ['--lr', '-1'])\n"
        "except Exception as exc:\n"
        "    assert str(exc).startswith('--lr -1') and 'must be positive' in str(exc), exc\n"
        "else:\n"
        "    raise AssertionError('--lr -1 was not refused')\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, "--procs", "2", "--compress", "int8", "--work-pool", "--p", "0"],
        cwd=tmp_path,
        env=clean_environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "torch imported: False", done.stdout


def _capture_training(monkeypatch) -> list:
    trained = []
    monkeypatch.setattr(cli, "train", lambda config: trained.append(config) or 0)
    return trained


def test_torchrun_rank_resumes_after_elastic_restart(tmp_path, monkeypatch, capsys, clean_environment):
    monkeypatch.chdir(tmp_path)
    make_set(tmp_path / "parts" / "two", 2)
    trained = _capture_training(monkeypatch)
    clean_environment.update(
        RANK="1",
        WORLD_SIZE="2",
        LOCAL_RANK="1",
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29577",
        TORCHELASTIC_RESTART_COUNT="1",
    )
    assert run_cli(["--procs", "2", "--out", "run", "--epochs", "3"], capsys)[0] == 0
    clean_environment["TORCHELASTIC_RESTART_COUNT"] = "0"
    assert run_cli(["--procs", "2", "--out", "run", "--epochs", "3"], capsys)[0] == 0
    resumed, fresh = trained
    assert (resumed.checkpoint.resume, fresh.checkpoint.resume) == (True, False)
    assert (resumed.run.device, resumed.data.parts_dir, resumed.run.epochs, resumed.run.threads) == (
        "cpu",
        (tmp_path / "parts" / "two").resolve(),
        3,
        threads_per_rank(2),
    )


def test_torchrun_restart_without_out_warns_and_starts_fresh(tmp_path, monkeypatch, capsys, clean_environment):
    monkeypatch.chdir(tmp_path)
    make_set(tmp_path / "parts" / "two", 2)
    trained = _capture_training(monkeypatch)
    clean_environment.update(
        RANK="0",
        WORLD_SIZE="2",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29577",
        TORCHELASTIC_RESTART_COUNT="2",
    )
    status, out, err = run_cli(["--procs", "2"], capsys)
    assert status == 0
    assert "using partition set parts/two" in out  # rank 0 tells which set it took
    assert "restart 2 (TORCHELASTIC_RESTART_COUNT) without --out starts a new run" in err
    assert trained[0].checkpoint.resume is False


def test_slurm_task_runs_one_rank(tmp_path, monkeypatch, capsys, clean_environment):
    monkeypatch.chdir(tmp_path)
    make_set(tmp_path / "parts" / "two", 2)
    trained = _capture_training(monkeypatch)
    resolved = []  # cn5 does not resolve here: record the check instead
    monkeypatch.setattr(cli, "check_master_address", resolved.append)
    clean_environment.update(
        SLURM_PROCID="1",
        SLURM_NTASKS="2",
        SLURM_LOCALID="0",
        SLURM_STEP_ID="0",
        SLURM_JOB_NODELIST="cn[5-6]",
        SLURM_NNODES="2",
        SLURM_JOB_ID="64242",
    )
    status, out, _ = run_cli(["--procs", "2", "--epochs", "2"], capsys)
    assert status == 0
    assert out == ""  # only rank 0 announces the set
    assert resolved == ["cn5"]
    # the default port comes from the job id: 20000 + 64242 % 20000
    assert {k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")} == {
        "MASTER_ADDR": "cn5",
        "MASTER_PORT": "24242",
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
    }
    assert launch_info() == {"mode": "slurm", "job_id": "64242", "nodes": ["cn5", "cn6"]}
    assert trained[0].run.device == "cpu"


def test_rank_mode_errors_carry_the_rank(tmp_path, monkeypatch, capsys, clean_environment):
    monkeypatch.chdir(tmp_path)
    make_set(tmp_path / "parts" / "two", 2)
    trained = _capture_training(monkeypatch)
    clean_environment.update(RANK="2", WORLD_SIZE="3", LOCAL_RANK="0")
    status, _, err = run_cli(["--procs", "1"], capsys)
    assert status == 2
    assert err.startswith("error: [rank 2] no partition set with 3 parts under parts/ (found: parts/two (2 parts))")
    assert trained == []


def test_ranks_get_huge_pages_unless_the_user_chose(tmp_path, monkeypatch, clean_environment):
    monkeypatch.chdir(tmp_path)
    make_set(tmp_path / "parts" / "two", 2)
    clean_environment.pop("THP_MEM_ALLOC_ENABLE", None)
    children = cli.prepare_local_ranks(cli.build_parser().parse_args([]), [])
    assert {c.env["THP_MEM_ALLOC_ENABLE"] for c in children} == {"1"}
    clean_environment["THP_MEM_ALLOC_ENABLE"] = "0"
    children = cli.prepare_local_ranks(cli.build_parser().parse_args([]), [])
    assert {c.env["THP_MEM_ALLOC_ENABLE"] for c in children} == {"0"}


# --- SLURM and torchrun behaviour, without a cluster -------------------------------------------


def test_restart_count_of_torchrun_or_a_requeued_slurm_job():
    assert restart_count({}) == (0, "")
    assert restart_count({"TORCHELASTIC_RESTART_COUNT": "2"}) == (2, "TORCHELASTIC_RESTART_COUNT")
    # torchrun started by a requeued SLURM job: torchrun's own count is 0
    assert restart_count({"TORCHELASTIC_RESTART_COUNT": "0", "SLURM_RESTART_COUNT": "1"}) == (1, "SLURM_RESTART_COUNT")


def test_default_master_port_derives_from_the_slurm_job_id():
    assert default_master_port({}) == 29500
    assert default_master_port({"SLURM_JOB_ID": "123"}) == 20123
    assert default_master_port({"SLURM_JOB_ID": "64242"}) == 24242
    # two jobs on one node get different ports, all below the ephemeral range
    ports = {default_master_port({"SLURM_JOB_ID": str(job)}) for job in range(1000, 1100)}
    assert len(ports) == 100 and max(ports) < 32768 and min(ports) >= 20000


def test_per_node_launcher_under_slurm_takes_the_job_port_and_resumes_after_requeue(
    tmp_path, monkeypatch, clean_environment
):
    monkeypatch.chdir(tmp_path)
    make_set(tmp_path / "parts" / "four", 4)
    clean_environment.update(
        SLURM_PROCID="1",
        SLURM_NTASKS="2",
        SLURM_LOCALID="0",
        SLURM_STEP_ID="0",
        SLURM_JOB_NODELIST="localhost,cn7",
        SLURM_NNODES="2",
        SLURM_JOB_ID="777",
        SLURM_RESTART_COUNT="1",
    )
    argv = ["--nnodes", "2", "--node-rank", "1", "--procs", "2", "--out", "run"]
    children = cli.prepare_local_ranks(cli.build_parser().parse_args(argv), argv)
    assert {c.env["MASTER_PORT"] for c in children} == {"20777"}
    assert {c.env["MASTER_ADDR"] for c in children} == {"localhost"}  # first node of the job
    assert all("--resume" in c.argv for c in children)  # requeued: continue from --out's checkpoints
    assert json.loads(children[0].env["BNSGCN_LAUNCH"]) == {
        "mode": "local",
        "job_id": "777",
        "nodes": ["localhost", "cn7"],
    }
    clean_environment["SLURM_RESTART_COUNT"] = "0"
    children = cli.prepare_local_ranks(cli.build_parser().parse_args(argv), argv)
    assert not any("--resume" in c.argv for c in children)


def test_slurm_task_resumes_after_requeue(tmp_path, monkeypatch, capsys, clean_environment):
    monkeypatch.chdir(tmp_path)
    make_set(tmp_path / "parts" / "two", 2)
    trained = _capture_training(monkeypatch)
    clean_environment.update(
        SLURM_PROCID="0",
        SLURM_NTASKS="2",
        SLURM_LOCALID="0",
        SLURM_STEP_ID="0",
        SLURM_JOB_NODELIST="localhost",
        SLURM_JOB_ID="9",
        SLURM_RESTART_COUNT="2",
    )
    monkeypatch.setattr(cli, "port_in_use", lambda port: False)
    assert run_cli(["--out", "run", "--epochs", "2"], capsys)[0] == 0
    status, _, err = run_cli(["--epochs", "2"], capsys)  # no --out: nothing to resume from
    assert status == 0
    assert "restart 2 (SLURM_RESTART_COUNT) without --out starts a new run" in err
    assert [c.checkpoint.resume for c in trained] == [True, False]


def test_too_many_launchers_per_node_are_refused(tmp_path, monkeypatch, capsys, clean_environment):
    """srun --ntasks-per-node=1 inside an allocation of 4 tasks per node still starts
    SLURM_NTASKS tasks: each would start its own ranks. Refused before any rank starts."""
    monkeypatch.chdir(tmp_path)
    make_set(tmp_path / "parts" / "two", 2)
    clean_environment.update(
        SLURM_PROCID="3",
        SLURM_NTASKS="8",
        SLURM_LOCALID="1",
        SLURM_STEP_ID="0",
        SLURM_JOB_NODELIST="localhost,cn2",
        SLURM_NNODES="2",
    )
    monkeypatch.setattr(cli, "supervise", lambda children: pytest.fail("ranks were started"))
    status, _, err = run_cli(["--nnodes", "2", "--node-rank", "1", "--procs", "1"], capsys)
    assert status == 2
    assert err.startswith(
        "error: this srun step runs 8 copies of bnsgcn-train for --nnodes 2; start one per node: srun -n "
        "$SLURM_NNODES --ntasks-per-node=1 "
    )


def test_slurm_task_count_must_match_the_partition_set(tmp_path, monkeypatch, capsys, clean_environment):
    monkeypatch.chdir(tmp_path)
    two = make_set(tmp_path / "two", 2)
    trained = _capture_training(monkeypatch)
    clean_environment.update(
        SLURM_PROCID="0", SLURM_NTASKS="3", SLURM_LOCALID="0", SLURM_STEP_ID="0", SLURM_JOB_NODELIST="localhost"
    )
    status, _, err = run_cli(["--parts-dir", str(two)], capsys)
    assert status == 2
    assert err.startswith(f"error: [rank 0] 3 ranks but partition set {two} has 2 partitions")
    assert trained == []


@pytest.mark.parametrize("mode_env", [{}, {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}])
def test_master_address_that_does_not_resolve_fails_at_once(mode_env, tmp_path, monkeypatch, capsys, clean_environment):
    monkeypatch.chdir(tmp_path)
    make_set(tmp_path / "parts" / "two", 2)
    trained = _capture_training(monkeypatch)
    monkeypatch.setattr(cli, "supervise", lambda children: pytest.fail("ranks were started"))
    clean_environment.update(mode_env)
    start = time.monotonic()
    status, _, err = run_cli(["--procs", "2", "--nnodes", "1", "--master-addr", "no-such-host.invalid"], capsys)
    assert time.monotonic() - start < 10
    assert status == 2
    rank = "[rank 1] " if mode_env else ""
    assert re.fullmatch(
        rf"error: {re.escape(rank)}master address 'no-such-host.invalid' does not resolve \([^)]*\); pass "
        r"--master-addr .*\n",
        err,
    )
    assert trained == []


def test_torchrun_error_file_records_the_rank_error(tmp_path, monkeypatch, capsys):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))

    def fail() -> int:
        raise UserError("--p 2 is outside [0, 1]")

    assert report_errors(fail, rank=3, debug=False) == 2
    assert capsys.readouterr().err == "error: [rank 3] --p 2 is outside [0, 1]\n"
    recorded = json.loads(error_file.read_text())["message"]
    assert recorded["message"] == "UserError: --p 2 is outside [0, 1]"
    assert "Traceback" in recorded["extraInfo"]["py_callstack"]


def test_report_errors_stop_signal_and_named_peer(capsys):
    def stopped() -> int:
        raise JobStopped("stopped by SIGUSR1 after epoch 4, checkpoint written", signal.SIGUSR1)

    assert report_errors(stopped, rank=0, debug=False) == 128 + signal.SIGUSR1
    assert capsys.readouterr().err == "error: [rank 0] stopped by SIGUSR1 after epoch 4, checkpoint written\n"

    def lost() -> int:
        raise PeerLost(
            "communication with the other ranks failed: Timed out; rank 3 stopped at epoch 7 while the others waited"
        )

    assert report_errors(lost, rank=1, debug=False) == 4
    assert capsys.readouterr().err.endswith("; rank 3 stopped at epoch 7 while the others waited\n")


def test_one_device_rule_for_launcher_and_engine(tmp_path, monkeypatch, clean_environment):
    import torch

    import bnsgcn.comm.communicator

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert (
        resolve_device("auto", 2),
        resolve_device("auto", 3),
        resolve_device("cpu", 1),
        resolve_device("cuda", 8),
    ) == ("cuda", "cpu", "cpu", "cuda")
    assert bnsgcn.comm.communicator.resolve_device is resolve_device  # the engine's ranks decide by the same rule
    monkeypatch.chdir(tmp_path)
    make_set(tmp_path / "parts" / "two", 2)
    make_set(tmp_path / "parts" / "three", 3)
    argv = ["--parts-dir", "parts/two"]
    assert {
        c.argv[c.argv.index("--device") + 1] for c in cli.prepare_local_ranks(cli.build_parser().parse_args(argv), argv)
    } == {"cuda"}
    argv = ["--parts-dir", "parts/three"]  # three local ranks, two GPUs: CPU
    assert {
        c.argv[c.argv.index("--device") + 1] for c in cli.prepare_local_ranks(cli.build_parser().parse_args(argv), argv)
    } == {"cpu"}


def test_ranks_sharing_a_gpu_take_consecutive_local_ranks_and_gloo():
    """Local rank L on GPU L // N; ceil(ranks / N) GPUs; NCCL only with one rank per GPU."""
    assert [gpu_index(local, 1) for local in range(4)] == [0, 1, 2, 3]
    assert [gpu_index(local, 2) for local in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [gpu_index(local, 4) for local in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [gpus_needed(ranks, 3) for ranks in (1, 3, 4, 6, 7)] == [1, 1, 2, 2, 3]
    assert (backend_for("cuda", 1), backend_for("cuda", 2), backend_for("cpu", 1), backend_for("cpu", 4)) == (
        "nccl",
        "gloo",
        "gloo",
        "gloo",
    )


def test_auto_device_counts_gpus_per_ranks_per_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert [resolve_device("auto", 4, n) for n in (1, 2, 3, 4, 8)] == ["cpu", "cpu", "cpu", "cuda", "cuda"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [resolve_device("auto", 4, n) for n in (1, 2)] == ["cpu", "cuda"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert resolve_device("auto", 1, 4) == "cpu" and resolve_device("cuda", 4, 4) == "cuda"


@pytest.mark.parametrize(
    "argv, gpus, expected",
    [
        (
            ["--procs", "2", "--ranks-per-gpu", "2"],
            1,
            "--ranks-per-gpu 2 shares CUDA GPUs among ranks but --procs 2 starts CPU ranks; pass --gpus G (2 ranks on "
            "each of G GPUs) or --device cuda, or drop --ranks-per-gpu",
        ),
        (["--ranks-per-gpu", "2"], 1, "--ranks-per-gpu 2 shares CUDA GPUs among ranks but no --gpus was given;"),
        (
            ["--device", "cpu", "--ranks-per-gpu", "3"],
            1,
            "--ranks-per-gpu 3 shares CUDA GPUs among ranks but --device cpu was given; pass --gpus G (3 ranks",
        ),
        (["--gpus", "1", "--ranks-per-gpu", "0"], 1, "--ranks-per-gpu 0 must be a positive integer"),
        (
            ["--gpus", "2", "--ranks-per-gpu", "2"],
            1,
            "--gpus 2 --ranks-per-gpu 2 needs 2 CUDA GPUs but this machine has 1; share it with --gpus 1 "
            "--ranks-per-gpu 4, or run on CPU with --procs 4 instead",
        ),
        (
            ["--gpus", "4"],
            2,
            "--gpus 4 needs 4 CUDA GPUs but this machine has 2; share them with --gpus 2 --ranks-per-gpu 2, or run on "
            "CPU with --procs 4 instead",
        ),
        (
            ["--device", "cuda", "--ranks-per-gpu", "2", "--parts-dir", "parts/six"],
            2,
            "--device cuda --ranks-per-gpu 2 with 6 ranks on this machine needs 3 CUDA GPUs but this machine has 2; "
            "share them with --gpus 2 --ranks-per-gpu 3",
        ),
    ],
)
def test_ranks_per_gpu_refused_in_one_line(tmp_path, monkeypatch, capsys, clean_environment, argv, gpus, expected):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.chdir(tmp_path)
    if "parts/six" in argv:
        make_set(tmp_path / "parts" / "six", 6)
    status, out, err = run_cli(argv, capsys)
    assert status == 2 and out == ""
    assert err.startswith(f"error: {expected}") and err.count("\n") == 1, err


def test_launcher_starts_ranks_per_gpu_times_gpus_and_passes_n_down(tmp_path, monkeypatch, clean_environment):
    """--gpus 1 --ranks-per-gpu 4 on a one-GPU machine: four CUDA ranks, every one told N
    (the setting config.json records), so each takes GPU 0 by the engine's rule."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.chdir(tmp_path)
    make_set(tmp_path / "parts" / "four", 4)
    command = ["--gpus", "1", "--ranks-per-gpu", "4", "--epochs", "2"]
    api = [*to_argv(TrainConfig.from_settings(ranks_per_gpu=4, epochs=2)), "--gpus=1"]  # bnsgcn.train's flags
    for argv in (command, api):
        children = cli.prepare_local_ranks(cli.build_parser().parse_args(argv), argv)
        assert [c.env["LOCAL_RANK"] for c in children] == ["0", "1", "2", "3"]
        assert {(c.env["WORLD_SIZE"], c.env["LOCAL_WORLD_SIZE"]) for c in children} == {("4", "4")}
        for child in children:
            config = from_args(training_parser("rank").parse_args(child.argv[3:]))
            assert (config.run.device, config.run.ranks_per_gpu, config.run.epochs) == ("cuda", 4, 2)
            assert config.to_json()["ranks_per_gpu"] == 4
            assert gpu_index(int(child.env["LOCAL_RANK"]), config.run.ranks_per_gpu) == 0


def test_one_rank_of_torchrun_resolves_auto_with_ranks_per_gpu(tmp_path, monkeypatch, clean_environment):
    """Under torchrun --device auto takes CUDA when the machine has a GPU per N local ranks;
    --device cpu with N above 1 is refused."""
    import torch

    monkeypatch.chdir(tmp_path)
    make_set(tmp_path / "parts" / "two", 2)
    ranks = RankEnvironment("torchrun", 0, 2, 0, 2, "127.0.0.1", free_port(), 1)
    for gpus, device in ((1, "cuda"), (0, "cpu")):
        monkeypatch.setattr(torch.cuda, "device_count", lambda gpus=gpus: gpus)
        config = cli.prepare_rank(cli.build_parser().parse_args(["--ranks-per-gpu", "2"]), ranks)
        assert (config.run.device, config.run.ranks_per_gpu) == (device, 2)
    with pytest.raises(UserError, match="^--ranks-per-gpu 2 shares CUDA GPUs among ranks but --device cpu was given"):
        cli.prepare_rank(cli.build_parser().parse_args(["--device", "cpu", "--ranks-per-gpu", "2"]), ranks)


def test_run_directory_name_carries_the_job():
    assert run_name_suffix({"mode": "slurm", "job_id": "4242", "nodes": ["a"]}) == "-slurm-4242"
    assert run_name_suffix({"mode": "torchrun", "job_id": "none", "nodes": None}) == ""  # torchrun --standalone
    assert run_name_suffix({"mode": None, "job_id": None, "nodes": None}) == ""
    assert launch_info({}) == {"mode": None, "job_id": None, "nodes": None}


def test_sigusr1_to_the_launcher_is_passed_to_every_rank():
    """A batch system's warning (sbatch --signal=USR1@...) reaches the ranks, which save a
    checkpoint and exit (stand-ins here exit 138 as the engine does)."""
    rank = (
        PRINT_PID
        + "; import signal, sys, time; signal.signal(signal.SIGUSR1, lambda *_: sys.exit(138)); time.sleep(60)"
    )
    script = (
        "import sys\nfrom bnsgcn.launch.supervisor import Child, supervise\n"
        f"sys.exit(supervise([Child(r, [sys.executable, '-c', {rank!r}]) for r in range(2)]))\n"
    )
    launcher = subprocess.Popen([PY, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(30, launcher.kill)
    watchdog.start()
    try:
        pids = [int(launcher.stdout.readline().split()[1]) for _ in range(2)]
        time.sleep(0.5)  # the stand-ins install their handler after printing
        launcher.send_signal(signal.SIGUSR1)
        _, err = launcher.communicate(timeout=20)
    finally:
        watchdog.cancel()
        launcher.kill()
    assert launcher.returncode == 138
    assert re.search(r"error: rank [01] failed \(exit code 138\)", err), err
    assert all(is_gone(pid) for pid in pids)
