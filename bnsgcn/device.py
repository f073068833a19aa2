"""Which device a rank trains on: the one rule the launcher and the engine share."""

from __future__ import annotations

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(requested: str, local_ranks: int) -> str:
    """``cpu`` or ``cuda`` for ``--device requested`` with ``local_ranks`` ranks on this machine.

    ``auto`` means CUDA when this machine has a CUDA GPU for each of its ranks (rank
    ``LOCAL_RANK`` takes GPU ``LOCAL_RANK``), else CPU: every rank of a machine decides
    alike, so no job mixes NCCL and gloo ranks, and the launcher, which calls this before
    starting ranks, decides as its ranks will. ``cpu`` and ``cuda`` are taken as given.
    """
    if requested != "auto":
        return requested
    # Imported here: the launcher loads torch only when a device must be resolved.
    import torch

    return "cuda" if torch.cuda.device_count() >= max(local_ranks, 1) else "cpu"
