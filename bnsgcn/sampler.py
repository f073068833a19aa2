"""Per-epoch random boundary node sampling, seeded and reproducible."""

from __future__ import annotations

import hashlib

import torch


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (e.g. run seed, rank, epoch), the same on every machine."""
    digest = hashlib.sha256(":".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def sample_boundary(n_boundary: int, p: float, seed: int, rank: int, epoch: int) -> torch.Tensor:
    """Keep each boundary node independently with probability ``p``.

    Returns bool [n_boundary]. The draw depends only on (seed, rank, epoch), so a resumed
    run samples exactly what the uninterrupted run would have. Bernoulli sampling makes
    ``1/p`` scaling exactly unbiased: E[keep_u / p] = 1.
    """
    if p >= 1.0:
        return torch.ones(n_boundary, dtype=torch.bool)
    if p <= 0.0:
        return torch.zeros(n_boundary, dtype=torch.bool)
    generator = torch.Generator().manual_seed(derive_seed(seed, rank, epoch, 0x5A4D))
    return torch.rand(n_boundary, generator=generator) < p
