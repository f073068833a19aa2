"""Experiment loggers (``--logger``): what rank 0 sends to TensorBoard, W&B or ``metrics.csv``.

Each epoch a logger gets the record ``metrics.jsonl`` gets (made once, by :mod:`bnsgcn.run.train`) and
translates it: :func:`scalars` flattens it into the same names every epoch (``loss``, ``score/val``,
``time/epoch``, ``bytes_sent``, ``memory/rank0_peak_mib``, ...), with the epoch as the step. A logger is
made with the run's settings (those of ``config.json``) and gets its summary (best scores) at the end.
TensorBoard and wandb are imported by their loggers only, so a run without them imports neither.
"""

from __future__ import annotations

import contextlib
import csv
import io
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from bnsgcn.errors import UserError
from bnsgcn.files import LineFile, write_bytes

if TYPE_CHECKING:  # hints only: metrics imports no configuration
    from bnsgcn.config import TrainConfig

CSV_NAME = "metrics.csv"
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"  # what wandb.init(dir=run_dir) creates there
MiB = 2**20
SPLITS = ("train", "val", "test")
# the summary's figures a tracker shows against the settings, by their names there
SUMMARY = {
    "best_val_score": "best/val_score",
    "test_score": "best/test_score",
    "best_epoch": "best/epoch",
    "final_loss": "final_loss",
}


class ExperimentLogger(Protocol):
    """Where rank 0 sends a run's figures besides ``metrics.jsonl``."""

    def log_epoch(self, record: dict) -> None:
        """One epoch's record (a line of ``metrics.jsonl``, with the scores when it was evaluated)."""

    def log_summary(self, summary: dict) -> None:
        """The run's summary line, after its last epoch."""

    def close(self, failed: bool = False) -> None:
        """The end of this process's part of the run; ``failed``: it ends with an error."""


def scalars(record: dict) -> dict[str, float | int | None]:
    """One epoch's record as flat names and numbers, the same names every epoch of a run (the scores are None
    on epochs not evaluated): ``epoch``, ``loss``, ``lr``, ``score/<split>``, ``time/<part>`` (the slowest
    rank's seconds), ``sampled_boundary``, ``bytes_sent``, ``bytes_received``, ``bytes_sent/<kind>``,
    ``bytes_intra_node``, ``bytes_inter_node`` (all ranks) and ``memory/rank<R>_peak_mib`` (each rank's peak so
    far)."""
    flat = {"epoch": record["epoch"], "loss": record["loss"], "lr": record["lr"]}
    flat |= {f"score/{split}": record.get(f"{split}_score") for split in SPLITS}
    flat |= {f"time/{part}": seconds for part, seconds in record["time"].items()}
    flat |= {key: record[key] for key in ("sampled_boundary", "bytes_sent", "bytes_received")}
    flat |= {f"bytes_sent/{kind}": n for kind, n in record["bytes_sent_by_kind"].items()}
    flat |= {key: record[key] for key in ("bytes_intra_node", "bytes_inter_node")}
    peaks = record["per_rank"]["peak_memory_bytes"]
    flat |= {f"memory/rank{rank}_peak_mib": peak / MiB for rank, peak in enumerate(peaks)}
    return flat


def _missing(name: str, exc: ImportError) -> UserError:
    """The one line of a logger whose package cannot be imported (the checks found it installed)."""
    return UserError(
        f"--logger {name} cannot import its package ({exc}); pip install {name} (or pip install 'bnsgcn[loggers]'), "
        f"or drop {name} from --logger"
    )


class CsvLogger:
    """``metrics.csv``: a header, then one row per epoch, appended whole as the epoch ends; a cell of an epoch not
    evaluated (its scores) is empty. A resumed run keeps the rows of epochs up to ``keep_epochs`` (those its
    checkpoint covers) and drops the rest, as ``metrics.jsonl`` does, so no epoch appears twice."""

    def __init__(self, path: Path, keep_epochs: int = 0):
        self.path = path
        self.header, self.kept = _csv_rows(path, keep_epochs) if keep_epochs and path.is_file() else ([], [])
        # the kept rows go to a new file that replaces the old one whole: a run killed here again still has them
        self._write_kept()
        self.file: LineFile | None = None

    def _write_kept(self) -> None:
        write_bytes(self.path, _csv_lines([self.header, *([r.get(n) for n in self.header] for r in self.kept)]))

    def log_epoch(self, record: dict) -> None:
        row = scalars(record)
        if self.file is None:
            # the header comes with the first row (the names depend on the run: its ranks); kept rows of other
            # columns (a run resumed with other ranks) go under it, their cells of its new columns empty
            header = list(row) + [name for name in self.header if name not in row]
            if header != self.header:
                self.header = header
                self._write_kept()
            self.file = LineFile(self.path)
        self.file.append(_csv_lines([[row.get(name) for name in self.header]]))

    def log_summary(self, summary: dict) -> None:
        """Nothing: the file holds epochs (the summary is ``metrics.jsonl``'s last line)."""

    def close(self, failed: bool = False) -> None:
        if self.file is not None:
            self.file.close()


def _csv_lines(rows: Sequence[Sequence]) -> bytes:
    """CSV lines, each ending in a newline (none for no rows); None as an empty cell."""
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows(row for row in rows if row)
    return text.getvalue().encode()


def _csv_rows(path: Path, keep_epochs: int) -> tuple[list[str], list[dict[str, str]]]:
    """The header of ``path`` and its rows up to epoch ``keep_epochs``, by column. An unfinished last line (the
    process was killed while writing it) is dropped; a row without an epoch number is an error."""
    text = path.read_text()
    reader = csv.DictReader(io.StringIO(text[: text.rfind("\n") + 1]))
    rows = []
    for number, row in enumerate(reader, 2):
        try:
            epoch = int(row["epoch"])
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{path} line {number} has no epoch number; repair or remove the file to resume") from None
        if epoch <= keep_epochs:
            rows.append(row)
    return list(reader.fieldnames or []), rows


class TensorBoardLogger:
    """``<run dir>/tensorboard/``: each scalar of :func:`scalars` by its name as tag, step = epoch; at the end the
    settings as hyperparameters with the summary's figures (``best/val_score``, ...) as their metrics. A resumed
    run hides the events of epochs after ``keep_epochs`` that an earlier attempt wrote (TensorBoard's purge)."""

    def __init__(self, log_dir: Path, settings: dict, keep_epochs: int = 0):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise _missing("tensorboard", exc) from None
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=keep_epochs + 1 if keep_epochs else None)
        self.settings = settings
        self.step = keep_epochs

    def log_epoch(self, record: dict) -> None:
        self.step = record["epoch"]
        for tag, value in scalars(record).items():
            if tag != "epoch" and value is not None:
                self.writer.add_scalar(tag, value, global_step=self.step)

    def log_summary(self, summary: dict) -> None:
        from torch.utils.tensorboard.summary import hparams

        # the hyperparameters plugin takes numbers, text and booleans: None as "none", nested values left out
        plain = (bool, int, float, str)
        values = {k: "none" if v is None else v for k, v in self.settings.items() if v is None or isinstance(v, plain)}
        metrics = {SUMMARY[k]: v for k, v in summary.items() if k in SUMMARY and v is not None}
        for event in hparams(values, metrics):  # into this run's own event file (add_hparams makes another run)
            self.writer.file_writer.add_summary(event)
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, global_step=self.step)

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class WandbLogger:
    """A W&B run (``wandb.init``, in ``<run dir>/wandb/``) with the settings as its config: :func:`scalars` per
    epoch with step = epoch, the summary's figures in its summary, ``finish`` at the end, with exit code 1 when
    the run fails. ``WANDB_MODE=offline`` keeps it on disk (``wandb sync`` uploads it later)."""

    def __init__(self, run_dir: Path, settings: dict, project: str, name: str):
        try:
            import wandb
        except ImportError as exc:
            raise _missing("wandb", exc) from None
        try:
            self.run = wandb.init(project=project, name=name, dir=str(run_dir), config=settings)
        except Exception as exc:  # no API key, no network, a bad WANDB_MODE: what wandb says, as one line
            said = " ".join(str(exc).split()) or type(exc).__name__
            raise UserError(
                f"wandb.init failed ({said}); run `wandb login`, set WANDB_MODE=offline to log without a network, or "
                "drop wandb from --logger"
            ) from None

    def log_epoch(self, record: dict) -> None:
        flat = scalars(record)
        self.run.log({k: v for k, v in flat.items() if k != "epoch" and v is not None}, step=flat["epoch"])

    def log_summary(self, summary: dict) -> None:
        self.run.summary.update({SUMMARY[k]: v for k, v in summary.items() if k in SUMMARY})

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class Loggers:
    """Every logger of a run as one (none: every call does nothing). As a context, it closes them on leaving,
    telling them whether the run failed."""

    def __init__(self, loggers: Sequence[ExperimentLogger] = ()):
        self.loggers = list(loggers)

    def log_epoch(self, record: dict) -> None:
        for logger in self.loggers:
            logger.log_epoch(record)

    def log_summary(self, summary: dict) -> None:
        for logger in self.loggers:
            logger.log_summary(summary)

    def close(self, failed: bool = False) -> None:
        for logger in self.loggers:
            if failed:  # the run's own error is the one to report
                with contextlib.suppress(Exception):
                    logger.close(failed=True)
            else:
                logger.close()
        self.loggers = []

    def __enter__(self) -> Loggers:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.close(failed=exc_type is not None)


def make_loggers(config: TrainConfig, run_dir: Path, settings: dict, keep_epochs: int = 0) -> Loggers:
    """The loggers ``config.run.loggers`` names, writing into ``run_dir``; ``settings``: the run's settings
    (``config.json``), ``keep_epochs``: the epochs a resumed checkpoint covers (0: a new run)."""
    made = []
    try:
        for name in config.run.loggers:
            if name == "csv":
                made.append(CsvLogger(run_dir / CSV_NAME, keep_epochs))
            elif name == "tensorboard":
                made.append(TensorBoardLogger(run_dir / TENSORBOARD_DIR, settings, keep_epochs))
            elif name == "wandb":
                run_name = config.run.run_name or run_dir.name
                made.append(WandbLogger(run_dir, settings, config.run.wandb_project, run_name))
    except BaseException:
        Loggers(made).close(failed=True)
        raise
    return Loggers(made)
