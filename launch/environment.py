"""The rank layout exported by torchrun or SLURM, and the CPUs this process may use.

When ``bnsgcn-train`` runs under ``torchrun`` or as one task of ``srun``, another program
has already started one process per rank and told each one who it is through
environment variables. :func:`detect_rank_environment` reads them; ``None`` means no
such program is around and ``bnsgcn-train`` starts the ranks itself.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import socket
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from bnsgcn.errors import UserError
from bnsgcn.run.provenance import LAUNCH_VARIABLE

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
# srun exports SLURM_STEP_ID to its tasks; a bare batch script or salloc shell also has
# SLURM_PROCID/SLURM_LOCALID but is not one task of a multi-task step.
SLURM_VARIABLES = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_STEP_ID")
SLURM_NODELIST_VARIABLES = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
# How many times the job was started again: by torchrun after a failure, by SLURM after a
# requeue (preemption, node failure, scontrol requeue). Either way the run resumes.
RESTART_VARIABLES = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")


@dataclass(frozen=True)
class RankEnvironment:
    """Who this process is in a job started by torchrun or SLURM.

    ``threads`` is the CPU-thread budget of this rank: SLURM's ``--cpus-per-task`` where
    given, otherwise the CPUs this process may use divided by the ranks on this node.
    """

    source: str  # "torchrun" | "slurm"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    threads: int
    restart_count: int = 0

    def export(self, environ: MutableMapping[str, str]) -> None:
        """Write the variables ``torch.distributed``'s ``env://`` rendezvous reads."""
        environ.update(
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self.local_rank),
            LOCAL_WORLD_SIZE=str(self.local_world_size),
        )


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which SLURM and taskset narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_per_rank(local_ranks: int) -> int:
    """Share the usable CPUs evenly among ``local_ranks`` ranks, at least one thread each."""
    return max(1, usable_cpus() // local_ranks)


def restart_count(environ: Mapping[str, str]) -> tuple[int, str]:
    """How many times this job was restarted, and the variable that says so: the first of
    :data:`RESTART_VARIABLES` above 0 (torchrun inside a requeued SLURM job sets its own
    count to 0), else 0 and ""."""
    for name in RESTART_VARIABLES:
        if name in environ and (count := _int_variable(environ, name)) > 0:
            return count, name
    return 0, ""


def in_slurm_step(environ: Mapping[str, str]) -> bool:
    """Whether this process is a task of an ``srun`` job step."""
    return all(name in environ for name in SLURM_VARIABLES)


def slurm_nodes(environ: Mapping[str, str]) -> list[str] | None:
    """The hosts of this SLURM step (else job), expanded; None outside SLURM."""
    nodelist = next((environ[name] for name in SLURM_NODELIST_VARIABLES if name in environ), None)
    return None if nodelist is None else expand_slurm_nodelist(nodelist)


def check_one_launcher_per_node(environ: Mapping[str, str], nnodes: int) -> None:
    """Under ``srun`` with ``--nnodes`` > 1 each task is the launcher of one node: refuse a
    step with another number of tasks (``srun --ntasks-per-node=1`` inside an allocation of
    several tasks per node still gets the allocation's task count from ``SLURM_NTASKS``),
    before any of them starts a rank."""
    if nnodes < 2 or not in_slurm_step(environ):
        return
    tasks = _int_variable(environ, "SLURM_NTASKS")
    if tasks != nnodes:
        raise UserError(
            f"this srun step runs {tasks} copies of bnsgcn-train for --nnodes {nnodes}; start one per node: "
            "srun -n $SLURM_NNODES --ntasks-per-node=1 bnsgcn-train --nnodes $SLURM_NNODES --node-rank $SLURM_NODEID "
            "..."
        )


def launch_record(mode: str, environ: Mapping[str, str], nodes: list[str] | None) -> dict:
    """What the run directory records about how the job was started: ``mode`` (local,
    torchrun or slurm), the batch system's job id and the nodes (None where unknown)."""
    job_id = environ.get("SLURM_JOB_ID") or environ.get("TORCHELASTIC_RUN_ID")
    return {"mode": mode, "job_id": job_id, "nodes": nodes}


def export_launch_record(environ: MutableMapping[str, str], record: dict) -> None:
    """Hand :func:`launch_record` to the engine (:func:`bnsgcn.run.provenance.launch_info`)."""
    environ[LAUNCH_VARIABLE] = json.dumps(record)


def this_host() -> list[str]:
    """The node list of a job on this one machine."""
    return [socket.gethostname()]


def _int_variable(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise UserError(
            f"environment variable {name}={value!r} is not an integer; unset it or fix the job script"
        ) from None


def detect_rank_environment(
    environ: Mapping[str, str], *, master_addr: str | None, master_port: int, nnodes: int
) -> RankEnvironment | None:
    """The rank layout from ``environ``, or ``None`` when bnsgcn-train must start the ranks.

    torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (+ ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``). SLURM: one task of a
    multi-task ``srun`` step (``SLURM_PROCID``, ``SLURM_NTASKS`` > 1, ``SLURM_LOCALID``,
    ``SLURM_STEP_ID``), unless ``nnodes`` > 1: that means one launcher per node, started
    by srun, supervising its own local ranks. ``master_addr``/``master_port`` fill in
    what the environment leaves out (``MASTER_ADDR``/``MASTER_PORT`` exported win; for
    SLURM without either address, the first host of the step's node list; for torchrun
    127.0.0.1). ``TORCHELASTIC_RESTART_COUNT`` or ``SLURM_RESTART_COUNT`` give
    ``restart_count``.
    """
    if all(name in environ for name in TORCHRUN_VARIABLES):
        world_size = _int_variable(environ, "WORLD_SIZE")
        local_world_size = _int_variable(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ else 1
        return RankEnvironment(
            source="torchrun",
            rank=_int_variable(environ, "RANK"),
            world_size=world_size,
            local_rank=_int_variable(environ, "LOCAL_RANK"),
            local_world_size=local_world_size,
            master_addr=environ.get("MASTER_ADDR") or master_addr or "127.0.0.1",
            master_port=_int_variable(environ, "MASTER_PORT") if "MASTER_PORT" in environ else master_port,
            threads=threads_per_rank(local_world_size),
            restart_count=restart_count(environ)[0],
        )
    if nnodes > 1 or not in_slurm_step(environ):
        return None
    world_size = _int_variable(environ, "SLURM_NTASKS")
    if world_size < 2:
        return None
    nodes = next(
        (
            _int_variable(environ, name)
            for name in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
            if name in environ
        ),
        1,
    )
    local_world_size = math.ceil(world_size / max(nodes, 1))
    address = environ.get("MASTER_ADDR") or master_addr
    if address is None:
        nodes = slurm_nodes(environ)
        if nodes is None:
            raise UserError(
                "SLURM task without SLURM_JOB_NODELIST: cannot tell where rank 0 runs; export MASTER_ADDR=<host of "
                "rank 0>"
            )
        address = nodes[0]
    return RankEnvironment(
        source="slurm",
        rank=_int_variable(environ, "SLURM_PROCID"),
        world_size=world_size,
        local_rank=_int_variable(environ, "SLURM_LOCALID"),
        local_world_size=local_world_size,
        master_addr=address,
        master_port=_int_variable(environ, "MASTER_PORT") if "MASTER_PORT" in environ else master_port,
        threads=_int_variable(environ, "SLURM_CPUS_PER_TASK")
        if "SLURM_CPUS_PER_TASK" in environ
        else threads_per_rank(local_world_size),
        restart_count=restart_count(environ)[0],
    )


# One host expression: literal text and bracketed range lists, e.g. "gpu-[01-04,07]-x[1,3]".
_HOST_EXPRESSION = re.compile(r"(?:[^\[\],]+|\[[0-9,\-]+\])+")
_BRACKET = re.compile(r"(\[[^\]]*\])")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compact host list, e.g. ``"node[01-03,07],login1"`` to
    ``["node01", "node02", "node03", "node07", "login1"]``.

    Zero padding follows the lower bound of each range (``[08-10]`` gives ``08, 09, 10``);
    several bracket groups in one name expand to their product, first group slowest.
    """
    text = nodelist.strip()
    hosts: list[str] = []
    position = 0
    while position < len(text):
        match = _HOST_EXPRESSION.match(text, position)
        if match is None:
            raise UserError(
                f"cannot parse SLURM node list {nodelist!r} near position {position}; export MASTER_ADDR=<host of "
                "rank 0>"
            )
        hosts.extend(_expand_host(match.group(0), nodelist))
        position = match.end()
        if position < len(text):
            if text[position] != "," or position + 1 == len(text):
                raise UserError(
                    f"cannot parse SLURM node list {nodelist!r} near position {position}; export MASTER_ADDR=<host of "
                    "rank 0>"
                )
            position += 1
    if not hosts:
        raise UserError(f"SLURM node list {nodelist!r} is empty; export MASTER_ADDR=<host of rank 0>")
    return hosts


def _expand_host(expression: str, nodelist: str) -> list[str]:
    choices: list[list[str]] = []
    for piece in _BRACKET.split(expression):
        if piece.startswith("["):
            choices.append(_expand_ranges(piece[1:-1], nodelist))
        elif piece:
            choices.append([piece])
    return ["".join(combination) for combination in itertools.product(*choices)]


def _expand_ranges(body: str, nodelist: str) -> list[str]:
    names: list[str] = []
    for item in body.split(","):
        match = _RANGE.fullmatch(item)
        if match is None or (match.group(2) is not None and int(match.group(2)) < int(match.group(1))):
            raise UserError(
                f"cannot parse range [{body}] in SLURM node list {nodelist!r}; export MASTER_ADDR=<host of rank 0>"
            )
        low, high = match.group(1), match.group(2) or match.group(1)
        names.extend(str(number).zfill(len(low)) for number in range(int(low), int(high) + 1))
    return names


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: where task 0 of the step runs."""
    return expand_slurm_nodelist(nodelist)[0]
