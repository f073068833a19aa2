"""Activation-sized buffers reused within and across training steps (CPU).

A tensor of 1 MiB or more gets its own memory mapping from the C library
(:func:`bnsgcn.metrics.memory.return_freed_memory`), returned to the system when the tensor is
freed. A training step of a 3-layer GraphSAGE on a 100,000-node partition allocates about
fifty such tensors (1.4 GB), and the kernel faults in and zeroes every one of them before
it is written: in a profile, 17% of the rank's CPU time was in the kernel, 11% zeroing
pages (docs/benchmarks.md, "Buffers reused").

A :class:`BufferPool` keeps a freed block for the next request of its size instead, from
one training step to the next: a step's forward then writes into the blocks the previous
step's backward freed, and in steady state no block is new. A block that a whole step
(one :func:`pooled` round) did not ask for goes back to the system at the round's end, so
the pool holds what a step holds alive at once, not what steps once needed. On the
reference graph the peak per rank measured 0-2% above the C library's alone.

The kernels that write every element of a new output (sparse products, dropout, the fused
layer norm), the dense products of :mod:`bnsgcn.kernels.dense` and the exchange's gradient
rows take it from :func:`empty`. With no pool active (the default, evaluation, and other
devices than the CPU) that is ``torch.empty``.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import Tensor

# Below this a block comes from the C library's heap, which reuses it anyway.
MIN_POOLED_BYTES = 1 << 20
# a tensor's dtype as numpy names it (every dtype a pooled kernel output has)
_NUMPY = {torch.float32: np.float32, torch.float64: np.float64, torch.uint8: np.uint8, torch.bool: np.bool_}


class _Block:
    """A block of memory, and the array over it that the tensor handed out keeps alive.

    The tensor is ``torch.from_numpy`` of that array: its storage refers to the array, the
    block only weakly, so the block is free once the storage is gone (every tensor, view
    and saved copy of it). The storage is referred to by tensors alone, as any other
    tensor's: autograd may add a second gradient into it in place (it does only when
    nothing else holds the storage) instead of allocating the sum.
    """

    def __init__(self, nbytes: int) -> None:
        # torch's allocator: 64-byte aligned (2 MiB with THP_MEM_ALLOC_ENABLE); a large numpy
        # array starts 16 bytes into its page, which cost 10-15% of an epoch here
        self.memory = torch.empty(nbytes, dtype=torch.uint8).numpy()
        self.handed_out: weakref.ref | None = None
        self.used = True  # handed out in this round (:meth:`BufferPool.trim`)

    def is_free(self) -> bool:
        return self.handed_out is None or self.handed_out() is None

    def hand_out(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        array = self.memory[: math.prod(shape) * dtype.itemsize].view(_NUMPY[dtype]).reshape(shape)
        self.handed_out = weakref.ref(array)
        self.used = True
        return torch.from_numpy(array)


class BufferPool:
    """Freed blocks of 1 MiB or more kept for the next request of their size (see the module)."""

    def __init__(self) -> None:
        self._blocks: dict[int, list[_Block]] = {}  # by size in bytes
        self.largest_bytes = 0  # the most the pool held at once

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype``."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < MIN_POOLED_BYTES or dtype not in _NUMPY:
            return torch.empty(shape, dtype=dtype)
        # the smallest free block that fits, up to twice the size (an activation [n, d] and
        # the gradient of the boundary rows [N_b, d] differ by a few percent)
        free = [
            (size, block)
            for size, blocks in self._blocks.items()
            if nbytes <= size <= 2 * nbytes
            for block in blocks
            if block.is_free()
        ]
        if free:
            block = min(free, key=lambda item: item[0])[1]
        else:
            block = _Block(nbytes)
            self._blocks.setdefault(nbytes, []).append(block)
            self.largest_bytes = max(self.largest_bytes, self.nbytes())
        return block.hand_out(shape, dtype)

    def nbytes(self) -> int:
        """Bytes the pool holds, in use or not."""
        return sum(size * len(blocks) for size, blocks in self._blocks.items())

    def trim(self) -> None:
        """End a round: let go of the free blocks it did not hand out (sizes a step no
        longer asks for, such as another p's boundary rows)."""
        for size, blocks in list(self._blocks.items()):
            blocks[:] = [block for block in blocks if block.used or not block.is_free()]
            for block in blocks:
                block.used = False
            if not blocks:
                del self._blocks[size]

    def clear(self) -> None:
        """Let go of every block (those in use are freed with their last tensor)."""
        self._blocks = {}


_active: BufferPool | None = None


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> Tensor:
    """An uninitialised contiguous tensor: from the active pool (:func:`pooled`) on CPU,
    else ``torch.empty``."""
    if _active is None or torch.device(device).type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    return _active.empty(tuple(shape), dtype)


@contextmanager
def pooled(pool: BufferPool | None) -> Iterator[None]:
    """Outputs made by :func:`empty` inside come from ``pool`` (``None``: ``torch.empty``);
    a round of the pool (:meth:`BufferPool.trim` at the end)."""
    global _active
    previous, _active = _active, pool
    try:
        yield
    finally:
        _active = previous
        if pool is not None:
            pool.trim()
