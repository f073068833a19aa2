"""``bnsgcn-train``: train on a partition set with one rank per partition.

Two modes, chosen from the environment (docs/cli.md has examples of each):

* **one rank** -- under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` set) or as
  one task of a multi-task ``srun`` step, this process is one rank and trains in-process.
* **local** -- otherwise this process starts the local ranks of the job as child
  processes (``python -m bnsgcn.launch.rank``) and supervises them: ``--gpus N`` one CUDA GPU
  each (NCCL), or ``--ranks-per-gpu K`` on each (gloo), ``--procs N`` on CPU (gloo), neither:
  one rank per partition of the set. ``--nnodes``/``--node-rank`` run the same command once
  per machine.

Problems that can be seen before any rank starts (GPU count, partition set, rank count,
master address and port, launchers per node under srun, flags) are reported as one
``error:`` line, exit status 2. After a restart (torchrun's, or a requeued SLURM job) a
run with a fixed ``--out`` resumes from its checkpoints without ``--resume``.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from bnsgcn.cli import Parser
from bnsgcn.comm.store import JOB_TOKEN_VARIABLE
from bnsgcn.config import TrainConfig, check_flags, from_args
from bnsgcn.config.original import LAUNCH, add_original_flags
from bnsgcn.device import gpus_needed, resolve_device
from bnsgcn.errors import UserError

from .discover import (
    DEFAULT_SEARCH_ROOT,
    PartitionSet,
    check_world_size,
    choose_partition_set,
)
from .environment import (
    RankEnvironment,
    check_one_launcher_per_node,
    detect_rank_environment,
    export_launch_record,
    in_slurm_step,
    launch_record,
    restart_count,
    slurm_nodes,
    this_host,
    threads_per_rank,
)
from .network import (
    check_master_address,
    check_port_number,
    default_master_port,
    free_port,
    port_in_use,
)
from .rank import (
    LAUNCHER_PID_VARIABLE,
    exit_rank,
    report_errors,
    train,
    training_parser,
)
from .supervisor import Child, supervise

PROG = "bnsgcn-train"


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags that say where the ranks run (documented in docs/cli.md)."""
    group = parser.add_argument_group("launch")
    where = group.add_mutually_exclusive_group()
    where.add_argument(
        "--gpus",
        type=int,
        metavar="N",
        help="start N ranks on this machine, one CUDA GPU each (NCCL); with --ranks-per-gpu K, N x K ranks, K on each "
        "GPU (gloo)",
    )
    where.add_argument("--procs", type=int, metavar="N", help="start N ranks on this machine, on CPU (gloo)")
    group.add_argument(
        "--nnodes", type=int, default=1, help="machines in the job, each running this command (default 1)"
    )
    group.add_argument(
        "--node-rank", type=int, default=0, help="index of this machine in [0, nnodes); node 0 hosts rank 0 (default 0)"
    )
    group.add_argument(
        "--master-addr",
        default=None,
        help="address of node 0, reachable from every node (default: inside an srun step the step's first node, "
        "else 127.0.0.1; as one rank of torchrun/srun an exported MASTER_ADDR wins)",
    )
    group.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="TCP port of rank 0 on node 0 (default: a free port with --nnodes 1; otherwise "
        "20000 + SLURM_JOB_ID %% 20000 inside a SLURM job, else 29500; as one rank of torchrun/srun "
        "an exported MASTER_PORT wins)",
    )
    add_original_flags(group, LAUNCH)


def build_parser() -> argparse.ArgumentParser:
    parser = training_parser(PROG, "Train a GNN on a partition set, one rank per partition (BNS-GCN). See docs/cli.md.")
    add_launch_arguments(parser)
    return parser


def training_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` without the launch flags: the command line every rank receives."""
    launch_only = Parser(add_help=False)  # it knows --master_addr as --master-addr, as the rank parser would not
    add_launch_arguments(launch_only)
    return launch_only.parse_known_args(list(argv))[1]


def check_launch_flags(args: argparse.Namespace) -> None:
    for flag, value in (("--gpus", args.gpus), ("--procs", args.procs)):
        if value is not None and value < 1:
            raise UserError(f"{flag} {value} must be a positive integer (ranks on this machine)")
    if args.nnodes < 1:
        raise UserError(f"--nnodes {args.nnodes} must be at least 1 (machines in the job)")
    if not 0 <= args.node_rank < args.nnodes:
        raise UserError(
            f"--node-rank {args.node_rank} is outside [0, {args.nnodes}) for --nnodes {args.nnodes}; number the "
            f"machines 0 to {args.nnodes - 1}"
        )
    if args.master_port is not None:
        check_port_number(args.master_port)


def partition_set_location(args: argparse.Namespace, search_root: Path) -> Path:
    """Where the original's flags put the partition set: ``--graph-name NAME`` is the set
    ``<--part-path or parts>/NAME`` (``args.parts_dir`` is set to it), ``--part-path DIR`` alone
    the directory searched for the one matching set. Returns the directory searched."""
    root = search_root if args.part_path is None else args.part_path
    if args.graph_name is not None:
        if args.parts_dir is not None:
            raise UserError(
                f"--graph-name {args.graph_name} and --parts-dir {args.parts_dir} both name the partition set; pass "
                "one of them"
            )
        args.parts_dir = root / args.graph_name
    return root


def ranks_for_partitions(n_partitions: int, nnodes: int, local: int | None) -> int:
    """This machine's ranks for the original's ``--n-partitions N``: the job's ranks, one per
    partition, spread evenly over ``--nnodes``; it must agree with ``--gpus``/``--procs``."""
    if n_partitions < 1:
        raise UserError(
            f"--n-partitions {n_partitions} must be a positive integer (the job's ranks, one per partition)"
        )
    if local is not None and local * nnodes != n_partitions:
        raise UserError(
            f"--n-partitions {n_partitions} disagrees with {local} ranks on each of {nnodes} machine(s); drop "
            "--n-partitions or make it --gpus/--procs times --nnodes"
        )
    if n_partitions % nnodes:
        raise UserError(
            f"--n-partitions {n_partitions} does not split evenly over --nnodes {nnodes}; pass a multiple of {nnodes}"
        )
    return n_partitions // nnodes


def choose_device(args: argparse.Namespace, config: TrainConfig) -> str:
    """``--gpus`` means cuda, ``--procs`` cpu; otherwise ``--device`` (possibly "auto",
    resolved by :func:`bnsgcn.device.resolve_device` once the local rank count is known)."""
    if args.gpus is not None:
        if config.run.device == "cpu":
            raise UserError(
                "--gpus trains on CUDA GPUs but --device cpu was given; drop --device cpu, or use --procs N for CPU "
                "ranks"
            )
        return "cuda"
    if args.procs is not None:
        if config.run.device == "cuda":
            raise UserError("--procs starts CPU ranks but --device cuda was given; use --gpus N for GPU ranks")
        return "cpu"
    return config.run.device


def check_shared_gpus(args: argparse.Namespace, config: TrainConfig, device: str, one_rank: bool = False) -> None:
    """``--ranks-per-gpu N`` above 1 shares CUDA GPUs, so it needs ranks on GPUs: ``--gpus``
    or ``--device cuda``; as one rank of torchrun/srun (``one_rank``) also ``--device auto``,
    which then takes CUDA when the machine has a GPU per N local ranks."""
    n = config.run.ranks_per_gpu
    if n == 1 or device == "cuda" or (one_rank and device == "auto"):
        return
    if args.procs is not None:
        why = f"--procs {args.procs} starts CPU ranks"
    elif device == "cpu":
        why = "--device cpu was given"
    else:
        why = "no --gpus was given"
    raise UserError(
        f"--ranks-per-gpu {n} shares CUDA GPUs among ranks but {why}; pass --gpus G ({n} ranks on each of G GPUs) or "
        "--device cuda, or drop --ranks-per-gpu"
    )


def require_gpus(local_ranks: int, ranks_per_gpu: int, what: str) -> None:
    """Fail before starting ranks when this machine has fewer CUDA GPUs than ``local_ranks``
    ranks need, ``ranks_per_gpu`` on each; the line names how the GPUs there are could be
    shared (``--ranks-per-gpu``), and CPU ranks."""
    # Imported here: torch takes seconds to import and only GPU runs need it in the launcher.
    import torch

    needed, have = gpus_needed(local_ranks, ranks_per_gpu), torch.cuda.device_count()
    if have >= needed:
        return
    share = ""
    if have:  # the most GPUs of this machine that the ranks split over evenly
        gpus = max(g for g in range(1, have + 1) if local_ranks % g == 0)
        share = f"share {'them' if have > 1 else 'it'} with --gpus {gpus} --ranks-per-gpu {local_ranks // gpus}, or "
    raise UserError(
        f"{what} needs {needed} CUDA GPU{'s' if needed > 1 else ''} but this machine has {have}; {share}run on CPU "
        f"with --procs {local_ranks} instead"
    )


def model_import_root(config: TrainConfig) -> str | None:
    """With ``--model module.path:ClassName``: the class, imported and checked here before
    any rank starts (:mod:`bnsgcn.nn.user_model`; importing it loads torch), and the
    directory its module was imported from, for ranks to import it from wherever they run.
    None for a built-in model."""
    if config.model.builtin:
        return None
    from bnsgcn.nn.user_model import checked_model_class, import_root

    root = import_root(checked_model_class(config))
    return None if root is None else str(root)


def announce(partition_set: PartitionSet, search_root: Path) -> None:
    print(
        f"{PROG}: using partition set {partition_set.describe()}, the one match under {search_root}/ (--parts-dir "
        "picks another)",
        flush=True,
    )


def ranks_per_node(partition_set: PartitionSet, nnodes: int) -> int:
    """Without --gpus/--procs: the set's partitions spread evenly over the machines."""
    if partition_set.parts % nnodes:
        raise UserError(
            f"partition set {partition_set.describe()} does not split evenly over --nnodes {nnodes}; pass --procs N "
            "(ranks per machine)"
        )
    return partition_set.parts // nnodes


def resume_after_restart(config: TrainConfig, environ: Mapping[str, str], announcer: bool) -> bool:
    """Whether this run resumes: ``--resume``, or a restart (torchrun after a failure, a
    requeued SLURM job) with a fixed ``--out`` to resume from. ``announcer``: this process
    warns about a restart without ``--out`` (one process per job)."""
    count, variable = restart_count(environ)
    if config.checkpoint.resume or count == 0:
        return config.checkpoint.resume
    if config.run.out is not None:
        return True
    if announcer:
        print(
            f"{PROG}: warning: restart {count} ({variable}) without --out starts a new run; pass a fixed --out to "
            "resume",
            file=sys.stderr,
            flush=True,
        )
    return False


def prepare_local_ranks(
    args: argparse.Namespace, argv: Sequence[str], search_root: Path = DEFAULT_SEARCH_ROOT, prog: str = PROG
) -> list[Child]:
    """Check everything that can fail before training and return this machine's ranks.

    Ranks ``node_rank * N + i`` for ``i < N`` of ``nnodes * N``; every child gets the
    training flags plus the resolved ``--parts-dir``, ``--device`` and ``--threads``
    (and ``--resume`` after a restart, see :func:`resume_after_restart`). ``prog`` names the
    command in what it prints.
    """
    check_launch_flags(args)
    check_one_launcher_per_node(os.environ, args.nnodes)
    search_root = partition_set_location(args, search_root)
    config = from_args(args)
    model_root = model_import_root(config)
    device = choose_device(args, config)
    check_shared_gpus(args, config, device)
    shared = config.run.ranks_per_gpu
    local = args.gpus * shared if args.gpus is not None else args.procs
    sharing = f" --ranks-per-gpu {shared}" if shared > 1 else ""
    if args.n_partitions is not None:
        local = ranks_for_partitions(args.n_partitions, args.nnodes, local)
    if local is not None and device == "cuda":
        what = (
            f"--gpus {args.gpus}{sharing}"
            if args.gpus is not None
            else f"--device cuda{sharing} with {local} ranks on this machine"
        )
        require_gpus(local, shared, what)
    partition_set = choose_partition_set(
        config.data.parts_dir,
        None if local is None or config.sync.work_pool else local * args.nnodes,
        search_root,
        dataset=args.dataset,
    )
    if config.data.parts_dir is None:
        announce(partition_set, search_root)
    if local is None:
        if config.sync.work_pool:
            raise UserError(
                "--work-pool needs the number of ranks: pass --procs N (or --gpus N) per machine, fewer than the "
                "set's partitions"
            )
        local = ranks_per_node(partition_set, args.nnodes)
        if device == "cuda":
            require_gpus(local, shared, f"--device cuda{sharing} with {local} ranks on this machine")
    device = resolve_device(device, local, shared)
    world_size = local * args.nnodes
    check_world_size(partition_set, world_size, config.sync.work_pool)
    check_flags(config, world_size)

    nodes = slurm_nodes(os.environ) if in_slurm_step(os.environ) else None
    master_addr = args.master_addr or (nodes[0] if nodes and args.nnodes > 1 else "127.0.0.1")
    check_master_address(master_addr)
    port = args.master_port
    if port is None:
        port = free_port() if args.nnodes == 1 else default_master_port(os.environ)
    if args.node_rank == 0 and port_in_use(port):
        everywhere = " on every node" if args.nnodes > 1 else ""
        raise UserError(
            f"master port {port} is already in use on this machine; pass a free one{everywhere}, e.g. --master-port "
            f"{free_port()}"
        )

    threads = config.run.threads or threads_per_rank(local)
    resume = (
        ["--resume"]
        if resume_after_restart(config, os.environ, announcer=args.node_rank == 0) and not config.checkpoint.resume
        else []
    )
    child_argv = [
        sys.executable,
        "-m",
        "bnsgcn.launch.rank",
        *training_argv(argv),
        *resume,
        "--parts-dir",
        str(partition_set.path.resolve()),
        "--device",
        device,
        "--threads",
        str(threads),
    ]
    launch: dict[str, str] = {}
    export_launch_record(
        launch, launch_record("local", os.environ, nodes or (this_host() if args.nnodes == 1 else None))
    )
    # Large tensors in transparent huge pages: the kernels gather random feature rows, and
    # with 4 KiB pages nearly every row misses the TLB (see docs/benchmarks.md). A value
    # the user exported wins.
    shared_env = (
        {"THP_MEM_ALLOC_ENABLE": "1"}
        | os.environ
        | launch
        | {
            "MASTER_ADDR": master_addr,
            "GROUP_RANK": str(args.node_rank),  # which machine, as torchrun says it: the engine groups ranks by node
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(local),
            "OMP_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1",  # forward output as it happens
            LAUNCHER_PID_VARIABLE: str(os.getpid()),  # ranks die with this process
        }
    )
    if model_root is not None:  # the ranks import the model's class as this process did
        shared_env["PYTHONPATH"] = os.pathsep.join(filter(None, [model_root, shared_env.get("PYTHONPATH")]))
    if args.nnodes == 1 and not shared_env.get(JOB_TOKEN_VARIABLE):
        # the job's keys under a secret only its ranks know (bnsgcn.comm.store); across
        # machines every launcher would need the same one: exported by the user
        shared_env[JOB_TOKEN_VARIABLE] = secrets.token_hex(16)
    first = args.node_rank * local
    ranks = f"rank {first}" if local == 1 else f"ranks {first}-{first + local - 1}"
    on = f"{device}, {shared} per GPU (gloo)" if device == "cuda" and shared > 1 else device
    print(
        f"{prog}: starting {ranks} of {world_size} on {on} "
        f"({threads} thread{'s' if threads > 1 else ''} per rank), master {master_addr}:{port}",
        flush=True,
    )
    return [
        Child(rank=first + i, argv=child_argv, env=shared_env | {"RANK": str(first + i), "LOCAL_RANK": str(i)})
        for i in range(local)
    ]


def prepare_rank(
    args: argparse.Namespace, ranks: RankEnvironment, search_root: Path = DEFAULT_SEARCH_ROOT
) -> TrainConfig:
    """The configuration of this process as one rank of a torchrun/SLURM job.

    Exports the rendezvous variables and the launch record, resolves the partition set
    and device, and after a restart (torchrun's, or a requeued SLURM job) resumes from
    ``--out``.
    """
    check_launch_flags(args)
    if args.n_partitions is not None and args.n_partitions != ranks.world_size:
        raise UserError(
            f"--n-partitions {args.n_partitions} but this job has {ranks.world_size} ranks ({ranks.source}); drop "
            "--n-partitions or start as many ranks"
        )
    search_root = partition_set_location(args, search_root)
    config = from_args(args)
    model_import_root(config)
    device = choose_device(args, config)
    check_shared_gpus(args, config, device, one_rank=True)
    device = resolve_device(device, ranks.local_world_size, config.run.ranks_per_gpu)
    partition_set = choose_partition_set(
        config.data.parts_dir,
        None if config.sync.work_pool else ranks.world_size,
        search_root,
        dataset=args.dataset,
    )
    if config.data.parts_dir is None and ranks.rank == 0:
        announce(partition_set, search_root)
    check_world_size(partition_set, ranks.world_size, config.sync.work_pool)
    check_flags(config, ranks.world_size)
    check_master_address(ranks.master_addr)
    # Under srun, rank 0 opens the master port itself (torchrun's agent already holds it).
    if ranks.source == "slurm" and ranks.rank == 0 and port_in_use(ranks.master_port):
        raise UserError(
            f"master port {ranks.master_port} is already in use on this node; export MASTER_PORT=<free port> or pass "
            "--master-port"
        )
    resume = resume_after_restart(config, os.environ, announcer=ranks.rank == 0)
    ranks.export(os.environ)
    nodes = slurm_nodes(os.environ) if ranks.source == "slurm" or in_slurm_step(os.environ) else None
    export_launch_record(os.environ, launch_record(ranks.source, os.environ, nodes))
    return config.replace(
        parts_dir=partition_set.path.resolve(),
        device=device,
        threads=config.run.threads or ranks.threads,
        resume=resume,
    )


def _run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    master_port = default_master_port(os.environ) if args.master_port is None else args.master_port
    ranks = detect_rank_environment(
        os.environ, master_addr=args.master_addr, master_port=master_port, nnodes=args.nnodes
    )
    if ranks is None:
        return supervise(prepare_local_ranks(args, argv))
    return report_errors(lambda: train(prepare_rank(args, ranks)), rank=ranks.rank, debug=args.debug)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    return report_errors(lambda: _run(args, argv), rank=None, debug=args.debug)


def entry() -> NoReturn:
    """The ``bnsgcn-train`` command: :func:`main`, then :func:`~bnsgcn.launch.rank.exit_rank`, as
    this process may have been a rank (under torchrun or srun)."""
    exit_rank(main())


if __name__ == "__main__":
    entry()
