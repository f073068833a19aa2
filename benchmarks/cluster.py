"""An emulated GPU cluster on one machine: nodes joined by rate-limited network links.

    python -m benchmarks.cluster --nodes 2 --ranks-per-node 2 --link 1gbit \\
        --graph synthetic:nodes=20000,degree=20,classes=8,features=64 \\
        --p 1 0.1 --exchange direct hierarchical --epochs 5
    python -m benchmarks.cluster ... --link 1gbit 10gbit none --method metis random
    python -m benchmarks.cluster ... --dry-run                 # print the plan, run nothing
    python -m benchmarks.cluster --render benchmarks/results/cluster.json   # tables again
    python -m benchmarks.cluster ... -- --dropout 0.2          # more bnsgcn-train flags

Why: on GPUs aggregation runs about 100x faster than on this CPU while the links between
machines are only a few times faster than loopback, so a CPU run over loopback spends ~1%
of its epoch communicating where a GPU cluster spends over half. Capping the links between
emulated nodes at about 1 Gbit/s restores the cluster's ratio of communication to compute.

What it builds (needs root: network namespaces; nothing is added to the host's network):

* a namespace per node, ``bnsgcn-cl-<pid>-n<i>``, with ``lo`` up and ``eth0`` at
  10.213.0.<i+1>/24. Ranks of one node talk through ``lo`` (the kernel routes traffic to a
  local address there, whatever the address), at full speed;
* a switch namespace ``bnsgcn-cl-<pid>-sw`` with a bridge. Each node's ``eth0`` is one end of
  a veth pair created inside the switch namespace with that end placed straight into the
  node's namespace; the other end, ``n<i>``, is a bridge port;
* with ``--link RATE``, a token bucket (``tc qdisc tbf``) on both ends of every pair, so
  each node's link is capped in both directions.

Every run starts, in each node's namespace, ``bnsgcn-train`` (``python -m bnsgcn.launch.cli``)
exactly as on a real machine (``--nnodes``, ``--node-rank``, ``--master-addr`` = node 0),
with ``GLOO_SOCKET_IFNAME=eth0`` and a host name of its own (``node<i>``, in a fresh UTS
namespace). The first failing node stops the others and the run is recorded with its error.
Before the runs of each link the link is measured (a TCP transfer from node 0 to node 1);
around every run the bytes through each node's ``eth0`` are read. Records (one per run,
rewritten atomically after every run into ``--out``), tables on stdout and a figure are
described in docs/benchmarks.md ("Emulated cluster").

Clean-up: every namespace this process made, and every process inside, is removed at exit,
after a failure, Ctrl-C or SIGTERM; leftovers of a process that no longer exists (killed
with SIGKILL) are removed at the start of the next invocation.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runnable from a checkout without installing the package
    sys.path.insert(0, str(REPO))

from benchmarks.accuracy import attach_time_to_accuracy  # noqa: E402
from benchmarks.suite import (  # noqa: E402
    MODELS,
    MiB,
    _table,
    executable,
    execute,
    machine,
    read_train_run,
    size_flags,
    threads_per_rank,
    time_to_accuracy_cell,
    write_json,
)
from bnsgcn.errors import UserError  # noqa: E402
from bnsgcn.metrics import report  # noqa: E402

PREFIX = "bnsgcn-cl"
SUBNET = "10.213.0"
MASTER_PORT = 29500  # every node namespace is a fresh network stack: no one else holds it
PROBE_PORT = 5201
PROBE_MIB = 48  # 0.4 s at 1 Gbit/s
# The token bucket holds 1 ms of traffic at the rate, at least 128 KiB. It must hold the
# largest packet tbf is handed (veth passes 64 KiB GSO packets; with a 64 KiB bucket tbf
# splits them and 10gbit reached 3.2 Gbit/s), and tc(8)'s rule of rate / HZ (4 ms here) is
# for tick-based timers: tbf now sleeps on high-resolution timers, and 1 ms reached 9.5
# Gbit/s at 10gbit (this machine's veth limit). More is worse: bursts up to the bucket pass
# uncapped (a 5 MB bucket made a 48 MiB transfer at 10gbit read 10.45 Gbit/s).
BURST_SECONDS = 1e-3
MIN_BURST = 128 * 1024
QUEUE_LATENCY = "50ms"  # tbf's queue: bytes that may wait, as time at the rate
KILL_GRACE_S = 5.0
TIME_KEYS = ("sampling", "exchange", "compute", "reduction", "idle", "evaluation")
ENGINE_KINDS = ("features", "gradients", "selections", "evaluation", "control")
# tc's rate units (tc(8), "RATES"): bits per second, bytes per second for ...bps; k, m,
# g, t are powers of 1000, ki, mi, gi, ti of 1024.
RATE_UNITS = {"": 1, "bit": 1, "bps": 8} | {
    f"{prefix}{binary}{unit}": (1024 if binary else 1000) ** power * bits
    for power, prefix in enumerate("kmgt", 1)
    for binary in ("", "i")
    for unit, bits in (("bit", 1), ("bps", 8))
}


class Interrupted(Exception):
    """SIGTERM or SIGHUP arrived: unwind (removing the cluster) and exit 128 + signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum: int, _frame: object) -> None:
    raise Interrupted(signum)


# ---------------------------------------------------------------------------- the links


def parse_rate(text: str) -> int | None:
    """A ``--link`` value in bits per second (tc's units: ``1gbit``, ``100mbit``, ``125mbps``);
    None for ``none`` (no cap)."""
    if text.lower() == "none":
        return None
    match = re.fullmatch(r"(\d+(?:\.\d*)?)([a-z]*)", text.lower())
    if not match or match[2] not in RATE_UNITS or float(match[1]) <= 0:
        raise UserError(
            f"--link {text!r} is not a rate; pass one as tc writes it (e.g. 1gbit, 10gbit, 100mbit) or none"
        )
    return round(float(match[1]) * RATE_UNITS[match[2]])


def burst_bytes(rate: int) -> int:
    """The token bucket's size for a rate in bits per second (see :data:`BURST_SECONDS`)."""
    return max(MIN_BURST, round(rate / 8 * BURST_SECONDS))


def check_requirements() -> None:
    """Fail with one line unless this process can make network namespaces."""
    if os.geteuid() != 0:
        raise UserError("the emulated cluster needs root (network namespaces); run as root or with sudo")
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        raise UserError(
            f"the emulated cluster needs {', '.join(missing)} on PATH; "
            "install iproute2 (ip, tc) and util-linux (unshare)"
        )


@dataclass(frozen=True)
class Cluster:
    """The names and addresses of one emulated cluster (made by :func:`emulated_cluster`)."""

    owner: int  # pid of the process that made it: tells leftovers from live clusters
    nodes: int

    @property
    def switch(self) -> str:
        return f"{PREFIX}-{self.owner}-sw"

    def node(self, i: int) -> str:
        return f"{PREFIX}-{self.owner}-n{i}"

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    @property
    def namespaces(self) -> list[str]:
        return [self.node(i) for i in range(self.nodes)] + [self.switch]

    def link_ends(self) -> Iterator[tuple[str, str]]:
        """(namespace, device) of both ends of every node's link."""
        for i in range(self.nodes):
            yield self.node(i), "eth0"
            yield self.switch, f"n{i}"


def build_commands(cluster: Cluster) -> list[list[str]]:
    """The ``ip`` commands that make the namespaces, the bridge and the veth pairs."""
    sw = cluster.switch
    commands = [
        ["ip", "netns", "add", sw],
        ["ip", "-n", sw, "link", "add", "br0", "type", "bridge"],
        ["ip", "-n", sw, "link", "set", "br0", "up"],
    ]
    for i in range(cluster.nodes):
        ns, port = cluster.node(i), f"n{i}"
        commands += [
            ["ip", "netns", "add", ns],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            # Made inside the switch namespace, its peer created directly in the node's:
            # neither end ever exists in the host's namespace.
            ["ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns],
            ["ip", "-n", ns, "addr", "add", f"{cluster.address(i)}/24", "dev", "eth0"],
            ["ip", "-n", ns, "link", "set", "eth0", "up"],
            ["ip", "-n", sw, "link", "set", port, "master", "br0"],
            ["ip", "-n", sw, "link", "set", port, "up"],
        ]
    return commands


def link_commands(cluster: Cluster, rate: int | None) -> list[list[str]]:
    """The ``tc`` commands that cap every link at ``rate`` bits/s (none for no cap)."""
    if rate is None:
        return []
    tbf = ["tbf", "rate", f"{rate}bit", "burst", str(burst_bytes(rate)), "latency", QUEUE_LATENCY]
    return [["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *tbf] for ns, dev in cluster.link_ends()]


def sh(command: list[str], check: bool = True) -> str:
    """Run a set-up command; its stdout. A failure raises :class:`UserError` with its message."""
    done = subprocess.run(command, capture_output=True, text=True)
    if check and done.returncode != 0:
        message = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise UserError(
            f"`{shlex.join(command)}` failed: {message}; "
            "the emulated cluster needs network namespaces, veth, bridge and tbf support"
        )
    return done.stdout


def set_link(cluster: Cluster, rate: int | None) -> None:
    """Cap every link at ``rate`` (replacing the previous cap), or remove the cap."""
    for ns, dev in cluster.link_ends():
        sh(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)  # nothing there is fine
    for command in link_commands(cluster, rate):
        sh(command)


def namespaces() -> list[str]:
    """Names of the network namespaces ``ip netns`` knows."""
    listed = sh(["ip", "-j", "netns", "list"]).strip()
    return [entry["name"] for entry in json.loads(listed)] if listed else []


def kill_processes(ns: str) -> None:
    """SIGKILL every process in namespace ``ns`` and wait until none is left."""
    deadline = time.monotonic() + KILL_GRACE_S
    while pids := [int(pid) for pid in sh(["ip", "netns", "pids", ns], check=False).split()]:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise UserError(
                f"processes {pids} in namespace {ns} survive SIGKILL; remove it later with `ip netns del {ns}`"
            )
        time.sleep(0.05)


def remove_namespace(ns: str) -> None:
    """Kill what runs in ``ns``, then delete it (its veth ends and bridge go with it)."""
    kill_processes(ns)
    sh(["ip", "netns", "del", ns])


def destroy_cluster(cluster: Cluster) -> None:
    existing = set(namespaces())
    for ns in cluster.namespaces:
        if ns in existing:
            remove_namespace(ns)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def remove_leftovers() -> list[str]:
    """Remove the namespaces of clusters whose making process no longer exists; their names."""
    removed = []
    for ns in namespaces():
        match = re.fullmatch(rf"{PREFIX}-(\d+)-(sw|n\d+)", ns)
        if match and not pid_alive(int(match[1])):
            remove_namespace(ns)
            removed.append(ns)
    return removed


@contextmanager
def signals_ignored() -> Iterator[None]:
    """A second Ctrl-C must not interrupt the clean-up of the first."""
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


@contextmanager
def emulated_cluster(nodes: int, rate: int | None = None) -> Iterator[Cluster]:
    """Build a cluster of ``nodes`` namespaces (links capped at ``rate`` bits/s), yield it,
    and remove all of it on the way out, whatever the way out is."""
    cluster = Cluster(os.getpid(), nodes)
    try:
        for command in build_commands(cluster):
            sh(command)
        set_link(cluster, rate)
        yield cluster
    finally:
        with signals_ignored():
            destroy_cluster(cluster)


def in_node(cluster: Cluster, i: int, command: list[str]) -> list[str]:
    """``command`` as run on node ``i``: in its network namespace, gloo bound to ``eth0``
    (otherwise it takes the address of the host name, 127.0.0.1 here, and ranks on other
    nodes dial their own loopback), under a host name of its own."""
    return [
        "ip",
        "netns",
        "exec",
        cluster.node(i),
        "env",
        "GLOO_SOCKET_IFNAME=eth0",
        "unshare",
        "--uts",
        "sh",
        "-c",
        'hostname "$0" && exec "$@"',
        f"node{i}",
        *command,
    ]


def link_counters(cluster: Cluster) -> list[tuple[int, int]]:
    """(tx, rx) bytes of every node's ``eth0`` so far."""
    counters = []
    for i in range(cluster.nodes):
        stats = json.loads(sh(["ip", "-n", cluster.node(i), "-j", "-s", "link", "show", "dev", "eth0"]))[0]["stats64"]
        counters.append((stats["tx"]["bytes"], stats["rx"]["bytes"]))
    return counters


# The link probe, run in the node namespaces as ``python -c PROBE server|client HOST PORT
# [MIB]``: the server reads until the client closes its side, then answers one byte; the
# client times from its first byte sent to that answer and prints the seconds.
PROBE = """
import socket, sys, time
role, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if role == "server":
    with socket.create_server((host, port)) as server:
        print("ready", flush=True)
        peer, _ = server.accept()
        while peer.recv(1 << 20):
            pass
        peer.sendall(b"!")
else:
    block, blocks = bytes(1 << 20), int(sys.argv[4])
    with socket.create_connection((host, port)) as peer:
        start = time.perf_counter()
        for _ in range(blocks):
            peer.sendall(block)
        peer.shutdown(socket.SHUT_WR)
        peer.recv(1)
        print(time.perf_counter() - start)
"""


def measure_link(cluster: Cluster, mib: int = PROBE_MIB, timeout_s: float = 120.0) -> float:
    """Gbit/s of one TCP transfer of ``mib`` MiB from node 0 to node 1."""
    host, port = cluster.address(1), str(PROBE_PORT)
    server = subprocess.Popen(
        ["ip", "netns", "exec", cluster.node(1), sys.executable, "-c", PROBE, "server", host, port],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        if server.stdout.readline().strip() != "ready":
            raise UserError(f"the link probe's server did not start in namespace {cluster.node(1)}")
        client = subprocess.run(
            ["ip", "netns", "exec", cluster.node(0), sys.executable, "-c", PROBE, "client", host, port, str(mib)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if client.returncode != 0:
            raise UserError(f"the link probe failed: {(client.stderr.strip().splitlines() or ['no message'])[-1]}")
    except subprocess.TimeoutExpired:
        raise UserError(
            f"the link probe moved less than {mib} MiB in {timeout_s:g} s; is the --link rate that low?"
        ) from None
    finally:
        server.kill()
        server.wait()
    return mib * MiB * 8 / float(client.stdout) / 1e9


# ---------------------------------------------------------------------------- the runs


@dataclass(frozen=True)
class Run:
    """One training job on the emulated cluster (all its nodes)."""

    graph: str  # the DATASET spec of bnsgcn-partition
    data_dir: str | None
    method: str
    nodes: int
    ranks_per_node: int
    link: str  # as given to --link
    p: float
    exchange: str  # as requested: direct, hierarchical or auto
    model: str
    epochs: int
    threads: int
    flags: tuple[str, ...]  # further bnsgcn-train flags

    @property
    def name(self) -> str:
        name = (
            f"{graph_key(self.graph, self.data_dir)}-{self.method}-{self.nodes}x{self.ranks_per_node}"
            f"-{self.link}-{self.model}-p{self.p:g}-{self.exchange}"
        )
        # runs with other training flags are other runs (``-- --compress int8``: "...-compress-int8")
        return name + "".join(f"-{re.sub(r'[^A-Za-z0-9_.]', '_', flag.lstrip('-'))}" for flag in self.flags)


def graph_key(spec: str, data_dir: str | None) -> str:
    """A file-name-safe key of a dataset: its name and a hash of spec and data directory."""
    digest = hashlib.sha256(f"{spec}\0{data_dir}".encode()).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', spec.split(':')[0])}-{digest}"


def plan(args: argparse.Namespace, extra: tuple[str, ...]) -> list[Run]:
    """Every run, grouped by link (each link is set and measured once)."""
    cores = os.cpu_count() or 1
    threads = args.threads or threads_per_rank(args.nodes * args.ranks_per_node, cores)
    return [
        Run(
            args.graph,
            args.data_dir,
            method,
            args.nodes,
            args.ranks_per_node,
            link,
            p,
            exchange,
            args.model,
            args.epochs,
            threads,
            extra,
        )
        for link in args.link
        for method in args.method
        for p in args.p
        for exchange in args.exchange
    ]


def run_seed(run: Run) -> int:
    """The run's --seed (bnsgcn-train's default 0 unless the extra flags set one)."""
    flags = list(run.flags)
    return int(flags[flags.index("--seed") + 1]) if "--seed" in flags else 0


def parts_dir(work: Path, run: Run) -> Path:
    return work / "parts" / f"{graph_key(run.graph, run.data_dir)}-{run.method}-{run.nodes * run.ranks_per_node}"


def partition_command(work: Path, run: Run) -> list[str]:
    """bnsgcn-partition of the run's set; it reuses an identical set already at --out."""
    data_dir = ["--data-dir", run.data_dir] if run.data_dir else []
    return [
        "bnsgcn-partition",
        run.graph,
        "--parts",
        str(run.nodes * run.ranks_per_node),
        "--method",
        run.method,
        *data_dir,
        "--out",
        str(parts_dir(work, run)),
    ]


def node_command(work: Path, run: Run, cluster: Cluster, i: int) -> list[str]:
    """bnsgcn-train as node ``i`` runs it (before :func:`in_node`)."""
    return [
        "bnsgcn-train",
        "--parts-dir",
        str(parts_dir(work, run)),
        "--procs",
        str(run.ranks_per_node),
        "--nnodes",
        str(run.nodes),
        "--node-rank",
        str(i),
        "--master-addr",
        cluster.address(0),
        "--master-port",
        str(MASTER_PORT),
        "--out",
        str(work / "runs" / run.name),
        "--threads",
        str(run.threads),
        "--p",
        f"{run.p:g}",
        "--exchange",
        run.exchange,
        "--epochs",
        str(run.epochs),
        "--eval-every",
        "1",
        "--model",
        run.model,
        *size_flags(run.model),
        *run.flags,
    ]


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each node's launcher with everything it started, SIGKILL after a grace period."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + KILL_GRACE_S
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)


def last_error(log: Path) -> str:
    """The line of a node's log that says what went wrong: its last ``error:`` line, else its last line."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return next((line for line in reversed(lines) if line.startswith("error:")), lines[-1] if lines else "no output")


def run_nodes(work: Path, run: Run, cluster: Cluster, timeout_s: float) -> str | None:
    """Start every node of ``run`` together and wait; None, or what failed first."""
    logs = work / "logs" / run.name
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        for i in range(cluster.nodes):
            with open(logs / f"node{i}.log", "w") as log:
                # A session of its own: stop() signals the node's whole process group, and a
                # Ctrl-C at the terminal reaches only this process, which then cleans up.
                procs.append(
                    subprocess.Popen(
                        in_node(cluster, i, executable(node_command(work, run, cluster, i))),
                        cwd=REPO,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for i, proc in enumerate(procs):
                if proc.poll() not in (None, 0):
                    return f"node {i} failed (exit code {proc.returncode}): {last_error(logs / f'node{i}.log')}"
            if all(proc.poll() == 0 for proc in procs):
                return None
            time.sleep(0.2)
        return f"timed out after {timeout_s:g} s"
    finally:
        stop(procs)
        for i in range(cluster.nodes):  # nothing of this run may hold the next run's ports
            kill_processes(cluster.node(i))


def mean_by_kind(epochs: list[dict], key: str) -> dict[str, float] | None:
    """Per-epoch mean of each entry of a by-kind dict of the epoch records (None if absent)."""
    if not epochs or key not in epochs[0]:
        return None
    return {kind: statistics.fmean(e[key].get(kind, 0) for e in epochs) for kind in epochs[0][key]}


def mean_of(epochs: list[dict], key: str) -> float | None:
    return statistics.fmean(e[key] for e in epochs) if epochs and key in epochs[0] else None


def read_run(run_dir: Path, run: Run, link_bytes: list[tuple[int, int]]) -> dict:
    """The figures of one finished run, from its run directory and the link counters' deltas.

    Epoch time excludes evaluation (every epoch evaluates, for the time to accuracy): the
    median over the epochs after the first of the slowest rank's ``time.epoch -
    time.evaluation``, and of each part of its split.
    """
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    epochs = [line for line in lines if "time" in line]
    config = json.loads((run_dir / "config.json").read_text())
    timed = epochs[1:] or epochs
    base = read_train_run(run_dir)
    link_total = sum(tx for tx, _ in link_bytes)
    return {
        "exchange": {"requested": run.exchange, "resolved": config.get("exchange")},  # auto: the mode it chose
        "engine_nodes": config.get("nodes"),
        "epoch_time_s": statistics.median(e["time"]["epoch"] - e["time"]["evaluation"] for e in timed),
        "time_s": {k: statistics.median(e["time"][k] for e in timed) for k in TIME_KEYS},
        "epochs_timed": len(timed),
        "bytes_per_epoch": {
            "inter_node": mean_of(epochs, "bytes_inter_node"),
            "intra_node": mean_of(epochs, "bytes_intra_node"),
            "inter_node_by_kind": mean_by_kind(epochs, "bytes_inter_node_by_kind"),
            "sent_by_kind": mean_by_kind(epochs, "bytes_sent_by_kind"),
            "link": link_total / len(epochs),
        },
        "link_bytes": {
            "tx_per_node": [tx for tx, _ in link_bytes],
            "rx_per_node": [rx for _, rx in link_bytes],
            "total": link_total,
        },
        **{k: base[k] for k in ("best_val_score", "test_score", "val_curve", "peak_rss_bytes", "boundary_inner_ratio")},
    }


def same_configuration(record: dict) -> tuple:
    """Everything but p: the runs whose p = 1 run sets the accuracy target."""
    return (
        record["graph"],
        record["data_dir"],
        record["method"],
        record["nodes"],
        record["ranks_per_node"],
        record["model"],
        record["epochs"],
        tuple(record["flags"]),
        record["link"]["requested"],
        record["exchange"]["requested"],
    )


def attach_replication(records: list[dict]) -> None:
    """``replication_factor``: inter-node feature bytes of direct over hierarchical exchange,
    on both runs of every pair that differs only in the (resolved) exchange."""

    def features(r: dict) -> float | None:
        return (r["bytes_per_epoch"]["inter_node_by_kind"] or {}).get("features")

    def pair_key(r: dict) -> tuple:
        return same_configuration(r)[:-1] + (r["p"],)

    ok = [r for r in records if "error" not in r]
    by_mode = {(pair_key(r), r["exchange"]["resolved"]): r for r in ok}
    for r in ok:
        direct, hierarchical = (by_mode.get((pair_key(r), mode)) for mode in ("direct", "hierarchical"))
        if direct and hierarchical and features(direct) is not None and features(hierarchical):
            r["replication_factor"] = features(direct) / features(hierarchical)
        else:
            r["replication_factor"] = None


def predicted_inter_node_rows(parts: Path, nodes: int, ranks_per_node: int, p: float, seed: int, epochs: int) -> dict:
    """Boundary rows per layer that cross between nodes, mean over a run's epochs, from the
    partition files and the sampler alone (rank r on node r // ranks_per_node, as the
    launcher places them): ``direct``, one per (owner, rank of another node that sampled the
    row); ``hierarchical``, one per (owner, other node); ``factor``, their ratio: the
    replication of the sampled rows over the ranks of a node."""
    from bnsgcn.data.format import load_partition
    from bnsgcn.data.sampler import sample_boundary

    world = nodes * ranks_per_node
    shards = [load_partition(parts, r) for r in range(world)]
    direct = hierarchical = 0
    for epoch in range(epochs):
        # per (owner, node): the global ids its ranks sampled from that owner
        sampled: dict[tuple[int, int], list] = {}
        for r, shard in enumerate(shards):
            offsets = np.asarray(shard["boundary_offsets"])
            keep = sample_boundary(np.diff(offsets).tolist(), p, seed, r, epoch).numpy()
            ids = np.asarray(shard["boundary_nodes"])
            for q in range(world):
                if q // ranks_per_node != r // ranks_per_node:
                    rows = ids[offsets[q] : offsets[q + 1]][keep[offsets[q] : offsets[q + 1]]]
                    direct += rows.size
                    sampled.setdefault((q, r // ranks_per_node), []).append(rows)
        hierarchical += sum(np.unique(np.concatenate(rows)).size for rows in sampled.values())
    return {
        "direct_rows": direct / epochs,
        "hierarchical_rows": hierarchical / epochs,
        "factor": direct / hierarchical if hierarchical else None,
    }


def targets(records: list[dict]) -> list[dict]:
    """The two targets, per pair of runs that differ only in the exchange:
    inter-node training bytes (features + gradients) with hierarchical exchange at most
    1/replication x direct (+2%), the replication predicted from the partition files; and,
    at 1gbit and p = 1, the hierarchical epoch time at most 0.75x direct."""
    ok = [r for r in records if "error" not in r and r.get("replication_predicted")]
    by_mode = {(same_configuration(r)[:-1] + (r["p"],), r["exchange"]["resolved"]): r for r in ok}
    out = []
    for (key, mode), hier in by_mode.items():
        direct = by_mode.get((key, "direct"))
        if mode != "hierarchical" or direct is None:
            continue
        training = lambda r: sum(r["bytes_per_epoch"]["inter_node_by_kind"][k] for k in ("features", "gradients"))  # noqa: E731
        factor = hier["replication_predicted"]["factor"]
        bound = training(direct) / factor * 1.02 if factor else None
        row = {
            "method": hier["method"],
            "link": hier["link"]["requested"],
            "p": hier["p"],
            "replication": factor,
            "inter_node_training_bytes": {"direct": training(direct), "hierarchical": training(hier), "bound": bound},
            "bytes_met": bound is not None and training(hier) <= bound,
            "epoch_ratio": hier["epoch_time_s"] / direct["epoch_time_s"],
        }
        if hier["link"]["requested"] == "1gbit" and hier["p"] == 1:
            row["epoch_met"] = row["epoch_ratio"] <= 0.75
        out.append(row)
    return out


def partition_all(work: Path, runs: list[Run], timeout_s: float) -> None:
    for command in dict.fromkeys(tuple(partition_command(work, r)) for r in runs):
        print(f"partition: {shlex.join(command)}", file=sys.stderr, flush=True)
        error = execute(list(command), os.cpu_count() or 1, int(timeout_s))[1]
        if error is not None:
            raise UserError(f"partitioning failed: {error.splitlines()[-1]}")


def load_document(out: Path) -> dict:
    """The records already in ``--out`` (kept; a run of the same name replaces its record)."""
    try:
        return json.loads(out.read_text())
    except (OSError, ValueError):
        return {"runs": []}


def benchmark(runs: list[Run], work: Path, out: Path, command: str, timeout_s: float) -> dict:
    """Partition, build the cluster, measure each link, run everything; the result document."""
    document = load_document(out) | {"command": command, "machine": machine()}
    records = {r["name"]: r for r in document["runs"]}
    removed = remove_leftovers()  # first: a killed run's ranks may still be training
    if removed:
        print(f"removed leftovers of an earlier, killed run: {', '.join(removed)}", file=sys.stderr)
    partition_all(work, runs, timeout_s)
    with emulated_cluster(runs[0].nodes) as cluster:
        measured: dict[str, float] = {}
        for i, run in enumerate(runs, 1):
            rate = parse_rate(run.link)
            if run.link not in measured:
                set_link(cluster, rate)
                measured[run.link] = measure_link(cluster)
                print(
                    f"link {run.link}: measured {measured[run.link]:.3f} Gbit/s from node 0 to node 1",
                    file=sys.stderr,
                    flush=True,
                )
            print(f"[{i}/{len(runs)}] {run.name}", file=sys.stderr, flush=True)
            link = {
                "requested": run.link,
                "rate_bit_s": rate,
                "burst_bytes": None if rate is None else burst_bytes(rate),
                "measured_gbit_s": measured[run.link],
            }
            exchange = {"requested": run.exchange, "resolved": None}  # resolved: read from the run
            record = asdict(run) | {
                "name": run.name,
                "date": date.today().isoformat(),
                "link": link,
                "exchange": exchange,
            }
            shutil.rmtree(work / "runs" / run.name, ignore_errors=True)
            before = link_counters(cluster)
            start = time.perf_counter()
            error = run_nodes(work, run, cluster, timeout_s)
            record["wall_s"] = time.perf_counter() - start
            if error is None:
                delta = [(tx - tx0, rx - rx0) for (tx, rx), (tx0, rx0) in zip(link_counters(cluster), before)]
                record |= read_run(work / "runs" / run.name, run, delta)
                record["replication_predicted"] = predicted_inter_node_rows(
                    parts_dir(work, run), run.nodes, run.ranks_per_node, run.p, run_seed(run), run.epochs
                )
            else:
                record["error"] = error
                print(f"  failed: {error}", file=sys.stderr)
            records[run.name] = record
            document["runs"] = list(records.values())
            attach_replication(document["runs"])
            attach_time_to_accuracy(document["runs"], same_configuration)
            document["targets"] = targets(document["runs"])
            write_json(out, document)
    return document


# ---------------------------------------------------------------------------- output


def _group(record: dict) -> tuple:
    return (record["graph"], record["method"], record["nodes"], record["ranks_per_node"], record["model"])


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MiB:.2f}"


def _mode(record: dict) -> str:
    """The exchange, and the extra training flags where there are any."""
    return " ".join([record["exchange"]["resolved"] or record["exchange"]["requested"], *record["flags"]])


def time_table(records: list[dict]) -> str:
    head = [
        "link (measured Gbit/s)",
        "p",
        "exchange",
        "epoch (s)",
        *(f"{k} (s)" for k in TIME_KEYS[:-1]),
        "to 99% of p = 1's best val: epochs / s",
        "best val",
        "test",
    ]
    rows = [
        [
            f"{r['link']['requested']} ({r['link']['measured_gbit_s']:.2f})",
            f"{r['p']:g}",
            _mode(r),
            f"{r['epoch_time_s']:.3f}",
            *(f"{r['time_s'][k]:.3f}" for k in TIME_KEYS[:-1]),
            time_to_accuracy_cell(r),
            f"{r['best_val_score']:.4f}",
            f"{r['test_score']:.4f}",
        ]
        for r in records
    ]
    return _table(head, rows)


def bytes_table(records: list[dict]) -> str:
    head = [
        "link",
        "p",
        "exchange",
        "inter-node (engine)",
        *ENGINE_KINDS,
        "intra-node (engine)",
        "link bytes (measured)",
        "replication",
    ]
    rows = []
    for r in records:
        b, factor = r["bytes_per_epoch"], r.get("replication_factor")
        kinds = b["inter_node_by_kind"] or {}
        rows.append(
            [
                r["link"]["requested"],
                f"{r['p']:g}",
                _mode(r),
                _mib(b["inter_node"]),
                *(_mib(kinds.get(k)) for k in ENGINE_KINDS),
                _mib(b["intra_node"]),
                _mib(b["link"]),
                "-" if factor is None else f"{factor:.2f}",
            ]
        )
    return _table(head, rows)


def render(document: dict) -> str:
    """Markdown tables of a result: per graph, method and cluster shape, a time table and a bytes table."""
    groups: dict[tuple, list[dict]] = {}
    for r in document["runs"]:
        groups.setdefault(_group(r), []).append(r)
    out = []
    for (graph, method, nodes, rpn, model), records in groups.items():
        out += [f"`{graph}`, {method} partitions, {nodes} nodes x {rpn} ranks, {model}:", ""]
        ok = [r for r in records if "error" not in r]
        if ok:
            out += [
                "Epoch time (slowest rank, median after the first epoch, evaluation excluded):",
                "",
                time_table(ok),
                "",
                "MiB per epoch (engine: all-to-all bytes of all ranks; "
                "link: every byte through the nodes' eth0, run total / epochs):",
                "",
                bytes_table(ok),
                "",
            ]
        out += [f"Failed: {r['name']}: {r['error']}" for r in records if "error" in r] + [""]
    if document.get("targets"):
        out += [
            "Targets (hierarchical against direct; replication predicted from the partition files and the sampler):",
            "",
            target_table(document["targets"]),
        ]
    return "\n".join(out).rstrip()


def target_table(rows: list[dict]) -> str:
    head = [
        "method",
        "link",
        "p",
        "replication",
        "inter-node MiB/epoch, features + gradients: direct / hierarchical / bound",
        "met",
        "epoch: hierarchical / direct",
        "<= 0.75 (1gbit, p = 1)",
    ]
    body = []
    for t in rows:
        b = t["inter_node_training_bytes"]
        body.append(
            [
                t["method"],
                t["link"],
                f"{t['p']:g}",
                f"{t['replication']:.3f}",
                f"{_mib(b['direct'])} / {_mib(b['hierarchical'])} / {_mib(b['bound'])}",
                "met" if t["bytes_met"] else "missed",
                f"{t['epoch_ratio']:.3f}",
                {True: "met", False: "missed"}.get(t.get("epoch_met"), "-"),
            ]
        )
    return _table(head, body)


def figure(document: dict, stem: Path) -> Path | None:
    """``<stem>-split.png``: the epoch time split (stacked) and the epoch time (black) per p
    and exchange, one panel per configuration and link (needs matplotlib)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print(f"note: {report.PLOTS_HINT}", file=sys.stderr)
        return None
    panels: dict[tuple, list[dict]] = {}
    for r in document["runs"]:
        if "error" not in r:
            panels.setdefault(_group(r) + (r["link"]["requested"],), []).append(r)
    if not panels:
        return None
    fig = Figure(figsize=(4.5 * len(panels) + 1.2, 4.5), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, ((graph, method, nodes, rpn, model, link), records) in zip(axes, panels.items()):
        records = sorted(records, key=lambda r: (-r["p"], r["exchange"]["requested"]))
        labels = [f"p={r['p']:g}\n{_mode(r)}" for r in records]
        bottom = [0.0] * len(records)
        for part in TIME_KEYS[:-1]:
            heights = [r["time_s"][part] for r in records]
            ax.bar(labels, heights, bottom=bottom, label=part)
            bottom = [b + h for b, h in zip(bottom, heights)]
        # The parts overlap (the exchange runs during the inner product): the bar can
        # stand above the epoch, marked black.
        ax.scatter(
            labels, [r["epoch_time_s"] for r in records], marker="_", s=1500, color="black", zorder=3, label="epoch"
        )
        measured = records[0]["link"]["measured_gbit_s"]
        ax.set_title(f"{graph.split(':')[0]} {method}, {nodes}x{rpn}, {link} ({measured:.2f} Gbit/s)", fontsize="small")
        ax.set_ylabel("seconds per epoch (slowest rank)")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper", fontsize="small", markerscale=0.3)
    path = stem.with_name(stem.name + "-split.png")
    fig.savefig(path, dpi=100)
    return path


def print_plan(runs: list[Run], work: Path) -> None:
    """--dry-run: the commands, with the cluster as it would be named by this process."""
    cluster = Cluster(os.getpid(), runs[0].nodes)
    for command in dict.fromkeys(tuple(partition_command(work, r)) for r in runs):
        print(shlex.join(command))
    print(f"# cluster: {cluster.nodes} node namespaces and a switch")
    for command in build_commands(cluster):
        print(shlex.join(command))
    for link in dict.fromkeys(r.link for r in runs):
        rate = parse_rate(link)
        print(
            f"# link {link}"
            + ("" if rate is None else f": tbf burst {burst_bytes(rate)} bytes")
            + f"; then a {PROBE_MIB} MiB TCP transfer node 0 -> node 1"
        )
        for command in link_commands(cluster, rate):
            print(shlex.join(command))
        for run in (r for r in runs if r.link == link):
            print(f"# run {run.name}: every node at once")
            for i in range(run.nodes):
                print(shlex.join(in_node(cluster, i, node_command(work, run, cluster, i))))
    print(f"# at exit: every process in {', '.join(cluster.namespaces)} killed, each namespace deleted (ip netns del)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.cluster",
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
        epilog="Flags after -- go to bnsgcn-train unchanged.",
    )
    parser.add_argument(
        "--graph", metavar="DATASET", help="what bnsgcn-partition takes: synthetic:..., reddit, cora, ..."
    )
    parser.add_argument("--data-dir", help="dataset files, passed to bnsgcn-partition")
    parser.add_argument(
        "--method", nargs="+", action="extend", choices=("metis", "random"), help="partitioner(s) (default metis)"
    )
    parser.add_argument("--nodes", type=int, default=2, help="emulated machines (default 2)")
    parser.add_argument("--ranks-per-node", type=int, default=2, help="ranks on each machine (default 2)")
    parser.add_argument(
        "--link",
        nargs="+",
        action="extend",
        help="rate of each node's link, as tc writes it (1gbit, 10gbit, ...), or none (default 1gbit)",
    )
    parser.add_argument(
        "--p", nargs="+", action="extend", type=float, help="boundary sampling probabilities (default 1 0.1)"
    )
    parser.add_argument(
        "--exchange",
        nargs="+",
        action="extend",
        choices=("direct", "hierarchical", "auto"),
        help="exchange modes (default direct hierarchical)",
    )
    parser.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="graphsage",
        help="graphsage (3 x 128) or gat (3 layers, 4 heads x 32)",
    )
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, help="threads per rank (default cores // (nodes x ranks per node), at least 1)"
    )
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds a run (all its nodes) may take (default 900)"
    )
    parser.add_argument(
        "--work", type=Path, help="partition sets, run directories, node logs (default <tmp>/bnsgcn-cluster, reused)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "benchmarks" / "results" / "cluster.json",
        help="result JSON (default benchmarks/results/cluster.json)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the commands and run nothing")
    parser.add_argument(
        "--render", type=Path, metavar="RESULT", help="print the tables of a saved result, redraw its figure, and exit"
    )
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Fill in the list defaults and refuse what cannot run."""
    args.method = args.method or ["metis"]
    args.link = args.link or ["1gbit"]
    args.p = args.p or [1.0, 0.1]
    args.exchange = args.exchange or ["direct", "hierarchical"]
    if args.graph is None:
        raise UserError(
            "no graph given; pass --graph DATASET (what bnsgcn-partition takes, e.g. synthetic:nodes=20000,degree=20)"
        )
    if args.nodes < 2:
        raise UserError(
            f"--nodes {args.nodes}: the emulated cluster needs at least 2 nodes "
            "(links between them are what it emulates)"
        )
    for flag, value in (
        ("--ranks-per-node", args.ranks_per_node),
        ("--epochs", args.epochs),
        ("--threads", args.threads or 1),
    ):
        if value < 1:
            raise UserError(f"{flag} {value} must be a positive integer")
    for p in args.p:
        if not 0 <= p <= 1:
            raise UserError(f"--p {p:g} is not a probability; pass values in [0, 1]")
    for link in args.link:
        parse_rate(link)


def on_cluster(work: Callable[[], dict], namespaces: bool = True) -> dict | int:
    """``work()`` (which builds emulated clusters) with the checks and signal handling it
    needs; its result, or the exit status after a bad input (2, one line), Ctrl-C (130) or
    SIGTERM/SIGHUP (128 + signal), the clusters removed on the way out."""
    try:
        if namespaces:
            check_requirements()
            for sig in (signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, _raise_interrupted)
        return work()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; the emulated cluster (if any) was removed", file=sys.stderr)
        return 130
    except Interrupted as exc:
        print(f"stopped by {exc}; the emulated cluster was removed", file=sys.stderr)
        return 128 + exc.signum


def show_saved(result: Path, render, figure) -> int:
    """``--render``: the tables of a saved result on stdout, its figure drawn again."""
    document = json.loads(result.read_text())
    print(render(document))
    path = figure(document, result.with_suffix(""))
    if path:
        print(f"wrote {path}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)  # after it: flags for bnsgcn-train
    args, extra = build_parser().parse_args(argv[:split]), tuple(argv[split + 1 :])
    try:
        if args.render:
            return show_saved(args.render, render, figure)
        check_args(args)
        runs = plan(args, extra)
        work = args.work or Path(tempfile.gettempdir()) / "bnsgcn-cluster"
        if args.dry_run:
            print_plan(runs, work)
            return 0
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    document = on_cluster(
        lambda: benchmark(runs, work, args.out, "python -m benchmarks.cluster " + shlex.join(argv), args.timeout)
    )
    if isinstance(document, int):
        return document
    print(render(document))
    path = figure(document, args.out.with_suffix(""))
    if path:
        print(f"wrote {path}", file=sys.stderr)
    return 1 if any("error" in r for r in document["runs"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
