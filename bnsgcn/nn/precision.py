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
    """On a CUDA device, let matmuls use TF32 with ``tf32`` (and cuDNN, as it does by
    default) and not otherwise: a process that runs several jobs does not carry one job's
    setting into the next. Returns whether TF32 is on. On CPU there is nothing to allow: the
    math stays float32, and :func:`torch.set_float32_matmul_precision` is not called, as it
    may change oneDNN's CPU matmuls."""
    if device.type != "cuda":
        return False
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    if tf32:
        torch.backends.cudnn.allow_tf32 = True
    return tf32


def float32_rows(x: Tensor) -> Tensor:
    """``x`` widened to float32 when it is of a lower precision (a bfloat16 product), for a
    sum or a norm to run in float32; ``x`` itself otherwise. Differentiable: the gradient
    returns in ``x``'s dtype."""
    return x.float() if x.dtype in LOWER_PRECISION else x
