"""Gradient all-reduce in buckets, overlapped with backward (as DDP does).

Parameters are grouped into buckets of about ``bucket_bytes`` (``--bucket-mb``) in
reverse forward order (the order backward produces their gradients: the last layer's
first, each norm between the layers around it). When
every gradient of a bucket has been accumulated its all-reduce starts asynchronously;
buckets are launched strictly in index order so all ranks issue the same sequence of
collectives.
The loss is already divided by the global number of training nodes, so the sum over
ranks is the full-graph gradient.
"""

from __future__ import annotations

import torch
from torch import nn

from bnsgcn.comm.communicator import Comm


class GradientReducer:
    """Sums the gradients of ``params`` (in the order forward uses them) over ranks."""

    def __init__(self, params: list[nn.Parameter], comm: Comm, bucket_bytes: int):
        self.comm = comm
        params = [p for p in params if p.requires_grad]
        self.buckets: list[list[nn.Parameter]] = []
        current: list[nn.Parameter] = []
        size = 0
        for p in reversed(params):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_bytes:
                self.buckets.append(current)
                current, size = [], 0
        if current:
            self.buckets.append(current)
        self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.flat = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device) for b in self.buckets]
        self._reset()
        if comm.world_size > 1:
            for p in params:
                p.register_post_accumulate_grad_hook(self._on_grad)

    def _reset(self) -> None:
        self.pending = [len(b) for b in self.buckets]
        self.launched = 0
        self.works: list = []

    def _on_grad(self, param: nn.Parameter) -> None:
        i = self.bucket_of[id(param)]
        self.pending[i] -= 1
        while self.launched < len(self.buckets) and self.pending[self.launched] == 0:
            self._launch(self.launched)

    def _launch(self, i: int) -> None:
        torch.cat([_grad(p).reshape(-1) for p in self.buckets[i]], out=self.flat[i])
        self.works.append(self.comm.all_reduce_async(self.flat[i]))
        self.launched += 1

    def finish(self) -> None:
        """Reduce what backward did not reach, wait for all buckets, write gradients back."""
        if self.comm.world_size > 1:
            while self.launched < len(self.buckets):
                self._launch(self.launched)
            for work in self.works:
                self.comm.wait(work)
            for bucket, flat in zip(self.buckets, self.flat):
                offset = 0
                for p in bucket:
                    n = p.numel()
                    _grad(p).copy_(flat[offset : offset + n].view_as(p))
                    offset += n
        self._reset()


def _grad(p: nn.Parameter) -> torch.Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad
