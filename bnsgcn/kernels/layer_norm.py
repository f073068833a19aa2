"""Layer norm, ReLU and dropout as one operation: the step between two hidden layers.

Apart, the three pass over the activation six times (three forward, three backward) and
keep the input, the ReLU's output and the dropout mask for backward. Fused, forward reads
the input once and writes the result and one mask bit per element on the numba backend (a
byte on the torch backend: dropped or negative before the ReLU); backward recomputes the
normalised input from the per-row mean and inverse deviation. Measured in docs/benchmarks.md ("Aggregation kernels").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from .backend import kernel_backend
from .dropout import LEVELS, dropout


class _LayerNormReluDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, shift: Tensor | None, weight: Tensor, bias: Tensor, eps: float, p: float) -> Tensor:
        ctx.scale = 1.0 / (1.0 - p)
        ctx.shifted = shift is not None
        shift = shift if shift is not None else x.new_zeros(x.shape[1])
        out, keep, mean, rstd = kernel_backend(x.device).layer_norm_relu_dropout(
            x, shift, weight, bias, eps, round(p * LEVELS), ctx.scale
        )
        ctx.save_for_backward(x, shift, weight, mean, rstd, keep)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout: Tensor) -> tuple[Tensor, Tensor | None, Tensor, Tensor, None, None]:
        x, shift, weight, mean, rstd, keep = ctx.saved_tensors
        dx, dshift, dweight, dbias = kernel_backend(dout.device).layer_norm_relu_dropout_backward(
            dout.contiguous(), x, shift, weight, mean, rstd, keep, ctx.scale
        )
        return dx, (dshift if ctx.shifted else None), dweight, dbias, None, None


def layer_norm_relu_dropout(
    x: Tensor, weight: Tensor, bias: Tensor, eps: float, p: float, training: bool, shift: Tensor | None = None
) -> Tensor:
    r"""``dropout(relu(layer_norm(x + c)))`` over the last dimension.

    .. math:: y_{vj} = \max\Big(0,\ \gamma_j \frac{x_{vj} + c_j - \mu_v}{\sqrt{\sigma_v^2 + \epsilon}} + \beta_j\Big)
              \cdot \frac{m_{vj}}{1 - p}

    with :math:`\mu_v, \sigma_v^2` the mean and (biased) variance of row ``v`` of ``x + c``
    and :math:`m_{vj}` kept with probability ``1 - p`` (as :func:`~bnsgcn.kernels.dropout`;
    no dropout when not ``training``). ``x`` [n, d] float32 or float64; ``weight``, ``bias``
    and ``shift`` (``c``, default 0) [d]; returns [n, d]. ``shift`` is the bias of the layer
    before, added here instead of in a pass of its own (and its gradient, the column sums
    of the input gradient, summed in backward's pass). Differentiable w.r.t. ``x``,
    ``shift``, ``weight`` and ``bias``.
    """
    p = p if training else 0.0
    if x.device.type != "cpu":
        return dropout(
            F.relu(F.layer_norm(x if shift is None else x + shift, x.shape[1:], weight, bias, eps)), p, training
        )
    return _LayerNormReluDropout.apply(x.contiguous(), shift, weight, bias, eps, p)
