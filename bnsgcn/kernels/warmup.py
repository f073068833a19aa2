"""Compile the CPU kernels into numba's on-disk cache in a process of their own.

numba compiles a kernel the first time a process calls it with new argument types and
keeps the result in its on-disk cache (``cache=True``); later processes only load it.
A process that compiles keeps the compiler's memory (LLVM's) to its end: a rank that
compiled its kernels on the reference graph peaked 30-75 MiB higher than one that loaded
them (docs/benchmarks.md). So before any rank touches its data, one process per machine
runs :func:`exercise`, which calls every kernel once with the types training uses
(float32 values, int32 indices), and leaves a stamp beside numba's cache; ranks then find
every kernel compiled. Kernels called with other types (float64, int64 indices of a
graph with more than 2^31 - 1 entries in a rank) still compile where they are first called.

The stamp's name hashes what numba's cache depends on (numba's and Python's versions, the
CPU, the kernels' source file and its modification time) and this module's source, so a
stamp is found exactly when every kernel of :func:`exercise` is in the cache.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import numba
import numpy as np
import torch

from . import numba_backend

_STAMP_PREFIX = "bnsgcn-kernels-"


def exercise() -> None:
    """Call every numba kernel once, forward and backward, on tiny float32 inputs whose
    index tensors are int32, as training calls them."""
    from .adjacency import Adjacency
    from .dropout import RecomputedDropout, dropout
    from .gat import gat_aggregate
    from .layer_norm import layer_norm_relu_dropout
    from .loss import cross_entropy_rows
    from .spmm import spmm, spmm_add_

    generator = torch.Generator().manual_seed(0)
    n_rows, n_cols, width = 6, 9, 4
    indices = torch.cat([torch.randperm(n_cols, generator=generator)[:3].sort().values for _ in range(n_rows)])
    indptr = torch.arange(0, 3 * n_rows + 1, 3)
    adj = Adjacency.from_csr(
        indptr,
        indices,
        n_cols,
        row_scale=torch.rand(n_rows, generator=generator),
        col_scale=torch.rand(n_cols, generator=generator),
    )
    kept = adj.select_columns(torch.arange(n_cols) % 2 == 0)
    adj.select_columns(torch.arange(n_cols) == 0)  # few entries kept: selected through the transpose

    x = torch.randn(n_cols, width, generator=generator, requires_grad=True)
    base = torch.randn(n_rows, width, generator=generator, requires_grad=True)
    hidden = layer_norm_relu_dropout(
        spmm_add_(base * 1.0, adj, x), torch.ones(width), torch.zeros(width), 1e-5, 0.5, True
    )
    hidden = layer_norm_relu_dropout(
        hidden + spmm(adj, dropout(x, 0.5, True)), torch.ones(width), torch.zeros(width), 1e-5, 0.0, True
    )
    recomputed = RecomputedDropout()
    with recomputed.saving_recipes():
        hidden = hidden * recomputed(x.detach()[:n_rows], 0.5, True)
    heads = 2
    features = torch.randn(kept.n_cols, heads, width, generator=generator, requires_grad=True)
    score_src = torch.randn(kept.n_cols, heads, generator=generator, requires_grad=True)
    score_dst = torch.randn(n_rows, heads, generator=generator, requires_grad=True)
    attended = gat_aggregate(
        kept, features, score_src, score_dst, col_weight=torch.rand(kept.n_cols, generator=generator)
    )
    (hidden.sum() + attended.sum()).backward()
    for constant_width in numba_backend._CONSTANT_WIDTHS:  # the sparse product's builds for these widths
        spmm(adj, torch.randn(n_cols, constant_width, generator=generator))
    lo, inv_step = torch.zeros(n_rows), torch.ones(n_rows)
    numba_backend.quantize_codes(hidden.detach(), lo, inv_step, 15, generator)
    numba_backend.scatter_rows(
        torch.tensor([0, 2, 0]), torch.randn(3, width, generator=generator), n_rows
    )  # the exchange's backward
    logits = torch.randn(n_rows, width, generator=generator, requires_grad=True)  # the loss, forward and backward
    cross_entropy_rows(logits, torch.tensor([1, 4]), torch.tensor([0, 3])).backward()
    # rows as their nonzero entries (the exchange's --nonzero-rows on), forward and backward
    index, rows = torch.tensor([0, 2, 0]), hidden.detach()
    bits = torch.empty(len(index), (width + 7) // 8, dtype=torch.uint8)
    count = int(numba_backend.pack_nonzero_rows(rows, index, bits, torch.empty(len(index) * width))[-1])
    numba_backend.unpack_nonzero_rows(bits, torch.zeros(count + 1), torch.empty(len(index), width))
    values = numba_backend.gather_nonzero(
        torch.randn(len(index), width, generator=generator), bits, torch.empty(count + 1)
    )
    numba_backend.scatter_nonzero_rows(index, bits, torch.cat([values, torch.zeros(1)]), (n_rows, width))


def cache_key() -> str:
    """What numba's cache of the kernels depends on, hashed (see the module)."""
    source = Path(numba_backend.__file__)
    stat = source.stat()
    codegen = numba.core.registry.cpu_target.target_context.codegen()
    parts = [
        numba.__version__, sys.version, str(codegen.magic_tuple()), f"{stat.st_mtime}:{stat.st_size}",
        hashlib.sha256(source.read_bytes()).hexdigest(), hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
    ]  # fmt: skip
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def stamp_path() -> Path | None:
    """The stamp that says the kernels are in numba's cache; None where numba caches
    nothing (no writable cache directory): ranks then compile, as without this module."""
    cache = getattr(numba_backend._spmm_kernel(0).kernel, "_cache", None)
    directory = getattr(cache, "_cache_path", None)
    if directory is None:
        return None
    return Path(directory) / f"{_STAMP_PREFIX}{cache_key()}"


def needs_compiling() -> bool:
    """Whether ranks that use the numba kernels would compile some: the stamp is missing."""
    stamp = stamp_path()
    return stamp is not None and not stamp.exists()


def compile_kernels() -> Path | None:
    """Run :func:`exercise` (compiling what the cache lacks), then write the stamp; returns
    it (None where numba caches nothing)."""
    exercise()
    stamp = stamp_path()
    if stamp is None:
        return None
    # the stamp's old versions name caches that are gone or overwritten
    for old in stamp.parent.glob(f"{_STAMP_PREFIX}*"):
        if old != stamp:
            old.unlink(missing_ok=True)
    partial = stamp.with_name(f".{stamp.name}.{os.getpid()}")
    partial.write_text(f"numba {numba.__version__}, numpy {np.__version__}, torch {torch.__version__}\n")
    partial.replace(stamp)
    return stamp


if __name__ == "__main__":  # python -m bnsgcn.kernels.warmup: what train.py runs before the ranks load data
    torch.set_num_threads(1)
    written = compile_kernels()
    print(f"kernels compiled; stamp {written}" if written else "kernels compiled; numba has no cache directory here")
