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

from .errors import UserError


@dataclass
class CommStats:
    """Bytes and seconds per category since the last :meth:`reset`."""

    sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    received: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    sent_intra: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    sent_inter: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def reset(self) -> None:
        for counter in (self.sent, self.received, self.seconds, self.sent_intra, self.sent_inter):
            counter.clear()


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


class Comm:
    """One rank's view of the job: rank, world size, device and the collectives it uses."""

    def __init__(
        self, rank: int, world_size: int, local_rank: int, device: torch.device, timeout: float, nodes: Nodes | None = None, pipelined: bool = False
    ):
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.device = device
        self.timeout = timeout
        self.stats = CommStats()
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
                raise RuntimeError(f"collective got a tensor on {tensor.device}, but this rank communicates on {self.device}; move it to comm.device first")

    def _count(self, category: str, sent: int, received: int, seconds: float) -> None:
        self.stats.sent[category] += sent
        self.stats.received[category] += received
        self.stats.seconds[category] += seconds

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
        row_bytes = send.element_size() * math.prod(send.shape[1:])
        peers = self.node_ranks if within_node else range(self.world_size)
        me = self.node_rank if within_node else self.rank
        self._count(category, (sum(send_counts) - send_counts[me]) * row_bytes, (sum(recv_counts) - recv_counts[me]) * row_bytes, 0.0)
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
        return dist.all_to_all_single(out, send, output_split_sizes=recv_counts, input_split_sizes=send_counts, group=group, async_op=True)

    def all_to_all(
        self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int], out: torch.Tensor, category: str, within_node: bool = False
    ) -> torch.Tensor:
        """:meth:`all_to_all_start`, then wait for it; returns ``out``."""
        self.wait(self.all_to_all_start(send, send_counts, recv_counts, out, category, within_node), category)
        return out

    def all_reduce(self, tensor: torch.Tensor, category: str = "control") -> torch.Tensor:
        """Sum ``tensor`` over all ranks in place."""
        self._check_device(tensor)
        if self.world_size > 1:
            start = time.perf_counter()
            dist.all_reduce(tensor)
            nbytes = tensor.numel() * tensor.element_size()
            self._count(category, nbytes, nbytes, time.perf_counter() - start)
        return tensor

    def all_reduce_async(self, tensor: torch.Tensor) -> dist.Work | None:
        """Start summing ``tensor`` over all ranks on the gradient-reduction group."""
        self._check_device(tensor)
        if self.world_size == 1:
            return None
        nbytes = tensor.numel() * tensor.element_size()
        self._count("reduction", nbytes, nbytes, 0.0)
        return dist.all_reduce(tensor, group=self.reduce_group, async_op=True)

    def wait(self, work: dist.Work | None, category: str = "reduction") -> None:
        """Block until ``work`` (a started collective) is done; the wait counts as ``category``'s time."""
        if work is not None:
            start = time.perf_counter()
            work.wait()
            self.stats.seconds[category] += time.perf_counter() - start

    def all_gather_within_node(self, tensor: torch.Tensor, category: str) -> torch.Tensor:
        """Every rank of this node's ``tensor`` (same shape on each): [len(node_ranks), *shape]."""
        self._check_device(tensor)
        if len(self.node_ranks) == 1:
            return tensor.unsqueeze(0).clone()
        start = time.perf_counter()
        parts = [torch.empty_like(tensor) for _ in self.node_ranks]
        dist.all_gather(parts, tensor, group=self.node_group)
        nbytes = tensor.numel() * tensor.element_size() * (len(self.node_ranks) - 1)
        self._count(category, nbytes, nbytes, time.perf_counter() - start)
        self.stats.sent_intra[category] += nbytes
        return torch.stack(parts)

    def all_gather_object(self, obj: object) -> list:
        if self.world_size == 1:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
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

    def close(self) -> None:
        """Leave the job after a successful run: wait for every rank, then tear the groups
        down, so that no rank closes its connections while a peer still uses them."""
        if dist.is_initialized():
            self.barrier()
            dist.destroy_process_group()


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


def init_from_env(device: str, timeout: float, pipelined: bool = False) -> Comm:
    """Join the job described by MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK.

    ``device`` is ``cuda`` (NCCL, one GPU per local rank), ``cpu`` (gloo) or ``auto``
    (cuda when available). Every collective then fails after ``timeout`` seconds instead
    of waiting forever on a dead rank. ``pipelined``: the job keeps boundary exchanges in
    flight across epochs (``--staleness 1``), on a group of their own.
    """
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if torch.cuda.device_count() <= local_rank:
            raise UserError(
                f"rank {rank} needs GPU {local_rank} but this machine has {torch.cuda.device_count()}; "
                "start fewer ranks per machine or train on CPU with --procs"
            )
        torch.cuda.set_device(local_rank)
        torch_device, backend = torch.device("cuda", local_rank), "nccl"
        # NCCL reports a failed peer as an error instead of hanging.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    else:
        torch_device, backend = torch.device("cpu"), "gloo"
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timedelta(seconds=timeout)))
    # torchrun hands a restarted attempt the same store, still holding the dead attempt's
    # peer addresses: a prefix per attempt keeps the attempts apart.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(f"bnsgcn/attempt-{attempt}/", store),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
        device_id=torch_device if backend == "nccl" else None,
    )
    keys = [node_key()]
    if world_size > 1:
        keys = [None] * world_size
        dist.all_gather_object(keys, node_key())
    return Comm(rank, world_size, local_rank, torch_device, timeout, Nodes.from_keys(keys), pipelined)
