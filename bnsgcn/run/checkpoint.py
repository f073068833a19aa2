"""Checkpoints: atomic, verifiable, last K kept, loaded with ``torch.load(weights_only=True)``.

Sampling and dropout are seeded from (seed, rank, epoch), so model, optimizer, the
optimisation's settings and schedule state (:meth:`bnsgcn.nn.optim.Optimization.state_dict`),
epoch and the best-validation record are all the state a resumed run needs to continue
exactly, except with ``--staleness 1``: then each rank also saves its stale boundary rows and
gradients (:meth:`bnsgcn.exchange.stale.StaleExchange.state_dict`; with ``--max-lag`` those of the
checkpoint's epoch, which every rank waits for, :meth:`bnsgcn.exchange.bounded_lag.LagExchange.state_dict`)
in a part of its own, ``checkpoint-<epoch>.rank-<r>.pt``, written before rank 0 writes the
checkpoint itself, so a checkpoint that exists has all its parts.

Every checkpoint and part ``F`` has its SHA-256 in ``F.sha256`` (``sha256sum``'s format:
``sha256sum -c`` checks it), a file of its own so that ``F`` stays a plain ``torch.save``
file. It is written before ``F`` is renamed into place, so every ``F`` this version wrote
has one, and it is checked before ``torch.load`` reads ``F``: a damaged file (flipped or
lost bytes, which ``torch.load`` may read without complaint, as garbage) is never loaded.
``--resume`` skips a checkpoint that fails its checksum, or has a part that does, for the
one before, logging its name; with checkpoints present but none usable it stops, listing
them. A file without a checksum was written by a bnsgcn before checksums: it is loaded
with a warning. Rotation deletes only checkpoints it verified (with their parts): a damaged
or unverifiable one is left for the operator to look at.
"""

from __future__ import annotations

import hashlib
import io
import logging
import re
from pathlib import Path

import torch

from bnsgcn import files
from bnsgcn.errors import UserError

_NAME = re.compile(r"^checkpoint-(\d+)\.pt$")
log = logging.getLogger("bnsgcn")


class Unusable(Exception):
    """Why a checkpoint or part cannot be used (damaged, unreadable, incomplete)."""


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_path(run_dir: Path, epoch: int) -> Path:
    return checkpoint_dir(run_dir) / f"checkpoint-{epoch:06d}.pt"


def part_path(run_dir: Path, epoch: int, rank: int) -> Path:
    return checkpoint_dir(run_dir) / f"checkpoint-{epoch:06d}.rank-{rank}.pt"


def checksum_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def save(run_dir: Path, epoch: int, state: dict, keep: int) -> Path:
    """Write ``checkpoint-<epoch>.pt`` and keep the newest ``keep`` good ones (with their
    parts)."""
    path = _write(checkpoint_path(run_dir, epoch), {"epoch": epoch, **state})
    _rotate(checkpoint_dir(run_dir), keep)
    return path


def save_part(run_dir: Path, epoch: int, rank: int, state: dict) -> Path:
    """Write rank ``rank``'s own part of the checkpoint of ``epoch`` (before :func:`save`)."""
    return _write(part_path(run_dir, epoch, rank), state)


def load_part(run_dir: Path, epoch: int, rank: int) -> dict:
    """Rank ``rank``'s part of the checkpoint of ``epoch``."""
    path = part_path(run_dir, epoch, rank)
    try:
        return _load(path)
    except FileNotFoundError:
        raise UserError(
            f"{path} is missing: the checkpoint of epoch {epoch} is incomplete; restore the file or pass a new --out"
        ) from None
    except Unusable as exc:
        raise UserError(f"{path} cannot be read ({exc}); restore the file or pass a new --out") from None


def _write(path: Path, state: dict) -> Path:
    """``state`` to ``path`` by :func:`bnsgcn.files.atomic`, its checksum written first."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise files.cannot_write(path.parent, exc) from None
    with files.atomic(path, checksum=True) as sink:
        torch.save(state, sink)
        files.write_bytes(checksum_path(path), f"{sink.sha256.hexdigest()}  {path.name}\n".encode())
    return path


def _read(path: Path) -> bytes:
    """The bytes of ``path``, checked against its checksum file (a warning where it has
    none); :class:`Unusable` where they fail it, :class:`FileNotFoundError` where ``path``
    is missing."""
    data = path.read_bytes()
    try:
        recorded = checksum_path(path).read_text().split()[0]
    except FileNotFoundError:
        log.warning("%s has no checksum (written by an older bnsgcn): loading it unverified", path)
        return data
    except (OSError, UnicodeDecodeError, IndexError):
        raise Unusable(f"it has an unreadable checksum file {checksum_path(path).name}") from None
    if hashlib.sha256(data).hexdigest() != recorded.lower():
        raise Unusable("it fails its SHA-256 checksum: the file is damaged")
    return data


def _load(path: Path) -> dict:
    """The state in ``path``, read once and checked (:func:`_read`) before it is unpickled."""
    data = _read(path)
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # no checksum to vouch for it: torn, or not a checkpoint at all
        raise Unusable(f"it cannot be read: {exc.__class__.__name__}") from None


def _verified(path: Path) -> bool:
    """Whether ``path`` has a checksum and agrees with it."""
    try:
        recorded = checksum_path(path).read_text().split()[0]
        return hashlib.sha256(path.read_bytes()).hexdigest() == recorded.lower()
    except (OSError, UnicodeDecodeError, IndexError):
        return False


def _parts(path: Path) -> list[Path]:
    """The parts next to the checkpoint ``path``."""
    return sorted(path.parent.glob(path.name.removesuffix(".pt") + ".rank-*.pt"))


def _rotate(folder: Path, keep: int) -> None:
    """Delete the checkpoints older than the newest ``keep`` good ones, with their parts
    and checksums. Good: the checkpoint and each of its parts has a checksum and agrees
    with it. Any other is neither counted nor deleted."""
    good = 0
    for path in reversed(_list(folder)):
        written = [path, *_parts(path)]
        if not all(_verified(p) for p in written):
            continue
        good += 1
        if good > keep:
            for p in written:  # the checkpoint first: without it, its parts and checksums are inert
                p.unlink(missing_ok=True)
            for p in written:
                checksum_path(p).unlink(missing_ok=True)


def _list(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if _NAME.match(p.name)), key=lambda p: int(_NAME.match(p.name).group(1)))


def has_checkpoints(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds any checkpoint, usable or not."""
    return bool(_list(checkpoint_dir(run_dir)))


def newest(run_dir: Path, signature: dict, parts: int = 0) -> tuple[Path, dict] | None:
    """The newest usable checkpoint and its state, or None when there is none at all.

    ``parts``: the ranks that each have a part of every checkpoint (0: none). A checkpoint
    that fails its checksum or cannot be read, or whose part is missing or fails its
    checksum, is skipped (logged) for the one before; when every one is, :class:`UserError`
    lists them. A checkpoint written for another partition set or model configuration (its
    ``signature`` differs) is refused with :class:`UserError`.
    """
    folder = checkpoint_dir(run_dir)
    skipped = []
    for path in reversed(_list(folder)):
        epoch = int(_NAME.match(path.name).group(1))
        try:
            for rank in range(parts):
                part = part_path(run_dir, epoch, rank)
                try:
                    _read(part)
                except FileNotFoundError:
                    raise Unusable(f"its part {part.name} is missing") from None
                except Unusable as exc:
                    raise Unusable(f"its part {part.name} {str(exc).removeprefix('it ')}") from None
            state = _load(path)
        except Unusable as exc:
            log.warning("skipping %s: %s", path, exc)
            skipped.append(f"{path.name} ({exc})")
            continue
        return path, _checked(path, state, signature)
    if skipped:
        raise UserError(
            f"--resume found no usable checkpoint in {folder}: {', '.join(skipped)}; restore one from a copy, or "
            "pass a new --out"
        )
    return None


def load(path: Path, signature: dict) -> dict:
    """The checkpoint at ``path`` (chosen by :func:`newest` on one rank, loaded by every rank)."""
    try:
        state = _load(path)
    except FileNotFoundError:
        raise UserError(
            f"{path} is missing on this machine; every rank must see the run directory (a shared --out)"
        ) from None
    except Unusable as exc:
        raise UserError(f"{path} cannot be read here ({exc}); every rank must see the same run directory") from None
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
