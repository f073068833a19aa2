"""What a rank computes in: the dtypes of its matrix products, logits, loss and optimizer
state (``--precision``), recorded inside the rank by :func:`record_dtypes`."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .ranks import _wrap_steps

GEMMS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear"}


class _GemmDtypes(TorchDispatchMode):
    """Records the dtype of every dense matrix product's first operand (a sparse product, the
    aggregation of the torch kernels on CUDA, is a sum: float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in GEMMS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if all(t.layout == torch.strided for t in tensors):
                self.dtypes.add(str(tensors[0].dtype))
        return func(*args, **(kwargs or {}))


def record_dtypes():
    """Inside a rank: the dtypes of the matrix products, of the logits the loss reads and of
    the loss, and of the optimizer's state at each step (run_ranks' instrument)."""
    from bnsgcn.run import train

    seen = {"gemm": set(), "logits": set(), "loss": set(), "optimizer_state": set()}
    mode = _GemmDtypes()
    real_loss = train._loss_sum

    def loss_sum(logits, *args):
        loss = real_loss(logits, *args)
        seen["logits"].add(str(logits.dtype))
        seen["loss"].add(str(loss.dtype))
        return loss

    def state(optimizer):
        seen["optimizer_state"].update(str(t.dtype) for s in optimizer.state.values() for t in s.values())

    train._loss_sum = loss_sum
    undo = _wrap_steps(after=state)
    mode.__enter__()

    def collect():
        mode.__exit__(None, None, None)
        undo()
        train._loss_sum = real_loss
        return {k: sorted(v) for k, v in seen.items()} | {"gemm": sorted(mode.dtypes)}

    return collect
