"""Checkpoints: atomic, last K kept, loaded with ``torch.load(weights_only=True)``.

Sampling and dropout are seeded from (seed, rank, epoch), so model, optimizer, epoch and
the best-validation record are all the state a resumed run needs to continue exactly.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from .errors import UserError

_NAME = re.compile(r"^checkpoint-(\d+)\.pt$")


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save(run_dir: Path, epoch: int, state: dict, keep: int) -> Path:
    """Write ``checkpoint-<epoch>.pt`` via a temporary file and keep the newest ``keep``."""
    folder = checkpoint_dir(run_dir)
    path = folder / f"checkpoint-{epoch:06d}.pt"
    tmp = path.with_suffix(".pt.tmp")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"epoch": epoch, **state}, tmp)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise UserError(f"cannot write checkpoint {path} ({exc.strerror}); free space or pass a writable --out") from None
    for old in _list(folder)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def _list(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if _NAME.match(p.name)), key=lambda p: int(_NAME.match(p.name).group(1)))


def has_checkpoints(run_dir: Path) -> bool:
    return bool(_list(checkpoint_dir(run_dir)))


def load_latest(run_dir: Path, signature: dict) -> dict | None:
    """The newest checkpoint that loads, or None when there is none.

    A checkpoint written for another partition set or model configuration (its
    ``signature`` differs) is refused with :class:`UserError`.
    """
    for path in reversed(_list(checkpoint_dir(run_dir))):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # a torn or corrupt file: fall back to the previous one
            continue
        if state.get("signature") != signature:
            theirs, ours = state.get("signature", {}), signature
            diff = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
            raise UserError(
                f"{path} was written for a different run ({', '.join(diff)} differ); "
                "resume with the same partition set and model flags, or pass a new --out"
            )
        return state
    return None
