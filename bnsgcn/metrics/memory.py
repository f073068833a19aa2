"""Where a rank's memory goes, and keeping freed memory from staying resident.

Two things live here:

* :func:`return_freed_memory`: glibc's allocator serves requests below its *mmap threshold*
  from the heap, and after a large block is freed it raises that threshold (up to 32 MiB)
  to the block's size. The engine's temporaries (per-edge index arrays while the adjacency
  is built, 10-30 MiB each; dropout masks) then land on the heap, where one small block
  allocated after them keeps the whole range resident: on the reference graph that held
  about 100 MiB per rank that no tensor used (docs/benchmarks.md, "Lean engine"). A fixed
  threshold keeps every block of 1 MiB or more in its own mapping, returned to the system
  when freed.
* :func:`holders`: the bytes each kind of long-lived tensor holds on a rank (partition
  data, precomputed aggregation, adjacency, training's and evaluation's exchange buffers,
  parameters, optimizer state), for the memory report (:mod:`bnsgcn.metrics.report`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the report (bnsgcn-report) reads HOLDERS without importing torch
    import torch

# glibc's mallopt parameter numbers (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks at least this large get their own mapping: page-fault cost is small next to the
# work on a block this size, and the heap keeps only small objects.
MMAP_THRESHOLD_BYTES = 1 << 20


@functools.cache
def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD_BYTES` (and trim the heap top
    from that size on), once per process. Returns whether the allocator took it (False on
    a C library without ``mallopt``, e.g. musl or macOS: nothing changes there).

    The price, mapping, faulting in and zeroing every block afresh, is left to training's
    buffer pool (:mod:`bnsgcn.kernels.buffers`), which reuses the step's large outputs; a
    threshold of 32 MiB after setup measured 90-120 MiB more peak per rank on the
    reference graph (the heap fragments).
    """
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    # Setting either disables glibc's dynamic threshold adjustment.
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, MMAP_THRESHOLD_BYTES)
    )


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and repeats counted once;
    None skipped)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_state_tensors(optimizer) -> list[torch.Tensor]:
    """Every tensor an optimizer keeps per parameter (Adam: step, exp_avg, exp_avg_sq; SGD: momentum_buffer)."""
    import torch  # loaded already: an optimizer exists

    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


# holder -> (label in the report table); the report lists them in this order
HOLDERS = {
    "partition_bytes": "partition tensors",
    "precomputed_bytes": "precomputed aggregation",
    "adjacency_bytes": "adjacency",
    "exchange_buffer_bytes": "exchange buffers",
    "evaluation_buffer_bytes": "evaluation buffers",
    "activation_buffer_bytes": "activation buffers",
    "parameter_bytes": "parameters and gradients",
    "optimizer_state_bytes": "optimizer state",
}


def holders(
    partition: Iterable[torch.Tensor | None],
    precomputed: Iterable[torch.Tensor | None],
    adjacency: Iterable[torch.Tensor | None],
    exchange_buffer_bytes: int,
    evaluation_buffer_bytes: int,
    activation_buffer_bytes: int,
    parameters: Iterable[torch.Tensor | None],
    optimizer_state: Iterable[torch.Tensor | None],
) -> dict[str, int]:
    """Bytes per holder of :data:`HOLDERS`, each storage counted once per holder (a
    precomputed aggregation shared by the training and the evaluation graph is one).
    Exchange buffers (training's; evaluation's, :mod:`bnsgcn.run.evaluate`) and the blocks
    training's activations and gradients are reused from (:mod:`bnsgcn.kernels.buffers`;
    what backward keeps lives in them too) come as bytes at their largest: they are freed
    before and after each evaluation."""
    return {
        "partition_bytes": storage_bytes(partition),
        "precomputed_bytes": storage_bytes(precomputed),
        "adjacency_bytes": storage_bytes(adjacency),
        "exchange_buffer_bytes": exchange_buffer_bytes,
        "evaluation_buffer_bytes": evaluation_buffer_bytes,
        "activation_buffer_bytes": activation_buffer_bytes,
        "parameter_bytes": storage_bytes(parameters),
        "optimizer_state_bytes": storage_bytes(optimizer_state),
    }
