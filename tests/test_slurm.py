"""SLURM and cluster behaviour of bnsgcn-train, through the real CLI.

Without a cluster (always run):

* SIGUSR1 (or SIGTERM) to one rank of a checkpointing job: every rank stops after the same
  epoch, the checkpoint of that epoch is written, the job exits 128 + signal with one line;
  the same command run again as a requeued job (``SLURM_RESTART_COUNT=1``, no ``--resume``)
  continues from that checkpoint;
* a rank pointed at a master that never answers fails after ``--timeout`` with one line;
* through the job's c10d store, a rank whose collective failed names the rank that hung
  (with the epoch it reached) or the one that failed first (with its error).

Under a real SLURM (Debian's slurm-wlm, two slurmd on this host as nodes n1 and n2, started
by ``../shared/tools/slurm-local.sh two``; installed by it through apt-get when missing,
which took 17 s here): a 2-node ``srun`` job trains exactly as the local run (same losses,
bit for bit) and records the launch (mode, job id, nodes) in its run directory's name,
config.json and report.json; the documented one-launcher-per-node form works inside an
allocation of several tasks per node while the naive form is refused before any rank
starts; a rank killed by SIGKILL and a rank that fails on bad input each end the whole
step at once, and the step's output names that rank; SIGUSR1 to the job (``scancel
--signal=USR1``) makes every rank checkpoint the same epoch and exit 138, and the next
step with ``SLURM_RESTART_COUNT=1`` resumes from it. These are skipped, naming the
reason, when the machine does not permit them: not root, no recipe, or neither SLURM nor
apt-get. A cluster already running from the recipe is reused and left running; one
started here (in the background while the tests without SLURM run) is stopped
(``slurm-local.sh stop``) at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from .helpers import kernels
from .helpers.cli import TRAIN, clean_env
from .helpers.faults import descendants, epoch_records, rank_process
from .helpers.graphs import partition, random_graph
from .helpers.ranks import free_port

RECIPE = Path(__file__).resolve().parents[2] / "shared" / "tools" / "slurm-local.sh"
SLURM_DIR = Path(os.environ.get("BNSGCN_SLURM_DIR", "/tmp/bnsgcn-slurm"))
SLURM_CONF = SLURM_DIR / "etc" / "slurm.conf"
RECIPE_S = 240  # install (apt-get, when missing) and start the daemons, on a loaded machine
STEP_S = 180  # for one short job step
FLAGS = [
    "--layers",
    "2",
    "--hidden",
    "8",
    "--p",
    "0.5",
    "--dropout",
    "0.3",
    "--seed",
    "5",
    "--eval-every",
    "2",
    "--threads",
    "1",
    "--timeout",
    "60",
]


def losses(run_dir: Path) -> list[float]:
    return [record["loss"] for record in epoch_records(run_dir)]


def epochs(run_dir: Path) -> list[int]:
    """The epochs in metrics.jsonl so far (a line being written left out)."""
    return [record["epoch"] for record in epoch_records(run_dir)]


def job_processes(run_dir: Path, rank: int | None = None) -> list[psutil.Process]:
    """Live processes whose command line names ``run_dir`` (of SLURM task ``rank`` only, if given)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if str(run_dir) not in " ".join(process.info["cmdline"] or []) or process.status() == psutil.STATUS_ZOMBIE:
                continue
            if rank is None or process.environ().get("SLURM_PROCID") == str(rank):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> Path:
    return partition(
        random_graph(num_nodes=120, avg_degree=5, seed=7), 2, tmp_path_factory.mktemp("slurm") / "parts" / "graph-2"
    )


@pytest.fixture(scope="module")
def local_run(parts: Path) -> Path:
    """The reference: the same job run by the local launcher."""
    kernels.compiled()
    run_dir = parts.parent.parent / "local"
    done = subprocess.run(
        [*TRAIN, "--procs", "2", "--parts-dir", str(parts), "--out", str(run_dir), "--epochs", "6", *FLAGS],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=STEP_S,
    )
    assert done.returncode == 0, done.stderr
    return run_dir


# --- without SLURM -----------------------------------------------------------------------


def test_stop_signal_checkpoints_every_rank_and_a_requeued_job_resumes(tmp_path, parts):
    kernels.compiled()
    run_dir = tmp_path / "run"
    argv = [
        *TRAIN,
        "--procs",
        "2",
        "--parts-dir",
        str(parts),
        "--out",
        str(run_dir),
        *FLAGS,
        "--checkpoint-every",
        "100000",
    ]
    with open(tmp_path / "job.err", "w") as stderr:
        job = subprocess.Popen(
            [*argv, "--epochs", "1000000"],
            env=clean_env(),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + STEP_S
        while len(epochs(run_dir)) < 3:
            assert job.poll() is None and time.monotonic() < deadline, "the job did not start training"
            time.sleep(0.05)
        rank_process(descendants(job.pid), 1).send_signal(signal.SIGUSR1)  # only one rank gets it: both must stop
        job.wait(STEP_S)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode == 128 + signal.SIGUSR1
    last_line = (tmp_path / "job.err").read_text().strip().splitlines()[-1]
    stopped = epochs(run_dir)[-1]
    assert f"stopped by SIGUSR1 after epoch {stopped}, checkpoint written to {run_dir / 'checkpoints'}" in last_line, (
        last_line
    )
    assert (
        run_dir / "checkpoints" / f"checkpoint-{stopped:06d}.pt"
    ).is_file()  # not on the --checkpoint-every schedule

    # The batch system runs the same command again (no --resume): it continues from there.
    again = subprocess.run(
        [*argv, "--epochs", str(stopped + 2)],
        env=clean_env(SLURM_RESTART_COUNT="1"),
        capture_output=True,
        text=True,
        timeout=STEP_S,
    )
    assert again.returncode == 0, again.stderr
    assert f"resumed from epoch {stopped}" in again.stdout + again.stderr
    assert epochs(run_dir) == list(range(1, stopped + 3))


def test_master_that_never_answers_fails_after_the_timeout_with_one_line(tmp_path, parts):
    port = free_port()  # nobody listens there
    # --device cpu: on a machine with one GPU, --device auto would refuse rank 1 (LOCAL_RANK 1) first
    env = clean_env(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    start = time.monotonic()
    done = subprocess.run(
        [
            *TRAIN,
            "--parts-dir",
            str(parts),
            "--out",
            str(tmp_path / "run"),
            *FLAGS,
            "--device",
            "cpu",
            "--timeout",
            "3",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=STEP_S,
    )
    elapsed = time.monotonic() - start
    assert done.returncode == 4
    assert done.stderr.strip().splitlines() == [
        f"error: [rank 1] no answer from the master 127.0.0.1:{port} within --timeout 3 s (Connection refused); "
        "check that rank 0 runs there and that MASTER_ADDR/MASTER_PORT (--master-addr/--master-port) name it"
    ]
    assert 3 <= elapsed < 3 + 30  # the timeout, plus starting Python and torch


def test_the_store_names_the_rank_that_stopped_or_failed_first():
    """What a rank whose collective failed says about the cause (Comm.who_stopped), on a
    real c10d store; three ranks' views of one job, without process groups."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from bnsgcn.comm.communicator import Comm
    from bnsgcn.comm.store import JobStore

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))

    def view(rank: int) -> Comm:
        comm = Comm.__new__(Comm)  # only what the progress reports use
        comm.rank, comm.world_size, comm.store = rank, 3, JobStore(dist.PrefixStore("job/", store), timeout=10)
        return comm

    ranks = [view(r) for r in range(3)]
    for comm, stage in zip(ranks, ("epoch 8", "epoch 7", "epoch 8")):
        comm.report_progress(stage)
    # rank 1 hangs: ranks 0 and 2 time out together and name it
    said: dict[int, str | None] = {}
    peer = threading.Thread(target=lambda: said.__setitem__(2, ranks[2].who_stopped(wait_s=3)))
    peer.start()
    said[0] = ranks[0].who_stopped(wait_s=3)
    peer.join()
    assert said == {
        0: "rank 1 stopped at epoch 7 while the others waited",
        2: "rank 1 stopped at epoch 7 while the others waited",
    }
    # a rank that fails for a reason of its own is quoted; the first one stays
    ranks[1].report_failure("features.npy is truncated")
    ranks[2].report_failure("a later failure")
    assert ranks[0].who_stopped(wait_s=1) == "rank 1 failed first: features.npy is truncated"


# --- under SLURM -------------------------------------------------------------------------


def _slurm_env() -> dict[str, str]:
    return clean_env(SLURM_CONF=str(SLURM_CONF))


def _two_nodes_up(env: dict[str, str], within_s: float = 0.0) -> bool:
    """Whether n1 and n2 are up (asked again for ``within_s`` seconds: right after the
    recipe's test job they may still be completing it, longer on a loaded machine)."""
    if shutil.which("sinfo") is None or not SLURM_CONF.is_file():
        return False
    deadline = time.monotonic() + within_s
    while True:
        try:
            nodes = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %T"], env=env, capture_output=True, text=True, timeout=20
            )
            states = dict(line.split() for line in nodes.stdout.splitlines() if line.strip())
            if (
                nodes.returncode == 0
                and {"n1", "n2"} <= states.keys()
                and all(states[n] in ("idle", "mixed", "allocated") for n in ("n1", "n2"))
            ):
                return True
        except subprocess.TimeoutExpired:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(2)


def _start_cluster() -> tuple[dict[str, str] | None, str | None, bool]:
    """Bring up the recipe's two-node cluster unless one is up: the environment for srun and
    salloc, or why the SLURM tests are skipped; and whether the recipe started it here."""
    if os.geteuid() != 0:
        return None, "the SLURM recipe runs munged and slurmd as root; not root here", False
    if not RECIPE.is_file():
        return None, f"no SLURM recipe at {RECIPE}", False
    if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        return None, "SLURM is not installed and there is no apt-get to install Debian's slurm-wlm", False
    env = _slurm_env()
    if _two_nodes_up(env):  # started by someone else: use it, leave it running
        return env, None, False
    if (SLURM_DIR / "state" / "daemons.pids").is_file():  # its daemons hold the ports; stopping them is not ours to do
        return (
            None,
            f"a SLURM cluster of the recipe runs in {SLURM_DIR} but not as two nodes n1, n2; stop it "
            "(slurm-local.sh stop) or start it with 'two'",
            False,
        )
    try:
        started = subprocess.run(
            ["bash", str(RECIPE), "two"], env=env, capture_output=True, text=True, timeout=RECIPE_S
        )
    except subprocess.TimeoutExpired:
        started = None
    if started is None or started.returncode != 0 or not _two_nodes_up(env, within_s=60):
        tail = "timed out" if started is None else (started.stdout + started.stderr).strip().splitlines()[-3:]
        return None, f"the SLURM recipe could not start a two-node cluster here: {tail}", True
    return env, None, True


@pytest.fixture(scope="module", autouse=True)
def _cluster(request) -> Iterator[Future | None]:
    """The recipe's cluster for the tests that use it, brought up in the background from the
    module's start (about 30 s, mostly waiting for its daemons) while the tests without SLURM
    run; stopped at the end if started here. Nothing is started when no such test runs."""
    here = [item for item in request.session.items if item.module is request.module]
    if not any("slurm" in item.fixturenames for item in here):
        yield None
        return
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(_start_cluster)
        try:
            yield starting
        finally:
            if starting.result()[2]:
                subprocess.run(["bash", str(RECIPE), "stop"], env=_slurm_env(), capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def slurm(_cluster: Future) -> dict[str, str]:
    """The environment for srun/salloc on the recipe's two-node cluster (started if needed)."""
    env, skip, _ = _cluster.result()
    if skip:
        pytest.skip(skip)
    kernels.compiled()  # every test here trains
    return env


def srun(env: dict[str, str], cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), cwd=cwd, env=env, capture_output=True, text=True, timeout=STEP_S)


def test_two_node_srun_job_matches_the_local_run_and_records_the_launch(slurm, tmp_path, parts, local_run):
    # n1 and n2 are names only SLURM knows (both nodes are this host): rank 0's address is given.
    done = srun(
        slurm,
        tmp_path,
        "srun",
        "-N",
        "2",
        "-n",
        "2",
        "--kill-on-bad-exit=1",
        *TRAIN,
        "--master-addr",
        "127.0.0.1",
        "--parts-dir",
        str(parts),
        "--epochs",
        "6",
        *FLAGS,
    )
    assert done.returncode == 0, done.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert losses(run_dir) == losses(local_run)
    launch = json.loads((run_dir / "config.json").read_text())["launch"]
    assert launch["mode"] == "slurm" and launch["nodes"] == ["n1", "n2"] and launch["job_id"].isdigit()
    assert run_dir.name.endswith(f"-slurm-{launch['job_id']}")
    assert json.loads((run_dir / "report.json").read_text())["info"]["launch"] == launch


def test_one_launcher_per_node_inside_a_larger_allocation(slurm, tmp_path, parts, local_run):
    launcher = " ".join(
        [
            *TRAIN,
            "--nnodes",
            "2",
            "--node-rank",
            "$SLURM_NODEID",
            "--procs",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--parts-dir",
            str(parts),
            "--epochs",
            "6",
            *FLAGS,
        ]
    )
    # Two nodes, two tasks each (-O: the test nodes have one CPU each). The naive form:
    # srun --ntasks-per-node=1 still runs the allocation's 4 tasks; refused before any rank starts.
    naive = srun(
        slurm,
        tmp_path,
        "salloc",
        "-N",
        "2",
        "-n",
        "4",
        "-O",
        "srun",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        "bash",
        "-c",
        f"{launcher} --out {tmp_path / 'naive'}",
    )
    assert naive.returncode != 0
    assert (
        "error: this srun step runs 4 copies of bnsgcn-train for --nnodes 2; start one per node: srun -n "
        "$SLURM_NNODES --ntasks-per-node=1" in naive.stderr
    ), naive.stderr
    assert not (tmp_path / "naive").exists()
    # The documented form.
    step = (
        f"srun -n $SLURM_NNODES --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c '{launcher} --out {tmp_path / 'run'}'"
    )
    done = srun(slurm, tmp_path, "salloc", "-N", "2", "-n", "4", "-O", "bash", "-c", step)
    assert done.returncode == 0, done.stderr
    assert losses(tmp_path / "run") == losses(local_run)


def assert_cause_named(stderr: str, task_exit: str, survivor: str, blame: str) -> None:
    """srun reports rank 1's exit (``task_exit``), and the step's output names rank 1 as the
    cause: srun's first task line is rank 1's, or, where srun heard of rank 0's exit first
    (the two slurmd of one host report at their own pace), rank 0's error line blames rank 1."""
    errors = [line for line in stderr.splitlines() if line.startswith("srun: error:") and "task" in line]
    assert any(line.endswith(task_exit) for line in errors), stderr
    blamed = any(line.startswith(survivor) and blame in line for line in stderr.splitlines())
    assert errors[0].endswith(task_exit) or blamed, stderr


def test_killed_rank_ends_the_step_and_is_named(slurm, tmp_path, parts):
    run_dir = tmp_path / "run"
    argv = [
        "srun",
        "-N",
        "2",
        "-n",
        "2",
        "--kill-on-bad-exit=1",
        *TRAIN,
        "--master-addr",
        "127.0.0.1",
        "--parts-dir",
        str(parts),
        "--out",
        str(run_dir),
        *FLAGS,
        "--epochs",
        "1000000",
    ]
    job = subprocess.Popen(argv, cwd=tmp_path, env=slurm, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + STEP_S
        while len(epochs(run_dir)) < 2:
            assert job.poll() is None and time.monotonic() < deadline, "the step did not start training"
            time.sleep(0.05)
        # srun's tasks are children of slurmstepd, not of srun: find rank 1 by its environment.
        (victim,) = [p for p in job_processes(run_dir, rank=1) if "python" in p.name().lower()]
        victim.kill()
        killed_at = time.monotonic()
        _, stderr = job.communicate(timeout=STEP_S)
        elapsed = time.monotonic() - killed_at
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert elapsed < 30, f"the step took {elapsed:.1f} s to end (--timeout is 60)"
    assert job.returncode != 0
    assert_cause_named(stderr, "task 1: Killed", "error: [rank 0] ", "rank 1 stopped")
    deadline = time.monotonic() + 30
    while job_processes(run_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not job_processes(run_dir), "ranks left behind"


def test_failing_rank_ends_the_step_and_is_named(slurm, tmp_path, parts):
    bad = tmp_path / "bad-set"
    shutil.copytree(parts, bad)
    features = bad / "part-1" / "features.npy"
    features.write_bytes(features.read_bytes()[:-8])  # truncated: rank 1 refuses its partition
    done = srun(
        slurm,
        tmp_path,
        "srun",
        "-N",
        "2",
        "-n",
        "2",
        "--kill-on-bad-exit=1",
        *TRAIN,
        "--master-addr",
        "127.0.0.1",
        "--parts-dir",
        str(bad),
        "--out",
        str(tmp_path / "run"),
        *FLAGS,
        "--epochs",
        "100",
    )
    assert done.returncode != 0
    assert f"error: [rank 1] {features} has " in done.stderr
    assert_cause_named(done.stderr, "task 1: Exited with exit code 2", "error: [rank 0] ", "rank 1 failed first")


def test_sigusr1_to_the_job_checkpoints_and_the_requeued_job_resumes(slurm, tmp_path, parts):
    """``scancel --signal=USR1`` (as ``sbatch --signal=USR1@...`` before a time limit) reaches
    every task; they stop after one epoch with its checkpoint. The requeue is simulated by
    exporting SLURM_RESTART_COUNT=1 to the next step: SLURM holds a really requeued job for
    two minutes before it may start again."""
    run_dir, name = tmp_path / "run", f"bnsgcn-usr1-{os.getpid()}"
    step = [
        "srun",
        "-J",
        name,
        "-N",
        "2",
        "-n",
        "2",
        "--kill-on-bad-exit=1",
        *TRAIN,
        "--master-addr",
        "127.0.0.1",
        "--parts-dir",
        str(parts),
        "--out",
        str(run_dir),
        *FLAGS,
        "--checkpoint-every",
        "100000",
    ]
    job = subprocess.Popen(
        [*step, "--epochs", "1000000"],
        cwd=tmp_path,
        env=slurm,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + STEP_S
        while len(epochs(run_dir)) < 3:
            assert job.poll() is None and time.monotonic() < deadline, "the step did not start training"
            time.sleep(0.05)
        job_id = subprocess.run(
            ["squeue", "-h", "-n", name, "-o", "%i"], env=slurm, capture_output=True, text=True, timeout=20
        ).stdout.strip()
        subprocess.run(["scancel", "--signal=USR1", job_id], env=slurm, check=True, timeout=20)
        _, stderr = job.communicate(timeout=STEP_S)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 128 + signal.SIGUSR1, stderr
    stopped = epochs(run_dir)[-1]
    for rank in (0, 1):
        assert (
            f"error: [rank {rank}] stopped by SIGUSR1 after epoch {stopped}, checkpoint written to "
            f"{run_dir / 'checkpoints'}" in stderr
        ), stderr
    assert (run_dir / "checkpoints" / f"checkpoint-{stopped:06d}.pt").is_file()
    again = srun(slurm | {"SLURM_RESTART_COUNT": "1"}, tmp_path, *step, "--epochs", str(stopped + 2))
    assert again.returncode == 0, again.stderr
    assert f"resumed from epoch {stopped}" in again.stdout + again.stderr
    assert epochs(run_dir) == list(range(1, stopped + 3))
