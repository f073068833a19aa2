"""Which device a rank trains on: the one rule the launcher and the engine share."""

from __future__ import annotations

DEVICES = ("auto", "cpu", "cuda")


def gpu_index(local_rank: int, ranks_per_gpu: int = 1) -> int:
    """The CUDA GPU (index among those visible) of local rank ``local_rank``: consecutive
    local ranks share a GPU, ``ranks_per_gpu`` of them each (``--ranks-per-gpu``)."""
    return local_rank // ranks_per_gpu


def gpus_needed(local_ranks: int, ranks_per_gpu: int = 1) -> int:
    """CUDA GPUs a machine needs for ``local_ranks`` ranks, ``ranks_per_gpu`` on each: ceil(ranks / N)."""
    return -(-max(local_ranks, 1) // ranks_per_gpu)


def backend_for(device: str, ranks_per_gpu: int = 1) -> str:
    """The process group backend of a job on ``device``: NCCL with one rank per GPU; gloo on
    CPU and where ranks share a GPU (NCCL refuses two ranks on one device)."""
    return "nccl" if device == "cuda" and ranks_per_gpu == 1 else "gloo"


def resolve_device(requested: str, local_ranks: int, ranks_per_gpu: int = 1) -> str:
    """``cpu`` or ``cuda`` for ``--device requested`` with ``local_ranks`` ranks on this machine.

    ``auto`` means CUDA when this machine has the GPUs its ranks need
    (:func:`gpus_needed`: one per ``ranks_per_gpu`` ranks; rank ``LOCAL_RANK`` takes GPU
    :func:`gpu_index`), else CPU: every rank of a machine decides alike, so no job mixes
    CUDA and CPU ranks, and the launcher, which calls this before starting ranks, decides as
    its ranks will. ``cpu`` and ``cuda`` are taken as given.
    """
    if requested != "auto":
        return requested
    # Imported here: the launcher loads torch only when a device must be resolved.
    import torch

    return "cuda" if torch.cuda.device_count() >= gpus_needed(local_ranks, ranks_per_gpu) else "cpu"
