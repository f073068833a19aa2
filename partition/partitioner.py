"""Assign every node of a graph to one of K partitions: METIS, random, or a given file.

The result is an ``int64 [N]`` vector ``assignment`` with ``assignment[v] = k`` meaning
node ``v`` is an *inner* node of partition ``k`` (``0 <= k < K``).

* ``metis``: METIS k-way (``METIS_PartGraphKway``) minimising the edge cut
  (``objective="cut"``) or the total communication volume (``objective="vol"``), with two
  balance constraints per vertex, weights ``[1, is_train(v)]``, so that every partition gets
  about ``N/K`` nodes *and* about ``T/K`` training nodes (both within METIS' default 3%
  tolerance). pymetis' ``part_graph`` always passes one constraint (``ncon=1``) and reads
  only the first ``N`` weights, so the METIS routine of the library pymetis ships is called
  directly through :mod:`ctypes` with ``ncon=2``, in a forked child process (see
  :func:`_run_in_child`).
* ``coarse``: METIS on a graph coarsened by size-constrained label propagation, projected
  back and refined (:mod:`bnsgcn.partition.coarse`), for graphs whose CSR METIS cannot
  hold; it only reads the CSR, which may be memory-mapped.
* ``auto``: ``metis`` when METIS' estimated peak (:func:`~bnsgcn.partition.coarse.metis_bytes`)
  fits the memory available (psutil's, or ``memory_limit``), else ``coarse``.
* ``random``: a seeded, stratified round-robin: training nodes in random order, then the
  others in random order, dealt to partitions ``0, 1, ..., K-1, 0, ...``. Partition sizes and
  training-node counts each differ by at most one.
* an assignment file computed elsewhere (e.g. ParMETIS): ``.npy`` or text, one part id per
  line.

Every method is deterministic for a fixed seed.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import signal
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil

from bnsgcn.data.format import sha256_file
from bnsgcn.errors import UserError

from .coarse import coarse_assignment, format_bytes, metis_bytes, vertex_weights
from .graph import Graph

METHODS = ("metis", "random", "coarse", "auto")
METIS_METHODS = ("metis", "coarse", "auto")  # methods that take --objective
OBJECTIVES = ("cut", "vol")
# What each method keeps balanced across partitions (recorded in the manifest).
BOTH = ["inner_nodes", "train_nodes"]
BALANCE = {"metis": BOTH, "random": BOTH, "coarse": BOTH, "auto": BOTH, "file": []}

_METIS_OK = 1
_METIS_ERROR_MEMORY = -3
_METIS_NOPTIONS = 40  # METIS 5: length of the options array
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def validate_parts(parts: int, num_nodes: int | None = None) -> None:
    """``1 <= parts <= num_nodes`` or :class:`UserError` (only the lower bound without ``num_nodes``)."""
    if parts < 1:
        raise UserError(f"--parts {parts} must be at least 1; pass e.g. --parts 2")
    if num_nodes is not None and parts > num_nodes:
        raise UserError(
            f"--parts {parts} exceeds the {num_nodes} nodes of the graph; pass --parts {num_nodes} or fewer"
        )


def method_info(method: str, objective: str, seed: int, assignment_file: Path | None = None) -> dict:
    """The manifest's ``partitioner`` entry: what produced an assignment, normalised.

    Settings that do not influence the result are ``None`` (the objective of ``random``,
    the seed and objective of a file), so two requests that must give the same partition
    compare equal. A file is identified by its SHA-256, so an edited file is not mistaken
    for the one a set was made from.
    """
    if assignment_file is not None:
        path = Path(assignment_file)
        if not path.is_file():
            raise UserError(f"assignment file {path} not found; pass an existing .npy or text file to --assignment")
        try:
            checksum = sha256_file(path)
        except OSError as exc:
            raise UserError(f"cannot read assignment file {path} ({exc.strerror}); check its permissions") from None
        return {
            "method": "file",
            "objective": None,
            "seed": None,
            "balance": BALANCE["file"],
            "assignment_file": {"path": str(path.resolve()), "sha256": checksum},
        }
    if method not in METHODS:
        raise UserError(f"unknown partition method {method!r}; choose --method from {', '.join(METHODS)}")
    if objective not in OBJECTIVES:
        raise UserError(f"unknown METIS objective {objective!r}; choose --objective from {', '.join(OBJECTIVES)}")
    return {
        "method": method,
        "objective": objective if method in METIS_METHODS else None,
        "seed": int(seed),
        "balance": BALANCE[method],
        "assignment_file": None,
    }


def available_memory(memory_limit: int | None = None) -> int:
    """Bytes the partition step may use: ``memory_limit`` if given, else what psutil reports available."""
    return int(memory_limit) if memory_limit is not None else int(psutil.virtual_memory().available)


def resolve_method(method: str, num_nodes: int, num_edges: int, memory_limit: int | None = None) -> str:
    """``auto`` -> ``metis`` when METIS' estimated peak fits :func:`available_memory`, else
    ``coarse``; others unchanged."""
    if method != "auto":
        return method
    return "metis" if metis_bytes(num_nodes, num_edges) <= available_memory(memory_limit) else "coarse"


def assign(
    graph: Graph,
    parts: int,
    method: str = "metis",
    objective: str = "cut",
    seed: int = 0,
    assignment_file: Path | None = None,
    *,
    memory_limit: int | None = None,
    progress: bool = False,
) -> np.ndarray:
    """Partition ``graph`` into ``parts`` parts; return ``assignment`` int64 [N].

    ``assignment_file`` overrides ``method``. ``parts == 1`` puts every node in partition 0
    without running METIS. ``memory_limit`` (bytes, default: available memory) decides
    ``auto`` and bounds ``coarse``; ``progress`` shows the steps of ``coarse``. Raises
    :class:`UserError` for ``parts`` outside ``[1, N]``, unknown methods and unusable
    assignment files.
    """
    num_nodes = graph.num_nodes
    validate_parts(parts, num_nodes)
    if assignment_file is not None:
        return read_assignment(Path(assignment_file), parts, num_nodes)
    method_info(method, objective, seed)  # validates method and objective
    if parts == 1:
        return np.zeros(num_nodes, dtype=np.int64)
    method = resolve_method(method, num_nodes, graph.num_edges, memory_limit)
    if method == "random":
        return random_assignment(graph.train_mask, parts, seed)
    if method == "coarse":
        return coarse_assignment(
            graph, parts, objective, seed, metis_parts, memory_budget=available_memory(memory_limit), progress=progress
        )
    return metis_assignment(graph, parts, objective, seed)


def random_assignment(train_mask: np.ndarray, parts: int, seed: int) -> np.ndarray:
    """Stratified random assignment: sizes and training counts differ by at most one.

    Training nodes are dealt first, so partition ``k`` gets the positions ``i`` of the
    shuffled order with ``i % parts == k``.
    """
    rng = np.random.default_rng(seed)
    train = np.flatnonzero(train_mask)
    others = np.flatnonzero(~np.asarray(train_mask, dtype=bool))
    order = np.concatenate([rng.permutation(train), rng.permutation(others)])
    assignment = np.empty(order.shape[0], dtype=np.int64)
    assignment[order] = np.arange(order.shape[0], dtype=np.int64) % parts
    return assignment


@functools.cache
def _metis_kway():
    """``METIS_PartGraphKway`` and ``METIS_SetDefaultOptions`` of pymetis' METIS, and idx_t."""
    import pymetis
    import pymetis._internal as internal

    idx_dtype = np.dtype(pymetis.zero_copy_dtype())
    try:
        library = ctypes.CDLL(internal.__file__)
        kway, defaults = library.METIS_PartGraphKway, library.METIS_SetDefaultOptions
    except (OSError, AttributeError):
        raise UserError(
            "the METIS library inside pymetis does not export METIS_PartGraphKway; "
            "reinstall pymetis from its binary wheel or use --method random"
        ) from None
    idx_ctype = ctypes.c_int64 if idx_dtype.itemsize == 8 else ctypes.c_int32
    array = np.ctypeslib.ndpointer(dtype=idx_dtype, flags="C_CONTIGUOUS")
    scalar = ctypes.POINTER(idx_ctype)
    defaults.argtypes = [array]
    defaults.restype = ctypes.c_int
    # nvtxs, ncon, xadj, adjncy, vwgt, vsize, adjwgt, nparts, tpwgts, ubvec, options, objval, part
    kway.argtypes = [
        scalar,
        scalar,
        array,
        array,
        array,
        ctypes.c_void_p,
        ctypes.c_void_p,
        scalar,
        ctypes.c_void_p,
        ctypes.c_void_p,
        array,
        scalar,
        array,
    ]
    kway.restype = ctypes.c_int
    return kway, defaults, idx_dtype, idx_ctype, internal.options_indices


def metis_assignment(graph: Graph, parts: int, objective: str, seed: int) -> np.ndarray:
    """METIS k-way on ``graph`` with vertex weights ``[1, is_train]`` (``ncon = 2``; see
    :func:`~bnsgcn.partition.coarse.vertex_weights` for a graph without training nodes)."""
    vwgt, ncon = vertex_weights(graph.num_nodes, np.zeros(0, dtype=np.int64), graph.train_mask)
    return metis_parts(graph.indptr, graph.indices, vwgt, ncon, None, parts, objective, seed)


def metis_parts(
    xadj: np.ndarray,
    adjncy: np.ndarray,
    vwgt: np.ndarray,
    ncon: int,
    adjwgt: np.ndarray | None,
    parts: int,
    objective: str,
    seed: int,
) -> np.ndarray:
    """``METIS_PartGraphKway`` on the CSR ``xadj``/``adjncy`` with ``ncon`` vertex weights per node
    (``vwgt`` [N * ncon], interleaved) and optional edge weights; return the part of each node, int64 [N]."""
    kway, defaults, idx_dtype, idx_ctype, option = _metis_kway()
    num_nodes = int(xadj.shape[0] - 1)
    num_edges = int(adjncy.shape[0])
    xadj = np.ascontiguousarray(xadj, dtype=idx_dtype)
    adjncy = np.ascontiguousarray(adjncy, dtype=idx_dtype)
    vwgt = np.ascontiguousarray(vwgt, dtype=idx_dtype)
    if adjwgt is not None:
        adjwgt = np.ascontiguousarray(adjwgt, dtype=idx_dtype)
    options = np.zeros(_METIS_NOPTIONS, dtype=idx_dtype)
    defaults(options)
    options[option.SEED] = seed
    options[option.OBJTYPE] = OBJECTIVES.index(objective)  # METIS_OBJTYPE_CUT = 0, _VOL = 1
    # The child writes the assignment into memory shared with this process.
    shared = mmap.mmap(-1, max(1, num_nodes * idx_dtype.itemsize))
    part = np.frombuffer(shared, dtype=idx_dtype, count=num_nodes)
    objval = idx_ctype(0)
    edge_weights = None if adjwgt is None else adjwgt.ctypes.data_as(ctypes.c_void_p)
    status, killed_by = _run_in_child(
        lambda: kway(
            ctypes.byref(idx_ctype(num_nodes)),
            ctypes.byref(idx_ctype(ncon)),
            xadj,
            adjncy,
            vwgt,
            None,
            edge_weights,
            ctypes.byref(idx_ctype(parts)),
            None,
            None,
            options,
            ctypes.byref(objval),
            part,
        )
    )
    need = f"about {format_bytes(metis_bytes(num_nodes, num_edges))} for {num_nodes:,} nodes and {num_edges:,} edges"
    if killed_by == signal.SIGKILL:
        raise UserError(
            f"METIS was killed (SIGKILL), most likely by the kernel for lack of memory (it needs {need}, "
            f"{format_bytes(available_memory())} are available); free memory, use a larger machine "
            "or pass --method coarse or --method random"
        )
    if killed_by is not None:
        raise RuntimeError(f"METIS_PartGraphKway crashed ({signal.Signals(killed_by).name})")
    if status == _METIS_ERROR_MEMORY:
        raise UserError(
            f"METIS ran out of memory (it needs {need}); free memory, use a larger machine "
            "or pass --method coarse or --method random"
        )
    if status != _METIS_OK:
        raise RuntimeError(f"METIS_PartGraphKway failed with status {status}")
    return part.astype(np.int64)


def _run_in_child(call: Callable[[], int]) -> tuple[int | None, int | None]:
    """Run ``call`` (a METIS routine) in a forked child: (its status, None) or (None, signal that ended it).

    METIS catches SIGTERM itself and longjmps out of the running routine. Sent SIGTERM during
    its initial partitioning (METIS 5 of pymetis 2025.2.2, 8 parts), it printed "Failed
    during initial partitioning" and then returned success with only 2 or 4 parts filled,
    or the process died (killed, or a segmentation fault). So the child blocks SIGTERM and
    SIGINT and METIS never sees them; this process keeps its handlers and kills the child
    when one of them raises. Memory the child writes must be shared (``mmap``) to be seen here.
    """
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        code = 255  # reported as status -1: the child failed before METIS returned
        try:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
            _die_with(parent)
            code = call() & 0xFF
        finally:
            os._exit(code)  # no Python cleanup: the parent's files and threads are not the child's
    try:
        _, wait_status = os.waitpid(pid, 0)
    except BaseException:  # interrupted (Terminated, KeyboardInterrupt): METIS must not outlive us
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    if os.WIFSIGNALED(wait_status):
        return None, os.WTERMSIG(wait_status)
    code = os.WEXITSTATUS(wait_status)
    return (code - 256 if code >= 128 else code), None


def _die_with(parent: int) -> None:
    """Have the kernel SIGKILL this child when ``parent`` ends, even by SIGKILL (Linux only)."""
    prctl = getattr(ctypes.CDLL(None), "prctl", None)
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent ended before prctl took effect
        os._exit(255)


def read_assignment(path: Path, parts: int, num_nodes: int) -> np.ndarray:
    """Load and check an assignment file: ``.npy`` or text with one part id per line."""
    if not path.is_file():
        raise UserError(f"assignment file {path} not found; pass an existing .npy or text file to --assignment")
    try:
        if path.suffix == ".npy":
            values = np.load(path, allow_pickle=False)
        else:
            values = np.loadtxt(path, dtype=np.float64, ndmin=1, comments="#")
    except (ValueError, OSError, EOFError) as exc:
        raise UserError(
            f"assignment file {path} is unreadable ({exc}); write one integer part id per line or a .npy integer array"
        ) from None
    values = np.asarray(values)
    if values.ndim != 1 or values.shape[0] != num_nodes:
        raise UserError(
            f"assignment file {path} holds {values.shape[0] if values.ndim else 0} values in shape "
            f"{list(values.shape)} "
            f"but the graph has {num_nodes} nodes; pass the assignment computed for this dataset"
        )
    if values.dtype.kind not in "iuf" or (values.dtype.kind == "f" and not np.all(values == np.round(values))):
        raise UserError(f"assignment file {path} holds non-integer values; write integer part ids 0..{parts - 1}")
    if num_nodes and (values.min() < 0 or values.max() >= parts):
        raise UserError(
            f"assignment file {path} has part ids {int(values.min())}..{int(values.max())} "
            f"outside 0..{parts - 1}; pass --parts {int(values.max()) + 1} or fix the file"
        )
    return values.astype(np.int64)
