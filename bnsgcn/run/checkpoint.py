"""Checkpoints: atomic, last K kept, loaded with ``torch.load(weights_only=True)``.

Sampling and dropout are seeded from (seed, rank, epoch), so model, optimizer, epoch and
the best-validation record are all the state a resumed run needs to continue exactly,
except with ``--staleness 1``: then each rank also saves its stale boundary rows and
gradients (:meth:`bnsgcn.exchange.stale.StaleExchange.state_dict`; with ``--max-lag`` those of the
checkpoint's epoch, which every rank waits for, :meth:`bnsgcn.exchange.bounded_lag.LagExchange.state_dict`)
in a part of its own, ``checkpoint-<epoch>.rank-<r>.pt``, written before rank 0 writes the
checkpoint itself, so a checkpoint that exists has all its parts.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from bnsgcn.errors import UserError

_NAME = re.compile(r"^checkpoint-(\d+)\.pt$")
_PART = re.compile(r"^checkpoint-(\d+)\.rank-\d+\.pt$")


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save(run_dir: Path, epoch: int, state: dict, keep: int) -> Path:
    """Write ``checkpoint-<epoch>.pt`` via a temporary file and keep the newest ``keep``
    (with their parts)."""
    folder = checkpoint_dir(run_dir)
    path = _write(folder / f"checkpoint-{epoch:06d}.pt", {"epoch": epoch, **state})
    kept = {int(_NAME.match(p.name).group(1)) for p in _list(folder)[-keep:]}
    for old in folder.iterdir():
        match = _NAME.match(old.name) or _PART.match(old.name)
        if match and int(match.group(1)) not in kept:
            old.unlink(missing_ok=True)
    return path


def part_path(run_dir: Path, epoch: int, rank: int) -> Path:
    return checkpoint_dir(run_dir) / f"checkpoint-{epoch:06d}.rank-{rank}.pt"


def save_part(run_dir: Path, epoch: int, rank: int, state: dict) -> Path:
    """Write rank ``rank``'s own part of the checkpoint of ``epoch`` (before :func:`save`)."""
    return _write(part_path(run_dir, epoch, rank), state)


def load_part(run_dir: Path, epoch: int, rank: int) -> dict:
    """Rank ``rank``'s part of the checkpoint of ``epoch``."""
    path = part_path(run_dir, epoch, rank)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(
            f"{path} is missing: the checkpoint of epoch {epoch} is incomplete; restore the file or pass a new --out"
        ) from None
    except Exception as exc:  # a torn or corrupt file
        raise UserError(
            f"{path} cannot be read ({exc.__class__.__name__}); restore the file or pass a new --out"
        ) from None


def _write(path: Path, state: dict) -> Path:
    tmp = path.with_suffix(".pt.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, tmp)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise UserError(
            f"cannot write checkpoint {path} ({exc.strerror}); free space or pass a writable --out"
        ) from None
    return path


def _list(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if _NAME.match(p.name)), key=lambda p: int(_NAME.match(p.name).group(1)))


def has_checkpoints(run_dir: Path) -> bool:
    return bool(_list(checkpoint_dir(run_dir)))


def newest(run_dir: Path, signature: dict) -> tuple[Path, dict] | None:
    """The newest checkpoint that loads (a torn or corrupt one is skipped) and its state,
    or None.

    A checkpoint written for another partition set or model configuration (its
    ``signature`` differs) is refused with :class:`UserError`.
    """
    for path in reversed(_list(checkpoint_dir(run_dir))):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # a torn or corrupt file: fall back to the previous one
            continue
        return path, _checked(path, state, signature)
    return None


def load(path: Path, signature: dict) -> dict:
    """The checkpoint at ``path`` (chosen by :func:`newest` on one rank, loaded by every rank)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(
            f"{path} is missing on this machine; every rank must see the run directory (a shared --out)"
        ) from None
    except Exception as exc:
        raise UserError(
            f"{path} cannot be read here ({exc.__class__.__name__}); every rank must see the same run directory"
        ) from None
    return _checked(path, state, signature)


def _checked(path: Path, state: dict, signature: dict) -> dict:
    if state.get("signature") != signature:
        theirs, ours = state.get("signature", {}), signature
        diff = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
        raise UserError(
            f"{path} was written for a different run ({', '.join(diff)} differ); "
            "resume with the same partition set and model flags, or pass a new --out"
        )
    return state
