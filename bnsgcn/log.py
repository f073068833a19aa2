"""Rank-prefixed logging and the run directory's JSON-lines metrics."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path


def setup_logging(rank: int, log_file: Path | None = None) -> logging.Logger:
    """A logger whose lines start with ``[rank R]``; rank 0 also writes ``log_file``."""
    logger = logging.getLogger("bnsgcn")
    logger.handlers.clear()
    logger.setLevel(logging.INFO)
    logger.propagate = False
    fmt = logging.Formatter(f"[rank {rank}] %(message)s")
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(fmt)
    logger.addHandler(stream)
    if log_file is not None:
        handler = logging.FileHandler(log_file)
        handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(message)s"))
        logger.addHandler(handler)
    return logger


class MetricsWriter:
    """Writes one JSON object per line to ``metrics.jsonl`` (and a copy to ``--log-json``).

    A resumed run keeps the lines of epochs up to ``keep_epochs`` (those its checkpoint
    covers) and drops the rest, so the file reads as if the run had never stopped.
    """

    def __init__(self, paths: list[Path], keep_epochs: int = 0):
        self.handles = []
        for path in paths:
            kept = []
            if keep_epochs and path.is_file():
                records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
                kept = [r for r in records if r.get("epoch", keep_epochs + 1) <= keep_epochs]
            handle = open(path, "w")
            handle.writelines(json.dumps(r) + "\n" for r in kept)
            self.handles.append(handle)

    def write(self, record: dict) -> None:
        line = json.dumps(record) + "\n"
        for handle in self.handles:
            handle.write(line)
            handle.flush()

    def close(self) -> None:
        for handle in self.handles:
            handle.close()
