"""Rank-prefixed logging and the run directory's JSON-lines metrics.

``log.txt`` and ``metrics.jsonl`` grow by whole lines (:class:`bnsgcn.files.LineFile`):
a line that does not fit on the disk is not left half-written, and the run ends with one
line naming the file.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from bnsgcn.errors import UserError
from bnsgcn.files import LineFile, write_bytes


class LogFile(logging.Handler):
    """``log.txt``: each record one whole line, in UTF-8; what is not text there (an --out
    whose name is not UTF-8) escaped as on stderr. A line that cannot be written raises
    the :class:`UserError` naming the file, where :class:`logging.FileHandler` would print
    a traceback and go on."""

    def __init__(self, path: Path):
        super().__init__()
        self.file = LineFile(path)

    def emit(self, record: logging.LogRecord) -> None:
        self.file.append((self.format(record) + "\n").encode("utf-8", "backslashreplace"))

    def close(self) -> None:
        self.file.close()
        super().close()


def setup_logging(rank: int, log_file: Path | None = None) -> logging.Logger:
    """A logger whose lines start with ``[rank R]``; rank 0 also writes ``log_file``."""
    logger = logging.getLogger("bnsgcn")
    for handler in logger.handlers:  # an earlier run's, in this process
        handler.close()
    logger.handlers.clear()
    logger.setLevel(logging.INFO)
    logger.propagate = False
    fmt = logging.Formatter(f"[rank {rank}] %(message)s")
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(fmt)
    logger.addHandler(stream)
    if log_file is not None:
        handler = LogFile(log_file)
        handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(message)s"))
        logger.addHandler(handler)
    return logger


class MetricsWriter:
    """Writes one JSON object per line to ``metrics.jsonl`` (and a copy to ``--log-json``).

    A resumed run keeps the lines of epochs up to ``keep_epochs`` (those its checkpoint
    covers) and drops the rest, so the file reads as if the run had never stopped.
    """

    def __init__(self, paths: list[Path], keep_epochs: int = 0):
        self.files = []
        for path in paths:
            kept = _records(path, keep_epochs) if keep_epochs and path.is_file() else []
            # The kept lines go to a new file that replaces the old one whole: a run killed
            # here again still has them.
            write_bytes(path, "".join(json.dumps(r) + "\n" for r in kept).encode())
            self.files.append(LineFile(path))

    def write(self, record: dict) -> None:
        line = (json.dumps(record) + "\n").encode()  # ASCII: json.dumps escapes the rest
        for file in self.files:
            file.append(line)

    def close(self) -> None:
        for file in self.files:
            file.close()


def _records(path: Path, keep_epochs: int) -> list[dict]:
    """The records of ``path`` up to epoch ``keep_epochs``. An unfinished last line (the
    process was killed while writing it) is dropped; a bad line elsewhere is an error."""
    lines = path.read_text().split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):  # no newline after it: the torn last line
                continue
            raise UserError(f"{path} line {number} is not JSON; repair or remove the file to resume") from None
    return [r for r in records if r.get("epoch", keep_epochs + 1) <= keep_epochs]
