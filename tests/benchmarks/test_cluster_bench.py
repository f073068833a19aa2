"""The emulated-cluster benchmark (benchmarks/cluster.py) and time to accuracy (benchmarks/accuracy.py).

The namespace tests need root and ``ip``/``tc``/``unshare``; where those are missing they
are skipped with the reason. Nothing here trains: the smoke run is in docs/benchmarks.md.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from benchmarks import cluster as cl
from benchmarks.accuracy import (
    attach_time_to_accuracy,
    time_to_accuracy,
    validation_curve,
)

from ..helpers import REPO

TINY = "synthetic:nodes=400,degree=4,classes=4,features=8"


# ---------------------------------------------------------------------------- time to accuracy


def epoch(n: int, seconds: float, evaluation: float = 0.0, val: float | None = None) -> dict:
    """A metrics.jsonl epoch line; ``seconds`` is time.epoch, evaluation included."""
    record = {"epoch": n, "loss": 1.0, "time": {"epoch": seconds, "evaluation": evaluation}}
    return record if val is None else record | {"val_score": val, "test_score": val}


def test_reached_at_epoch_k_counts_every_epoch_before_it():
    records = [
        epoch(1, 1.0, val=0.2),
        epoch(2, 1.0),
        epoch(3, 1.0, val=0.7),
        epoch(4, 1.0, val=0.9),
        {"summary": True, "best_val_score": 0.9},
    ]
    curve = validation_curve(records)
    assert curve == [(1, 1.0, 0.2), (3, 3.0, 0.7), (4, 4.0, 0.9)]
    assert time_to_accuracy(curve, 0.7) == {"target": 0.7, "epochs": 3, "seconds": 3.0}  # reaching counts: >=
    assert time_to_accuracy(curve, 0.5)["epochs"] == 3


def test_never_reached_is_none():
    assert time_to_accuracy(validation_curve([epoch(1, 1.0, val=0.5), epoch(2, 1.0, val=0.6)]), 0.61) is None
    assert time_to_accuracy([], 0.1) is None


def test_evaluation_time_is_excluded():
    # 2 s epochs of which 1.5 s evaluate: 0.5 s of training each, also in epochs without evaluation.
    curve = validation_curve([epoch(1, 2.0, 1.5, val=0.1), epoch(2, 0.5), epoch(3, 2.0, 1.5, val=0.8)])
    assert time_to_accuracy(curve, 0.8) == pytest.approx({"target": 0.8, "epochs": 3, "seconds": 1.5})


def run(p: float, vals: list[float], config: str = "a") -> dict:
    return {
        "p": p,
        "config": config,
        "val_curve": validation_curve([epoch(i + 1, 1.0, val=v) for i, v in enumerate(vals)]),
    }


def test_target_is_99_percent_of_the_p1_run_of_the_same_configuration():
    full, sampled, slow, other, once, failed = (
        run(1.0, [0.5, 0.9, 1.0]),
        run(0.1, [0.8, 0.99, 0.95]),
        run(0.01, [0.3, 0.5, 0.6]),
        run(0.1, [0.9, 0.9], config="b"),
        run(0.1, [0.99]),
        run(0.1, [0.5, 0.5]) | {"error": "node 1 failed"},
    )
    attach_time_to_accuracy([sampled, full, slow, other, once, failed], config=lambda r: r["config"])
    assert full["time_to_accuracy"] == {"target": 0.99, "epochs": 3, "seconds": 3.0}
    assert sampled["time_to_accuracy"] == {"target": 0.99, "epochs": 2, "seconds": 2.0}
    assert slow["time_to_accuracy"] == {"target": 0.99, "epochs": None, "seconds": None}
    assert other["time_to_accuracy"] is None  # no p = 1 run of configuration "b"
    assert once["time_to_accuracy"] is None  # evaluated once: too rarely to say
    assert "time_to_accuracy" not in failed


# ---------------------------------------------------------------------------- rates


def test_rates_parse_as_tc_reads_them():
    assert cl.parse_rate("1gbit") == 10**9
    assert cl.parse_rate("10Gbit") == 10**10
    assert cl.parse_rate("125mbps") == 10**9  # bytes per second
    assert cl.parse_rate("1gibit") == 2**30
    assert cl.parse_rate("none") is None
    with pytest.raises(cl.UserError, match="is not a rate"):
        cl.parse_rate("fast")
    assert cl.burst_bytes(10**10) == 1_250_000  # 1 ms at the rate
    assert cl.burst_bytes(10**8) == cl.MIN_BURST  # never below two 64 KiB GSO packets


def test_dry_run_prints_the_plan_without_root():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.cluster",
            "--graph",
            TINY,
            "--p",
            "1",
            "0.1",
            "--exchange",
            "direct",
            "--link",
            "1gbit",
            "none",
            "--dry-run",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert sum("--node-rank" in line for line in lines) == 2 * 2 * 2  # links x p x nodes
    assert sum(line.startswith("tc ") for line in lines) == 4  # 1gbit only: 2 nodes x 2 link ends
    assert any("GLOO_SOCKET_IFNAME=eth0" in line and "--exchange direct" in line for line in lines)


# ---------------------------------------------------------------------------- the one error line


def test_without_root_one_error_line_and_exit_2():
    command = [sys.executable, "-m", "benchmarks.cluster", "--graph", TINY, "--epochs", "1"]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root and setpriv (util-linux) is missing: cannot run the module as a non-root user")
        command = ["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups", *command]
    before = namespaces_or_empty()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: the emulated cluster needs root (network namespaces); run as root or with sudo"
    ]
    assert namespaces_or_empty() == before


def test_without_tc_on_path_one_error_line_and_exit_2():
    if os.geteuid() != 0:
        pytest.skip("not root: the module stops at the root check before it looks for tools")
    env = os.environ | {"PATH": "/nonexistent"}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.cluster", "--graph", TINY],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("error: the emulated cluster needs ip, tc, unshare on PATH; install iproute2")


# ---------------------------------------------------------------------------- namespaces


def namespaces_or_empty() -> list[str]:
    return cl.namespaces() if shutil.which("ip") else []


@pytest.fixture(scope="module")
def netns():
    """Skip, saying why, unless this machine lets us make network namespaces."""
    try:
        cl.check_requirements()
    except cl.UserError as exc:
        pytest.skip(str(exc))
    probe = f"bnsgcn-cltest-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace: {made.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], check=True)


def host_veths() -> list[str]:
    return subprocess.run(
        ["ip", "-o", "link", "show", "type", "veth"], capture_output=True, text=True, check=True
    ).stdout.splitlines()


def ours() -> list[str]:
    return [ns for ns in cl.namespaces() if ns.startswith(f"{cl.PREFIX}-{os.getpid()}-")]


def test_cluster_is_built_capped_and_removed(netns):
    veths = host_veths()
    with cl.emulated_cluster(2, cl.parse_rate("100mbit")) as cluster:
        assert sorted(ours()) == sorted(cluster.namespaces)
        for i in range(2):
            eth0 = subprocess.run(
                ["ip", "-n", cluster.node(i), "-br", "addr", "show", "dev", "eth0"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            assert "UP" in eth0 and f"{cluster.address(i)}/24" in eth0
            assert (
                "UNKNOWN"
                in subprocess.run(
                    ["ip", "-n", cluster.node(i), "-br", "link", "show", "dev", "lo"], capture_output=True, text=True
                ).stdout
            )
        assert host_veths() == veths  # every veth end lives in the cluster's namespaces
        before = cl.link_counters(cluster)
        gbits = cl.measure_link(cluster, mib=6)
        assert 0.1 * 0.65 <= gbits <= 0.1 * 1.35
        after = cl.link_counters(cluster)
        sent_by_0, received_by_1 = after[0][0] - before[0][0], after[1][1] - before[1][1]
        assert sent_by_0 >= 6 * 2**20 and received_by_1 >= 6 * 2**20  # the counters saw it cross both links
    assert ours() == []
    assert host_veths() == veths


def test_leftovers_of_a_dead_process_are_removed(netns):
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover, alive = f"{cl.PREFIX}-{dead.pid}-n0", f"{cl.PREFIX}-{os.getpid()}-n7"
    for ns in (leftover, alive):
        subprocess.run(["ip", "netns", "add", ns], check=True)
    inside = subprocess.Popen(["ip", "netns", "exec", leftover, "sleep", "60"])
    try:
        time.sleep(0.2)
        assert cl.remove_leftovers() == [leftover]
        assert inside.wait(timeout=5) == -signal.SIGKILL
        remaining = cl.namespaces()
        assert leftover not in remaining and alive in remaining  # a live owner's cluster stays
    finally:
        inside.kill()
        for ns in (leftover, alive):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_sigterm_removes_the_cluster(netns, tmp_path):
    bench = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "benchmarks.cluster",
            "--graph",
            TINY,
            "--link",
            "none",
            "--p",
            "1",
            "--exchange",
            "direct",
            "--epochs",
            "50",
            "--work",
            str(tmp_path),
            "--out",
            str(tmp_path / "cluster.json"),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    prefix = f"{cl.PREFIX}-{bench.pid}-"
    deadline = time.monotonic() + 60
    while not any(ns.startswith(prefix) for ns in cl.namespaces()):
        assert bench.poll() is None and time.monotonic() < deadline, bench.communicate()
        time.sleep(0.1)
    time.sleep(1.0)  # into the link probe or the run
    bench.send_signal(signal.SIGTERM)
    _, err = bench.communicate(timeout=30)
    assert bench.returncode == 128 + signal.SIGTERM, err
    assert "the emulated cluster was removed" in err
    assert not any(ns.startswith(prefix) for ns in cl.namespaces())
