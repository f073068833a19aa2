"""Aggregation kernels: sparse-dense products and GAT attention over a CSR adjacency.

Public API: :class:`Adjacency` (CSR plus its transpose, built once), :func:`spmm` (``Y = A
X``; :func:`spmm_add_` adds it into an existing tensor) and :func:`gat_aggregate`
(multi-head attention aggregation). Both are differentiable; their backward passes run over
the prebuilt transpose, so nothing is transposed or converted at run time.

Backend selection, one mechanism: the environment variable ``BNSGCN_KERNELS``, read at
every call.

* ``auto`` (default) or ``numba``: CPU tensors use multi-threaded numba kernels
  (row-parallel, no atomics, as many threads as ``torch.get_num_threads()``).
* ``torch``: CPU tensors use the pure-torch kernels too (a tested fallback).

CUDA tensors always use the pure-torch kernels (cuSPARSE through ``torch.sparse``).

:func:`dropout` is here too: on CPU it draws its mask far faster than torch's dropout;
:func:`layer_norm_relu_dropout` fuses the step between hidden layers into one pass each way;
:func:`cross_entropy_rows` is the training loss over the training rows, read in place.
On CPU, training's large outputs come from a pool of reused blocks (:mod:`.buffers`; the
dense products of :mod:`.dense` too). :mod:`.warmup` compiles the numba kernels into
numba's on-disk cache in a process of its own before a job's ranks load their data.
"""

from .adjacency import Adjacency
from .backend import ENV_VAR, kernel_backend
from .dropout import RecomputedDropout, dropout
from .gat import gat_aggregate
from .layer_norm import layer_norm_relu_dropout
from .loss import cross_entropy_rows
from .spmm import spmm, spmm_add_

__all__ = [
    "Adjacency",
    "spmm",
    "spmm_add_",
    "gat_aggregate",
    "dropout",
    "RecomputedDropout",
    "layer_norm_relu_dropout",
    "cross_entropy_rows",
    "kernel_backend",
    "ENV_VAR",
]
