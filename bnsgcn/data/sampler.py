"""Per-epoch random boundary node sampling, seeded and reproducible."""

from __future__ import annotations

import hashlib

import torch


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (e.g. run seed, rank, epoch), the same on every machine."""
    digest = hashlib.sha256(":".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def sample_boundary(boundary_counts: list[int], p: float, seed: int, rank: int, epoch: int) -> torch.Tensor:
    """Keep a random subset of each owner's boundary nodes, each node with probability ``p``.

    ``boundary_counts[q]`` boundary nodes (consecutive) are owned by rank q. From those,
    ``s_q = floor(p * n_q + u)`` with ``u ~ U[0, 1)`` are drawn uniformly without
    replacement. Then ``E[s_q] = p * n_q``, so every node is kept with probability exactly
    ``p`` and ``1/p`` scaling is unbiased, while the rows requested from each owner are
    ``p * n_q`` up to one (the exchanged volume is proportional to ``p`` every epoch, not
    only on average). Returns bool [sum(boundary_counts)].

    The draw depends only on (seed, rank, epoch): a resumed run samples exactly what the
    uninterrupted run would have.
    """
    n_boundary = sum(boundary_counts)
    if p >= 1.0:
        return torch.ones(n_boundary, dtype=torch.bool)
    keep = torch.zeros(n_boundary, dtype=torch.bool)
    if p <= 0.0:
        return keep
    generator = torch.Generator().manual_seed(derive_seed(seed, rank, epoch, 0x5A4D))
    offset = 0
    for n, u in zip(boundary_counts, torch.rand(len(boundary_counts), generator=generator).tolist()):
        chosen = torch.randperm(n, generator=generator)[: int(p * n + u)]
        keep[offset + chosen] = True
        offset += n
    return keep
