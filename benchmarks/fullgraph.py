"""What the one-process references of the suite share: the whole graph, the timing protocol.

A one-partition set (``bnsgcn-partition --parts 1``) holds the whole graph: its CSR rows
are the in-edges of every node, self-loop included, in the node order of the set, the
same graph the engine trains on. :func:`measure_epochs` times ``epochs`` training steps
the way the suite reads the engine's ``metrics.jsonl``: the first epoch is a warm-up
(first-touch allocation, kernel compilation), the median of the others is the epoch time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bnsgcn.data.format import load_partition
from bnsgcn.errors import UserError


@dataclass
class FullGraph:
    """``indptr`` int64 [N+1], ``indices`` int64 [nnz] (sources of each node's in-edges),
    ``features`` float32 [N, F], ``labels`` int64 [N], ``train_mask`` bool [N]."""

    indptr: torch.Tensor
    indices: torch.Tensor
    features: torch.Tensor
    labels: torch.Tensor
    train_mask: torch.Tensor
    num_classes: int

    @property
    def num_nodes(self) -> int:
        return self.indptr.numel() - 1

    def rows(self) -> torch.Tensor:
        """Target node of every edge, int64 [nnz]."""
        return torch.repeat_interleave(torch.arange(self.num_nodes), self.indptr.diff())


def load_full_graph(parts_dir: Path) -> FullGraph:
    """The whole graph from a one-partition set."""
    arrays = load_partition(parts_dir, 0)
    if arrays.num_parts != 1:
        raise UserError(
            f"{parts_dir} has {arrays.num_parts} partitions; "
            "the one-process references need a set written with --parts 1"
        )
    if arrays["labels"].ndim != 1:
        raise UserError(f"{parts_dir} is multi-label; the one-process references train single-label graphs")
    tensor = lambda name, dtype: torch.from_numpy(np.array(arrays[name])).to(dtype)  # noqa: E731
    return FullGraph(
        indptr=tensor("adj_indptr", torch.int64),
        indices=tensor("adj_indices", torch.int64),
        features=tensor("features", torch.float32),
        labels=tensor("labels", torch.int64),
        train_mask=tensor("train_mask", torch.bool),
        num_classes=int(arrays.manifest["dataset"]["num_classes"]),
    )


def rss_bytes() -> int:
    """Resident memory of this process now (Linux), in bytes."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_epochs(step: Callable[[], None], epochs: int) -> dict:
    """Run ``step`` ``epochs`` times; the median of epochs 2.. is the epoch time (seconds)."""
    if epochs < 2:
        raise UserError(f"--epochs {epochs}: at least 2 are needed (the first is a warm-up)")
    times = []
    for _ in range(epochs):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"epoch_time_s": statistics.median(times[1:]), "epoch_times_s": times}


def run_and_emit(run: Callable[[argparse.Namespace], dict], args: argparse.Namespace) -> int:
    """Run a reference and print its result as one JSON line (also to ``args.json`` when given).

    Bad input is one ``error:`` line and exit status 2.
    """
    try:
        text = json.dumps(run(args))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json is not None:
        tmp = args.json.with_suffix(args.json.suffix + ".tmp")
        tmp.write_text(text + "\n")
        os.replace(tmp, args.json)
    print(text)
    return 0
