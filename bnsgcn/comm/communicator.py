"""All communication of a rank: process groups, all-to-all, all-reduce, with timeouts.

Every collective goes through :class:`Comm`, which also counts the bytes each rank sends
and receives per category (``features``, ``gradients``, ``selections``, ``reduction``,
``control``) and the seconds spent inside collectives, for the reports. The bytes an
all-to-all sends are also split by where the peer runs: on this rank's node
(``sent_intra``) or on another node (``sent_inter``, what crosses the network between
machines). All-reduce bytes are not split: which links they cross is the backend's choice. Tensors handed to
a collective must already be on :attr:`Comm.device` (NCCL rejects CPU tensors); Comm
refuses any other, on every backend and world size, so a test can declare another device
to see where callers put what they send, without a GPU.

Ranks that share a GPU (``--ranks-per-gpu`` above 1) run gloo on CUDA tensors, whose
point-to-point and some collective paths take host tensors only: there Comm stages every
collective through host memory (:attr:`Comm.host_staging`). The device tensors are copied
to pinned host tensors, the collective runs on those, and its results are copied back to
the device once it completes: at once for a blocking collective, in :meth:`Comm.wait`
(:class:`StagedWork`) for a started one. Callers see the same tensors and works either way.
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from bnsgcn.comm.store import JobStore, interface_reaching, job_prefix, serve
from bnsgcn.device import backend_for, gpu_index, resolve_device
from bnsgcn.errors import PeerLost, UserError, first_sentence
from bnsgcn.metrics.timing import DeviceClock

# How long a rank whose collective failed waits for its peers to fail too, before naming
# those that did not as the ones that stopped (see Comm.who_stopped).
STALL_WAIT_S = 3.0
FIRST_FAILURE_KEY = "first-failure"  # in the job's store: "rank R failed first: <its error>"


@dataclass
class CommStats:
    """Bytes and seconds per category since the last :meth:`reset`. Seconds are waits for
    collectives on ``clock`` (device time on CUDA: see :mod:`bnsgcn.metrics.timing`)."""

    sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    received: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    sent_intra: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    sent_inter: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    clock: DeviceClock = field(default_factory=lambda: DeviceClock(torch.device("cpu")))

    @property
    def seconds(self) -> dict[str, float]:
        """Seconds per category (resolves the clock's events: call it at an epoch's end)."""
        return self.clock.resolve()

    def reset(self) -> None:
        for counter in (self.sent, self.received, self.sent_intra, self.sent_inter):
            counter.clear()
        self.clock.reset()


@dataclass(frozen=True)
class Nodes:
    """Which machine (node) each rank runs on, as the launch says (see :func:`node_key`).

    ``node_of[r]``: node index of rank r (nodes numbered in order of their first rank);
    ``members[n]``: the ranks of node n, ascending.
    """

    node_of: tuple[int, ...]
    members: tuple[tuple[int, ...], ...]

    @classmethod
    def from_keys(cls, keys: list[str]) -> Nodes:
        index: dict[str, int] = {}
        node_of = tuple(index.setdefault(key, len(index)) for key in keys)
        return cls(node_of, tuple(tuple(r for r, n in enumerate(node_of) if n == node) for node in range(len(index))))

    @property
    def count(self) -> int:
        return len(self.members)

    @property
    def spans_machines_with_shared_nodes(self) -> bool:
        """More than one node, and more than one rank on some node: where relaying pays."""
        return self.count > 1 and any(len(m) > 1 for m in self.members)


class StagedWork:
    """A collective started on host copies of device tensors (:attr:`Comm.host_staging`).
    :meth:`wait` waits for it, then copies each result into the device tensor it stands
    for; the host tensors sent stay referenced until then."""

    def __init__(self, work: dist.Work, results: list[tuple[torch.Tensor, torch.Tensor]], sent: torch.Tensor):
        self.work = work
        self.results = results  # (device tensor, host tensor the collective writes)
        self.sent = sent

    def wait(self) -> bool:
        self.work.wait()
        for target, host in self.results:
            # from pinned memory: queued on the current stream, ahead of every kernel that reads target
            target.copy_(host, non_blocking=True)
        self.results, self.sent = [], None  # copied once, however often waited
        return True


class Comm:
    """One rank's view of the job: rank, world size, device and the collectives it uses.

    ``host_staging``: run every collective on host copies of the tensors (see the module),
    as gloo on CUDA tensors needs; :func:`init_from_env` sets it where ranks share a GPU.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        local_rank: int,
        device: torch.device,
        timeout: float,
        nodes: Nodes | None = None,
        pipelined: bool = False,
        store: JobStore | None = None,
        host_staging: bool = False,
    ):
        self.rank = rank
        self.host_staging = host_staging
        self.store = store  # the job's key-value store, every call bounded (see report_progress)
        self.world_size = world_size
        self.local_rank = local_rank
        self.device = device
        self.timeout = timeout
        self.stats = CommStats(clock=DeviceClock(device))
        self.nodes = nodes or Nodes.from_keys([""] * world_size)
        self.node = self.nodes.node_of[rank]
        self.node_ranks = self.nodes.members[self.node]
        self.node_rank = self.node_ranks.index(rank)
        # Gradient buckets are reduced asynchronously during backward while the boundary
        # exchange also runs there; a group of their own keeps the two streams of
        # collectives from interleaving.
        self.reduce_group = self._new_group() if world_size > 1 else None
        # Stale (pipelined) boundary exchanges stay in flight for a whole epoch; on a group
        # of their own they never hold up the synchronous collectives queued behind them.
        self.pipeline_group = self._new_group() if pipelined and world_size > 1 else None
        # One group per node for relaying boundary rows inside a node (every rank must
        # create every group, in the same order).
        self.node_group = self.node_pipeline_group = None
        if self.nodes.spans_machines_with_shared_nodes:
            self.node_group = self._node_groups()
            if pipelined:  # relays of stale rows and gradients, in flight across layers
                self.node_pipeline_group = self._node_groups()

    def _node_groups(self):
        """One group per node (every rank creates every group, in the same order); this rank's."""
        mine = None
        for members in self.nodes.members:
            group = self._new_group(list(members))
            if self.rank in members:
                mine = group
        return mine

    def _new_group(self, ranks: list[int] | None = None):
        return dist.new_group(ranks, backend=dist.get_backend(), timeout=timedelta(seconds=self.timeout))

    @property
    def backend(self) -> str:
        return dist.get_backend()

    def _check_device(self, *tensors: torch.Tensor) -> None:
        """Refuse tensors that are not on this rank's communication device. Comm does not
        copy them there itself: a silent copy would hide host-device traffic on hot paths."""
        for tensor in tensors:
            if tensor.device != self.device:
                raise RuntimeError(
                    f"collective got a tensor on {tensor.device}, but this rank communicates on {self.device}; move "
                    "it to comm.device first"
                )

    def _host(self, tensor: torch.Tensor, values: bool = True) -> torch.Tensor:
        """A host tensor shaped like ``tensor`` (pinned when it is on CUDA, so copies back are
        asynchronous), holding its values when ``values``."""
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
        if values:
            host.copy_(tensor)  # blocking: gloo reads it from its own threads once the collective starts
        return host

    def _count(self, category: str, sent: int, received: int) -> None:
        self.stats.sent[category] += sent
        self.stats.received[category] += received

    def all_to_all_start(
        self,
        send: torch.Tensor,
        send_counts: list[int],
        recv_counts: list[int],
        out: torch.Tensor,
        category: str,
        within_node: bool = False,
        pipelined: bool = False,
    ) -> dist.Work | None:
        """Start moving rows ``send[sum(send_counts[:r]) : ...]`` to rank r; rank r's rows land
        in ``out`` likewise once :meth:`wait` returns. Both buffers must stay untouched until then.

        ``send`` [sum(send_counts), *row], ``out`` [sum(recv_counts), *row] (contiguous).
        ``within_node``: among the ranks of this node only (:attr:`node_group`), counts
        indexed by position in :attr:`node_ranks`. ``pipelined``: on :attr:`pipeline_group`
        (a transfer that stays in flight across an epoch; the Comm must be made with
        ``pipelined=True``).
        """
        self._check_device(send, out)
        peers = self.node_ranks if within_node else range(self.world_size)
        _check_splits(send, send_counts, out, recv_counts, len(peers))
        row_bytes = send.element_size() * math.prod(send.shape[1:])
        me = self.node_rank if within_node else self.rank
        self._count(
            category, (sum(send_counts) - send_counts[me]) * row_bytes, (sum(recv_counts) - recv_counts[me]) * row_bytes
        )
        for peer, count in zip(peers, send_counts):
            if peer != self.rank:
                split = self.stats.sent_intra if self.nodes.node_of[peer] == self.node else self.stats.sent_inter
                split[category] += count * row_bytes
        if len(peers) == 1:
            out.copy_(send)
            return None
        if within_node:
            group = self.node_pipeline_group if pipelined else self.node_group
        else:
            group = self.pipeline_group if pipelined else None
        if pipelined and group is None:
            raise RuntimeError("a pipelined all-to-all needs a Comm made with pipelined=True")
        sent, received = (self._host(send), self._host(out, values=False)) if self.host_staging else (send, out)
        work = dist.all_to_all_single(
            received, sent, output_split_sizes=recv_counts, input_split_sizes=send_counts, group=group, async_op=True
        )
        return StagedWork(work, [(out, received)], sent) if self.host_staging else work

    def all_to_all(
        self,
        send: torch.Tensor,
        send_counts: list[int],
        recv_counts: list[int],
        out: torch.Tensor,
        category: str,
        within_node: bool = False,
    ) -> torch.Tensor:
        """:meth:`all_to_all_start`, then wait for it; returns ``out``."""
        self.wait(self.all_to_all_start(send, send_counts, recv_counts, out, category, within_node), category)
        return out

    def all_reduce(self, tensor: torch.Tensor, category: str = "control") -> torch.Tensor:
        """Sum ``tensor`` over all ranks in place."""
        self._check_device(tensor)
        if self.world_size > 1:
            with self.stats.clock.timed(category):
                if self.host_staging:
                    host = self._host(tensor)
                    dist.all_reduce(host)
                    tensor.copy_(host, non_blocking=True)
                else:
                    dist.all_reduce(tensor)
            nbytes = tensor.numel() * tensor.element_size()
            self._count(category, nbytes, nbytes)
        return tensor

    def all_reduce_async(self, tensor: torch.Tensor) -> dist.Work | None:
        """Start summing ``tensor`` over all ranks on the gradient-reduction group."""
        self._check_device(tensor)
        if self.world_size == 1:
            return None
        nbytes = tensor.numel() * tensor.element_size()
        self._count("reduction", nbytes, nbytes)
        if self.host_staging:
            host = self._host(tensor)
            return StagedWork(dist.all_reduce(host, group=self.reduce_group, async_op=True), [(tensor, host)], host)
        return dist.all_reduce(tensor, group=self.reduce_group, async_op=True)

    def wait(self, work: dist.Work | None, category: str = "reduction") -> None:
        """Block until ``work`` (a started collective) is done; the wait counts as ``category``'s time."""
        if work is not None:
            with self.stats.clock.timed(category):
                work.wait()

    def all_gather_within_node(self, tensor: torch.Tensor, category: str) -> torch.Tensor:
        """Every rank of this node's ``tensor`` (same shape on each): [len(node_ranks), *shape]."""
        self._check_device(tensor)
        if len(self.node_ranks) == 1:
            return tensor.unsqueeze(0).clone()
        mine = self._host(tensor) if self.host_staging else tensor
        parts = [torch.empty_like(mine) for _ in self.node_ranks]
        with self.stats.clock.timed(category):
            dist.all_gather(parts, mine, group=self.node_group)
        nbytes = tensor.numel() * tensor.element_size() * (len(self.node_ranks) - 1)
        self._count(category, nbytes, nbytes)
        self.stats.sent_intra[category] += nbytes
        gathered = torch.stack(parts)
        return gathered.to(self.device, non_blocking=True) if self.host_staging else gathered

    def all_gather_object(self, obj: object) -> list:
        if self.world_size == 1:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def gather_object(self, obj: object, dst: int = 0) -> list | None:
        """Every rank's ``obj`` on rank ``dst`` (a list by rank); None on the others."""
        if self.world_size == 1:
            return [obj]
        out: list | None = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def report_progress(self, stage: str) -> None:
        """Publish where this rank is (e.g. ``"epoch 7"``) in the job's store, for
        :meth:`who_stopped` on the other ranks. One small store write: call it per epoch,
        not per collective."""
        if self.store is not None and self.world_size > 1:
            self.store.set(f"progress/{self.rank}", stage)

    def report_failure(self, message: str) -> None:
        """Publish why this rank is failing (one line) before it exits, for
        :meth:`who_stopped` on its peers; best effort, the store may be gone already."""
        if self.store is None or self.world_size == 1:
            return
        try:
            # compare_set creates the key only if absent: the first failing rank's line stays.
            self.store.compare_set(FIRST_FAILURE_KEY, "", f"rank {self.rank} failed first: {message}", STALL_WAIT_S)
        except Exception:  # nothing more to do: this rank's own error line still says it
            pass

    def who_stopped(self, wait_s: float = STALL_WAIT_S) -> str | None:
        """After a collective failed: which rank caused it. A rank that failed for a reason
        of its own (:meth:`report_failure`) is named with its error; otherwise the ranks
        that stopped advancing, e.g. ``"rank 3 stopped at epoch 7"``.

        Every rank whose collective fails marks itself in the store; the ranks that have
        not done so within ``wait_s`` seconds (their peers time out together) are the ones
        that died or hang, named with the last stage they reported. None when every rank
        failed alike (nobody stopped: e.g. the network) or this rank cannot tell.
        """
        if self.store is None or self.world_size == 1:
            return None
        store = self.store
        try:  # every call bounded by wait_s: never wait --timeout again
            store.set(f"failed/{self.rank}", "1", wait_s)
            deadline = time.monotonic() + wait_s
            while True:
                if store.check([FIRST_FAILURE_KEY], wait_s):
                    return store.get(FIRST_FAILURE_KEY, wait_s).decode()
                silent = [r for r in range(self.world_size) if not store.check([f"failed/{r}"], wait_s)]
                if not silent or time.monotonic() >= deadline:
                    break
                time.sleep(0.1)
            stages = {
                r: store.get(f"progress/{r}", wait_s).decode() if store.check([f"progress/{r}"], wait_s) else "setup"
                for r in silent
            }
        except Exception:  # the store itself is gone or stopped: it lives in rank 0's process
            return None if self.rank == 0 else "rank 0 stopped (it holds the job's store, which does not answer)"
        if not silent:
            return None
        return ", ".join(f"rank {r} stopped at {stage}" for r, stage in stages.items()) + " while the others waited"

    def close(self) -> None:
        """Leave the job after a successful run: wait for every rank, then tear the groups
        down, so that no rank closes its connections while a peer still uses them."""
        if dist.is_initialized():
            self.barrier()
            dist.destroy_process_group()


def _check_splits(
    send: torch.Tensor, send_counts: list[int], out: torch.Tensor, recv_counts: list[int], peers: int
) -> None:
    """What NCCL's all-to-all needs, checked on every backend (gloo is more forgiving): one
    count per peer (plain ints, none negative; zeros are fine), buffers of exactly
    ``sum(counts)`` rows, one dtype and row shape on both sides, contiguous memory. Shapes
    only: no device synchronisation."""
    for name, counts, tensor in (("send", send_counts, send), ("receive", recv_counts, out)):
        if len(counts) != peers or any(type(c) is not int or c < 0 for c in counts):
            raise RuntimeError(f"all-to-all {name} counts {counts} must be {peers} non-negative ints")
        if tensor.dim() == 0 or tensor.shape[0] != sum(counts) or not tensor.is_contiguous():
            raise RuntimeError(
                f"all-to-all {name} buffer {tuple(tensor.shape)} must be contiguous with {sum(counts)} rows"
            )
    if send.dtype != out.dtype or send.shape[1:] != out.shape[1:]:
        raise RuntimeError(
            f"all-to-all sends {send.dtype} rows {tuple(send.shape[1:])} into {out.dtype} rows {tuple(out.shape[1:])}"
        )


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise UserError(f"environment variable {name} is not set: start ranks with bnsgcn-train, torchrun or srun")
    try:
        return int(value)
    except ValueError:
        raise UserError(f"environment variable {name}={value!r} is not an integer") from None


def node_key(environ: dict[str, str] | None = None) -> str:
    """Which machine this rank runs on, as its launch says: ``GROUP_RANK`` (set by
    bnsgcn-train's launcher from ``--node-rank``, and by torchrun), else ``SLURM_NODEID``
    (one srun task per rank), else the host name. Ranks with equal keys share a node."""
    environ = os.environ if environ is None else environ
    for name in ("GROUP_RANK", "SLURM_NODEID"):
        if name in environ:
            return f"{name}={environ[name]}"
    return f"host={socket.gethostname()}"


def _wait_for_master(address: str, port: int, timeout: float) -> None:
    """Wait until rank 0's store at ``address:port`` accepts a connection, for at most
    ``timeout`` seconds, then raise :class:`PeerLost` in one line. (torch's own client
    would fail the same way, but after logging every retry with a C++ backtrace.)"""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((address, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))).close()
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise PeerLost(
                    f"no answer from the master {address}:{port} within --timeout {timeout:g} s "
                    f"({exc.strerror or exc}); "
                    "check that rank 0 runs there and that MASTER_ADDR/MASTER_PORT (--master-addr/--master-port) name "
                    "it"
                ) from None
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def init_from_env(device: str, timeout: float, pipelined: bool = False, ranks_per_gpu: int = 1) -> Comm:
    """Join the job described by MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK.

    ``device`` is ``cuda`` (local rank L on GPU ``L // ranks_per_gpu``: NCCL with one rank
    per GPU, gloo staged through host memory where ranks share one), ``cpu`` (gloo) or
    ``auto`` (:func:`bnsgcn.device.resolve_device`: cuda when this machine has a GPU per
    ``ranks_per_gpu`` local ranks). Every collective then fails after ``timeout`` seconds
    instead of waiting forever on a dead rank. ``pipelined``: the job keeps boundary
    exchanges in flight across epochs (``--staleness 1``), on a group of their own.
    """
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), ranks_per_gpu)
    backend = backend_for(device, ranks_per_gpu)
    if device == "cuda":
        gpu = gpu_index(local_rank, ranks_per_gpu)
        if torch.cuda.device_count() <= gpu:
            raise UserError(
                f"rank {rank} (local rank {local_rank}, {ranks_per_gpu} per GPU) needs GPU {gpu} but this machine has "
                f"{torch.cuda.device_count()}; start fewer ranks per machine, share GPUs with --ranks-per-gpu, or "
                "train on CPU with --procs"
            )
        torch.cuda.set_device(gpu)
        torch_device = torch.device("cuda", gpu)
    else:
        torch_device = torch.device("cpu")
    if backend == "nccl":  # NCCL reports a failed peer as an error instead of hanging.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    master_addr, master_port = os.environ.get("MASTER_ADDR", ""), _env_int("MASTER_PORT")
    if rank != 0:
        _wait_for_master(master_addr, master_port, timeout)
    # ranks' own connections (gloo's pairs, NCCL's bootstrap) on the interface that reaches
    # the master: the loopback one for a job on one machine (a value the user exported wins)
    interface = interface_reaching(master_addr)
    if interface is not None:
        for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(variable, interface)
    try:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent serves the store
            store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timedelta(seconds=timeout)))
        elif rank == 0:
            store = serve(master_addr, master_port, world_size, timeout)
        else:
            store = dist.TCPStore(master_addr, master_port, world_size, False, timedelta(seconds=timeout))
    except dist.DistError as exc:
        raise PeerLost(
            f"not every rank joined within --timeout {timeout:g} s ({first_sentence(exc)}); see the other ranks' errors"
        ) from exc
    store = dist.PrefixStore(job_prefix(), store)
    try:
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
            device_id=torch_device if backend == "nccl" else None,
        )
    except dist.DistBackendError as exc:
        shared = next((line.strip() for line in str(exc).splitlines() if "Duplicate GPU" in line), None)
        if shared is None:
            raise
        # e.g. two launchers on one machine, each numbering its ranks' GPUs from 0
        raise UserError(
            f"rank {rank} shares its GPU with another rank of the job (NCCL: {shared}); to run several ranks on each "
            "GPU pass --ranks-per-gpu N (gloo), else give every rank of a machine its own LOCAL_RANK (one launcher per "
            "machine, or CUDA_VISIBLE_DEVICES per launcher), or train on CPU with --procs"
        ) from None
    keys = [node_key()]
    if world_size > 1:
        keys = [None] * world_size
        dist.all_gather_object(keys, node_key())
    return Comm(
        rank,
        world_size,
        local_rank,
        torch_device,
        timeout,
        Nodes.from_keys(keys),
        pipelined,
        JobStore(store, timeout),
        host_staging=backend == "gloo" and device == "cuda",
    )
