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
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from typing import TYPE_CHECKING

import psutil
import torch

from bnsgcn.metrics.report import peak_memory_of
from bnsgcn.metrics.timing import DeviceClock

if TYPE_CHECKING:  # hints only: every stage reports here, and this module imports none of them
    from bnsgcn.comm.communicator import Comm

CATEGORIES = ("features", "gradients", "selections", "reduction", "evaluation", "control")
# injected_delay: --inject-delay's sleep (a testing aid, never compute); sync: waits on other
# ranks while averaging parameters (--sync other than allreduce, bnsgcn.sync.averaging)
TIMES = (
    "sampling",
    "forward",
    "backward",
    "exchange_selections",
    "exchange_forward",
    "exchange_backward",
    "reduction",
    "evaluation",
    "idle",
    "injected_delay",
    "sync",
)
COLUMNS = (
    ("loss_sum", "sampled_boundary", "epoch_time")
    + tuple(f"time_{t}" for t in TIMES)
    + tuple(f"sent_{c}" for c in CATEGORIES)
    + tuple(f"received_{c}" for c in CATEGORIES)
    # all-to-all bytes sent to ranks on this node / on other nodes (a part of sent_*)
    + tuple(f"intra_node_{c}" for c in CATEGORIES)
    + tuple(f"inter_node_{c}" for c in CATEGORIES)
    # steps: optimizer steps this rank took; elapsed: seconds since the run's first epoch
    # began, at this epoch's end (with a decoupled --sync, ranks end an epoch at different times)
    + ("saved_activation_bytes", "steps", "elapsed")
    # --max-lag (bnsgcn.exchange.bounded_lag): the most epochs behind of any rows or gradients this rank used
    # in the epoch, and the seconds it waited because they would have been older than allowed
    # (a part of the exchange times, not a phase of its own)
    + ("lag", "time_lag_wait")
    # the L2 norm of the gradients of the epoch's step (summed over the steps of a --work-pool
    # epoch): with the loss, what tells a run gone non-finite
    + ("grad_norm",)
    # this process's peak memory so far, at the epoch's end (peak_memory_bytes below)
    + ("peak_memory_bytes",)
)
INDEX = {name: i for i, name in enumerate(COLUMNS)}


class EpochAccount:
    """One rank's figures for one epoch, filled as the epoch runs.

    Phases are timed on the device's clock (:class:`~bnsgcn.metrics.timing.DeviceClock`: CUDA events
    on CUDA, host time on CPU) and resolved once, by :meth:`take_comm` or :meth:`gather` at
    the epoch's end. ``loss_sum`` and ``grad_norm`` may be left device tensors: they are
    read there too, together.
    """

    def __init__(self, device: torch.device | None = None, clock: DeviceClock | None = None) -> None:
        self.values: dict[str, float | torch.Tensor] = dict.fromkeys(COLUMNS, 0.0)
        self._saved: dict[int, int] = {}
        self.clock = clock or DeviceClock(device or torch.device("cpu"))

    def timed(self, name: str):
        """Time a phase of the epoch as ``time_{name}`` (``epoch``: the whole epoch, ``epoch_time``)."""
        return self.clock.timed("epoch_time" if name == "epoch" else f"time_{name}")

    def _resolve(self) -> None:
        for key, seconds in self.clock.resolve().items():
            self.values[key] += seconds
        self.clock.reset()

    @contextmanager
    def saved_tensors(self, resident: Callable[[], Iterable[torch.Tensor | None]] = tuple):
        """Count the bytes autograd keeps for backward (each storage once), plus those
        :meth:`keep` names, less the storages ``resident()`` returns at the end: tensors the
        rank holds anyway (partition data, the precomputed aggregation, exchange buffers),
        which the memory report shows under their own holders."""

        def pack(t: torch.Tensor) -> torch.Tensor:
            self.keep([t])
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        for t in resident():
            if t is not None:
                self._saved.pop(t.untyped_storage().data_ptr(), None)
        self.values["saved_activation_bytes"] = float(sum(self._saved.values()))

    def keep(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count ``tensors`` as kept for backward: what autograd's hooks do not see, such
        as a checkpointed segment's inputs (:class:`bnsgcn.nn.model.GNN`)."""
        for t in tensors:
            storage = t.untyped_storage()
            self._saved[storage.data_ptr()] = storage.nbytes()

    def take_comm(self, comm: Comm) -> None:
        """Move the communicator's byte and second counters into this epoch's row."""
        self._resolve()
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

    def row(self) -> torch.Tensor:
        """This rank's row as it stands: float64 [len(COLUMNS)] (resolves the clock and reads
        the loss; what :meth:`gather` sends, and what decoupled ``--sync`` modes keep until a
        sync point, :class:`bnsgcn.sync.averaging.EpochTables`)."""
        self._resolve()
        on_device = [c for c in ("loss_sum", "grad_norm") if isinstance(self.values[c], torch.Tensor)]
        if on_device:  # the one read of the epoch's device values
            read = torch.stack([self.values[c].to(torch.float64) for c in on_device]).tolist()
            self.values.update(zip(on_device, read))
        return torch.tensor([self.values[c] for c in COLUMNS], dtype=torch.float64)

    def gather(self, comm: Comm) -> torch.Tensor:
        """Every rank's row: float64 [world_size, len(COLUMNS)] (on the CPU).

        The epoch's device work is finished first (resolving its events waits for the last),
        so the host time spent in the barrier is the time this rank's device stood idle
        waiting for the slowest rank, on either device."""
        self.row()
        start = time.perf_counter()
        comm.barrier()  # returns when the slowest rank arrives
        self.values["time_idle"] = time.perf_counter() - start
        table = torch.zeros(comm.world_size, len(COLUMNS), dtype=torch.float64)
        table[comm.rank] = torch.tensor([self.values[c] for c in COLUMNS], dtype=torch.float64)
        return comm.all_reduce(table.to(comm.device, non_blocking=True)).cpu()


def peak_memory(device: torch.device) -> dict[str, int]:
    """Peak memory of this process: CUDA allocated/reserved, or resident set size on CPU."""
    figures = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if device.type == "cuda":
        figures["peak_cuda_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        figures["peak_cuda_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    return figures


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory so far as the report's "peak memory" counts it
    (:func:`bnsgcn.metrics.report.peak_memory_of`)."""
    return peak_memory_of(peak_memory(device))


def resident_bytes() -> int:
    """Resident set size of this process now."""
    return psutil.Process().memory_info().rss


def static_figures(
    comm: Comm, n_inner: int, n_boundary: int, edges: int, holder_bytes: dict[str, int], baseline_rss_bytes: int
) -> dict:
    """What a rank reports once, at the end of training. ``holder_bytes``: bytes per
    long-lived holder (:func:`bnsgcn.metrics.memory.holders`; ``partition_bytes`` among them)."""
    return {
        "rank": comm.rank,
        "host": socket.gethostname(),
        "device": str(comm.device),
        "inner_nodes": n_inner,
        "boundary_nodes": n_boundary,
        "edges": edges,
        **holder_bytes,
        "baseline_rss_bytes": baseline_rss_bytes,
        **peak_memory(comm.device),
    }
