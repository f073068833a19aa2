"""Recomputed segments: keep a function's inputs, recompute what its backward needs.

The idea and the rules of :func:`torch.utils.checkpoint.checkpoint` with
``use_reentrant=False``, without it: that function reads ``torch._dynamo``'s configuration
on every call, and importing ``torch._dynamo`` adds about 80 MiB to every rank's resident
memory (measured with torch 2.13), as much as a third of what a rank saves for backward on
a 200k-node graph. The engine needs one use of it (:class:`bnsgcn.nn.model.GNN`'s segments).

How: the forward pass runs ``fn(*args)`` normally (the autograd graph is recorded, so
gradients flow to ``args`` and parameters as without recomputation), but inside a
:class:`torch.autograd.graph.saved_tensors_hooks` that keeps no tensor: each tensor
autograd would save is replaced by its position in the segment. The first time backward
unpacks one, the segment runs again on the same inputs (detached), with the random state
of the forward pass restored and inside ``replay()`` (so an exchange inside hands out the
rows it received instead of moving them again), keeping every tensor autograd saves, in
order; the unpacked tensor is the one at the same position. The two passes must save the
same tensors in the same order: their number, shapes and dtypes are checked. The
recomputation runs under the autocast state of the forward pass (backward runs outside it),
so a bfloat16 product is recomputed in bfloat16 (``--precision bf16``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext

import torch
from torch import Tensor


class _Segment:
    """One forward pass of a segment: its inputs, random state and, once recomputed, the
    tensors the recomputation saved."""

    def __init__(self, fn: Callable[..., Tensor], args: tuple, replay: Callable[[], AbstractContextManager]) -> None:
        self.fn, self.args, self.replay = fn, args, replay
        self.cpu_rng = torch.get_rng_state()
        self.cuda_devices = sorted({a.device.index for a in args if isinstance(a, Tensor) and a.is_cuda})
        self.cuda_rng = [torch.cuda.get_rng_state(d) for d in self.cuda_devices]
        # device type -> the dtype autocast runs the forward pass's products in
        self.autocast = {d: torch.get_autocast_dtype(d) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)}
        self.metadata: list[tuple[torch.Size, torch.dtype]] = []  # of the tensors the forward would have saved
        self.saved: list[Tensor] | None = None

    def pack(self, tensor: Tensor) -> int:
        self.metadata.append((tensor.shape, tensor.dtype))
        return len(self.metadata) - 1

    def unpack(self, position: int) -> Tensor:
        if self.saved is None:
            self.saved = self._recompute()
            self.args = None  # recomputed: the inputs are not needed any more
        tensor = self.saved[position]
        if tensor is None:
            raise RuntimeError(
                "a recomputed segment's saved tensor was unpacked twice; backward through a segment runs once (no "
                "retain_graph)"
            )
        self.saved[position] = None  # backward unpacks each once: free it as the graph frees its own
        return tensor

    def _recompute(self) -> list[Tensor]:
        saved: list[Tensor] = []
        args = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, Tensor) else a for a in self.args]
        with torch.random.fork_rng(devices=self.cuda_devices):
            torch.set_rng_state(self.cpu_rng)
            for device, state in zip(self.cuda_devices, self.cuda_rng):
                torch.cuda.set_rng_state(state, device)
            with torch.enable_grad(), self.replay(), ExitStack() as contexts:
                for device_type, dtype in self.autocast.items():
                    contexts.enter_context(torch.autocast(device_type, dtype=dtype))
                contexts.enter_context(
                    torch.autograd.graph.saved_tensors_hooks(
                        lambda t: saved.append(t) or len(saved) - 1, lambda i: saved[i]
                    )
                )
                self.fn(*args)
        if [(t.shape, t.dtype) for t in saved] != self.metadata:
            raise RuntimeError(
                f"a recomputed segment saved {len(saved)} tensors for backward, its forward pass {len(self.metadata)} "
                "(or other shapes): the segment is not deterministic"
            )
        return saved


def recomputed(fn: Callable[..., Tensor], *args, replay: Callable[[], AbstractContextManager] = nullcontext) -> Tensor:
    """``fn(*args)``, keeping only ``args`` for backward (see the module)."""
    segment = _Segment(fn, args, replay)
    with torch.autograd.graph.saved_tensors_hooks(segment.pack, segment.unpack):
        return fn(*args)
