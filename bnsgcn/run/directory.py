"""Whether a run directory holds an earlier run, and moving that run aside (``--force``).

A directory holds a run when it has any file or folder a run writes at its top (:data:`RUN_FILES`)
or a checkpoint under ``checkpoints/``; other files (notes, a partition set) do not count and
are never moved. A new run into it without ``--resume`` would replace or mix with those
files, so it is refused, unless ``--force`` moves them into ``<out>/previous-<n>/`` first
(the first ``n`` free): inside ``--out``, so on the same file system (each file is renamed,
not copied) and writable wherever ``--out`` is.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

from bnsgcn.errors import UserError
from bnsgcn.metrics.loggers import CSV_NAME, TENSORBOARD_DIR, WANDB_DIR
from bnsgcn.metrics.report import FIGURES, REPORT_NAME
from bnsgcn.run import checkpoint

# with the experiment loggers' file and folders (--logger)
RUN_FILES = (
    "config.json",
    "log.txt",
    "metrics.jsonl",
    REPORT_NAME,
    "best_model.pt",
    *FIGURES,
    CSV_NAME,
    TENSORBOARD_DIR,
    WANDB_DIR,
)


def earlier_run(run_dir: Path) -> list[str]:
    """The entries of ``run_dir`` that belong to a run: its files, and ``checkpoints`` when it
    holds any (a link at any of those names counts too)."""
    held = [name for name in RUN_FILES if os.path.lexists(run_dir / name)]
    if checkpoint.has_checkpoints(run_dir):
        held.append(checkpoint.checkpoint_dir(run_dir).name)
    return held


def next_previous(run_dir: Path) -> Path:
    """Where :func:`move_aside` would move a run now: the first ``previous-<n>`` not taken."""
    return next(p for n in itertools.count(1) if not os.path.lexists(p := run_dir / f"previous-{n}"))


def refusal(run_dir: Path, held: list[str]) -> UserError:
    """The one line refusing a new run into ``run_dir``, which holds ``held``."""
    aside = next_previous(run_dir)
    if checkpoint.checkpoint_dir(run_dir).name in held:
        return UserError(
            f"{run_dir} holds the checkpoints of an earlier run; pass --resume to continue it, --force to move it into "
            f"{aside}, or a new --out"
        )
    return UserError(
        f"{run_dir} holds an earlier run ({', '.join(held)}); pass --force to move it into {aside}, or a new --out"
    )


def move_aside(run_dir: Path, held: list[str]) -> Path:
    """Move the entries ``held`` of ``run_dir`` into a new ``previous-<n>`` there; return it."""
    while True:
        aside = next_previous(run_dir)
        try:
            aside.mkdir()
            break
        except FileExistsError:  # made meanwhile: take the next
            continue
        except OSError as exc:
            raise UserError(f"cannot make {aside} ({exc.strerror}); pass a writable --out") from None
    for name in held:
        try:
            os.rename(run_dir / name, aside / name)
        except OSError as exc:
            raise UserError(
                f"cannot move {run_dir / name} into {aside} ({exc.strerror}); move the earlier run yourself, or "
                "pass a new --out"
            ) from None
    return aside
