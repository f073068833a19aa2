"""Per-rank accounting: where time, bytes and memory go on each rank.

Every epoch each rank fills one row of :data:`COLUMNS`; one all-reduce of a
[world_size, len(COLUMNS)] table gives every rank everybody's row (the time a rank
waits in the barrier before it is its idle time: it waits for the slowest rank).
Rank 0 sums the rows over epochs and, at the end, gathers each rank's static figures
(:func:`static_figures`) to write the memory-balance report.
"""

from __future__ import annotations

import resource
import socket
import time
from contextlib import contextmanager

import psutil
import torch

from .comm import Comm

CATEGORIES = ("features", "gradients", "selections", "reduction", "evaluation", "control")
TIMES = ("sampling", "forward", "backward", "exchange_selections", "exchange_forward", "exchange_backward", "reduction", "evaluation", "idle")
COLUMNS = (
    ("loss_sum", "sampled_boundary", "epoch_time")
    + tuple(f"time_{t}" for t in TIMES)
    + tuple(f"sent_{c}" for c in CATEGORIES)
    + tuple(f"received_{c}" for c in CATEGORIES)
    # all-to-all bytes sent to ranks on this node / on other nodes (a part of sent_*)
    + tuple(f"intra_node_{c}" for c in CATEGORIES)
    + tuple(f"inter_node_{c}" for c in CATEGORIES)
    + ("saved_activation_bytes",)
)
INDEX = {name: i for i, name in enumerate(COLUMNS)}


class EpochAccount:
    """One rank's figures for one epoch, filled as the epoch runs."""

    def __init__(self) -> None:
        self.values = dict.fromkeys(COLUMNS, 0.0)
        self._saved: dict[int, int] = {}

    @contextmanager
    def timed(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.values[f"time_{name}"] += time.perf_counter() - start

    @contextmanager
    def saved_tensors(self):
        """Count the bytes autograd keeps for backward (each storage once)."""

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            self._saved[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.values["saved_activation_bytes"] = float(sum(self._saved.values()))

    def take_comm(self, comm: Comm) -> None:
        """Move the communicator's byte and second counters into this epoch's row."""
        stats = comm.stats
        for c in CATEGORIES:
            self.values[f"sent_{c}"] += stats.sent.get(c, 0)
            self.values[f"received_{c}"] += stats.received.get(c, 0)
            self.values[f"intra_node_{c}"] += stats.sent_intra.get(c, 0)
            self.values[f"inter_node_{c}"] += stats.sent_inter.get(c, 0)
        # The selections all-to-all runs inside the sampling step; its time (mostly waiting
        # for the slowest rank) is communication, not sampling work.
        self.values["time_exchange_selections"] += stats.seconds.get("selections", 0.0)
        self.values["time_sampling"] -= stats.seconds.get("selections", 0.0)
        self.values["time_exchange_forward"] += stats.seconds.get("features", 0.0)
        self.values["time_exchange_backward"] += stats.seconds.get("gradients", 0.0)
        stats.reset()

    def gather(self, comm: Comm) -> torch.Tensor:
        """Every rank's row: float64 [world_size, len(COLUMNS)] (on the CPU)."""
        start = time.perf_counter()
        comm.barrier()  # returns when the slowest rank arrives
        self.values["time_idle"] = time.perf_counter() - start
        table = torch.zeros(comm.world_size, len(COLUMNS), dtype=torch.float64)
        table[comm.rank] = torch.tensor([self.values[c] for c in COLUMNS], dtype=torch.float64)
        return comm.all_reduce(table.to(comm.device)).cpu()


def peak_memory(device: torch.device) -> dict[str, int]:
    """Peak memory of this process: CUDA allocated/reserved, or resident set size on CPU."""
    figures = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if device.type == "cuda":
        figures["peak_cuda_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        figures["peak_cuda_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    return figures


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def resident_bytes() -> int:
    """Resident set size of this process now."""
    return psutil.Process().memory_info().rss


def static_figures(comm: Comm, n_inner: int, n_boundary: int, edges: int, partition_bytes: int, baseline_rss_bytes: int) -> dict:
    """What a rank reports once, at the end of training."""
    return {
        "rank": comm.rank,
        "host": socket.gethostname(),
        "device": str(comm.device),
        "inner_nodes": n_inner,
        "boundary_nodes": n_boundary,
        "edges": edges,
        "partition_bytes": partition_bytes,
        "baseline_rss_bytes": baseline_rss_bytes,
        **peak_memory(comm.device),
    }
