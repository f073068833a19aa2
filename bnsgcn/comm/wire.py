r"""Boundary rows on the wire: float32 rows sent as fp16, bf16, int8 or int4.

Only what crosses the network changes; every rank computes in float32 on what it decodes.

* ``fp16``, ``bf16``: each value cast (round to nearest), 2 bytes.
* ``int8``, ``int4`` (``b`` bits): each row ``x`` [D] travels as codes ``q`` [D] in
  ``[0, 2^b - 1]`` and two bfloat16 numbers, its lower end ``lo <= min(x)`` and step
  ``s >= (max(x) - lo) / (2^b - 1)`` (both rounded outwards from float32, so the codes
  cover the row), decoded as ``lo + q s``. Codes round stochastically,

  .. math:: q = \lfloor (x - lo) / s + u \rfloor,\quad u \sim U[0, 1),

  so ``E[lo + q s] = x``: the decoded row is an unbiased estimate of the sent one, off by
  less than one step ``s`` per element. On CPU the codes come from one numba pass with a
  counter-based generator (24-bit ``u``) seeded from torch's (``BNSGCN_KERNELS=torch``:
  torch's ``rand``, as on GPUs). int4 packs two codes to a byte (a row of odd width
  gets one padding code). Bytes per row: ``D + 4`` (int8), ``ceil(D / 2) + 4`` (int4).

Rows of any shape [n, *row] are encoded as [n, prod(row)]; codes and the two numbers of a
row travel together in one uint8 row, so one all-to-all carries everything.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from bnsgcn.config import WIRE_FORMATS as FORMATS
from bnsgcn.kernels import kernel_backend

_CASTS = {"fp16": torch.float16, "bf16": torch.bfloat16}
_BITS = {"int8": 8, "int4": 4}
_HEADER_BYTES = 4  # lo and step, bfloat16 each


class WireFormat:
    """How the rows of one direction (features or their gradients) are sent."""

    def __init__(self, name: str) -> None:
        if name not in FORMATS:
            raise ValueError(f"unknown wire format {name!r}")
        self.name = name

    @property
    def exact(self) -> bool:
        """Rows travel as they are (``none``)."""
        return self.name == "none"

    @property
    def draws_random_numbers(self) -> bool:
        """Encoding rounds at random (int8, int4: stochastic rounding from torch's generator)."""
        return self.name in _BITS

    def wire_shape(self, row: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of one encoded row of shape ``row``."""
        if self.name in ("none", *_CASTS):
            return row
        width = math.prod(row)
        return (_payload_bytes(width, _BITS[self.name]) + _HEADER_BYTES,)

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if self.name == "none":
            return dtype
        return _CASTS.get(self.name, torch.uint8)

    def encode(self, rows: Tensor, out: Tensor) -> Tensor:
        """Encode ``rows`` [n, *row] into ``out`` [n, *wire_shape(row)]; returns ``out``."""
        if self.name == "none" or self.name in _CASTS:
            return out.copy_(rows)  # a cast rounds to nearest
        return out.copy_(quantize(rows.reshape(rows.shape[0], math.prod(rows.shape[1:])), _BITS[self.name]))

    def decode(self, wire: Tensor, row: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """Rows [n, *row] of ``dtype`` from ``wire`` (``wire`` itself for ``none``)."""
        if self.name == "none":
            return wire
        if self.name in _CASTS:
            return wire.to(dtype)
        return dequantize(wire, math.prod(row), _BITS[self.name]).to(dtype).view(wire.shape[0], *row)


EXACT = WireFormat("none")


def _payload_bytes(width: int, bits: int) -> int:
    return width if bits == 8 else (width + 1) // 2


def _round_outwards_to_bf16(values: Tensor, up: bool) -> Tensor:
    """float32 ``values`` rounded to the bfloat16 grid, up (toward +inf) or down."""
    bits = values.contiguous().view(torch.int32)
    truncated = bits & ~0xFFFF  # toward zero in magnitude
    moved = truncated != bits
    away = moved & ((values > 0) if up else (values < 0))  # these must grow in magnitude
    return torch.where(away, truncated + 0x10000, truncated).view(torch.float32)


def _bf16_bytes(values: Tensor) -> Tensor:
    """The upper half of float32 values on the bfloat16 grid: uint8 [n, 2]."""
    return (values.view(torch.int32) >> 16).to(torch.int16).view(torch.uint8).view(-1, 2)


def _from_bf16_bytes(raw: Tensor) -> Tensor:
    return (raw.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32).flatten()


def quantize(rows: Tensor, bits: int, generator: torch.Generator | None = None) -> Tensor:
    """float32 [n, D] -> uint8 [n, payload + 4]: codes, then lo and step (see the module)."""
    rows = rows.float()
    levels = (1 << bits) - 1
    n, width = rows.shape
    if width == 0 or n == 0:
        return torch.zeros(n, _payload_bytes(width, bits) + _HEADER_BYTES, dtype=torch.uint8, device=rows.device)
    lo = _round_outwards_to_bf16(rows.amin(1), up=False)
    step = _round_outwards_to_bf16((rows.amax(1) - lo) / levels, up=True)
    inv_step = 1.0 / step.clamp(min=torch.finfo(torch.float32).tiny)
    codes = kernel_backend(rows.device).quantize_codes(rows, lo, inv_step, levels, generator)
    if bits == 4:
        if width % 2:
            codes = torch.cat([codes, codes.new_zeros(n, 1)], 1)
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return torch.cat([codes, _bf16_bytes(lo), _bf16_bytes(step)], 1)


def dequantize(wire: Tensor, width: int, bits: int) -> Tensor:
    """uint8 [n, payload + 4] -> float32 [n, width]: ``lo + q step``."""
    if wire.shape[0] == 0:
        return torch.zeros(0, width, device=wire.device)
    payload = _payload_bytes(width, bits)
    codes = wire[:, :payload]
    if bits == 4:
        codes = torch.stack([codes & 0x0F, codes >> 4], 2).view(wire.shape[0], 2 * payload)[:, :width]
    lo = _from_bf16_bytes(wire[:, payload : payload + 2])
    step = _from_bf16_bytes(wire[:, payload + 2 : payload + 4])
    return torch.addcmul(lo[:, None], codes.float(), step[:, None])
