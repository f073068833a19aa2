"""``--precision``: the dtype of a rank's dense products.

* ``fp32``: everything float32.
* ``tf32``: on CUDA, matmuls and cuDNN may use TF32 (float32 storage, a 10-bit mantissa
  inside the tensor cores); on CPU nothing changes.
* ``bf16``: the forward pass (training and evaluation) runs inside
  :func:`torch.autocast` to bfloat16, so every GEMM (``nn.Linear``, the engine's own
  :mod:`bnsgcn.kernels.dense`) multiplies in bfloat16. Parameters, optimizer state, the loss
  and the reductions stay float32: the aggregations and norms widen a bfloat16 input to
  float32 first (:func:`float32_rows`), and the logits are float32 before the loss.

Prediction and export stay float32 whatever the run trained with.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor

LOWER_PRECISION = (torch.bfloat16, torch.float16)


def compute_precision(precision: str, device: torch.device) -> AbstractContextManager:
    """The context a forward pass of ``precision`` runs in on ``device``: autocast to
    bfloat16 for ``bf16``, nothing otherwise."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def allow_tf32(precision: str, device: torch.device) -> bool:
    """With ``tf32`` on a CUDA device, let its matmuls and cuDNN use TF32; returns whether
    that was done (on CPU there is nothing to allow: the math stays float32, and
    :func:`torch.set_float32_matmul_precision` is not called, as it may change oneDNN's CPU
    matmuls)."""
    if precision != "tf32" or device.type != "cuda":
        return False
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return True


def float32_rows(x: Tensor) -> Tensor:
    """``x`` widened to float32 when it is of a lower precision (a bfloat16 product), for a
    sum or a norm to run in float32; ``x`` itself otherwise. Differentiable: the gradient
    returns in ``x``'s dtype."""
    return x.float() if x.dtype in LOWER_PRECISION else x
