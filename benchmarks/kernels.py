"""Benchmark the aggregation kernels against torch.sparse on a random graph.

Measures, with the same thread count in one process:
  * spmm forward (A X) and backward (A^T dY) of bnsgcn.kernels (numba) versus
    torch.sparse.mm on a CSR tensor and its autograd backward (which transposes A);
  * effective bandwidth (bytes touched / time) against the measured copy bandwidth;
  * gat_aggregate forward/backward (numba and the pure-torch fallback);
  * Adjacency.select_columns (a random half of the columns kept), numba and torch;
  * the step between hidden layers, layer norm -> ReLU -> dropout (0.5), forward and
    backward on [nodes / 2, dim] (a rank's share at 2 ranks): the fused kernel against
    torch's layer norm and ReLU followed by our dropout;
  * numba first-call times: cold compile (empty cache) and load from the on-disk cache.

Example:
  python benchmarks/kernels.py --nodes 200000 --edges 5000000 --dim 128 --threads 2 \
      --repeat 5 --out benchmarks/results/kernels.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Callable

# Gathering random rows of a large matrix misses the TLB on nearly every row with 4 KiB
# pages; torch's allocator madvises huge pages when this is set before torch allocates.
# Both sides of every comparison run in this one process, so both get it. Override with
# THP_MEM_ALLOC_ENABLE=0 to measure without.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402

# Runnable as a script from a checkout without installing the package.
REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bnsgcn.errors import UserError  # noqa: E402
from bnsgcn.kernels import (  # noqa: E402
    ENV_VAR,
    Adjacency,
    dropout,
    gat_aggregate,
    layer_norm_relu_dropout,
    spmm,
)

FLOAT_BYTES = 4


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=200_000)
    parser.add_argument("--edges", type=int, default=5_000_000)
    parser.add_argument("--dim", type=int, default=128, help="feature width for spmm")
    parser.add_argument("--heads", type=int, default=4, help="GAT heads")
    parser.add_argument("--head-dim", type=int, default=32, help="GAT features per head")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per measurement (best is kept)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="JSON results path")
    args = parser.parse_args(argv)
    for name in ("nodes", "edges", "dim", "heads", "head_dim", "threads", "repeat"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1; pass a positive number")
    return args


def random_graph(nodes: int, edges: int, seed: int) -> Adjacency:
    """Uniform random directed graph (duplicates removed), mean-normalised rows (GCN-like values)."""
    g = torch.Generator().manual_seed(seed)
    key = torch.unique(torch.randint(0, nodes * nodes, (edges,), generator=g, dtype=torch.int64))
    rows, cols = key // nodes, key % nodes
    indptr = torch.zeros(nodes + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(rows, minlength=nodes), 0, out=indptr[1:])
    values = 1.0 / indptr.diff().clamp_min(1).float()[rows]
    return Adjacency.from_csr(indptr, cols, nodes, values)


def best_times(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Best wall time of each function over ``repeat`` runs after one warm-up run.

    The functions take turns, so a competitor and ours see the same machine conditions.
    """
    for fn in fns.values():
        fn()
    times = {name: float("inf") for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name] = min(times[name], time.perf_counter() - start)
    return times


def copy_bandwidth(repeat: int) -> float:
    """Bytes/s of a large tensor copy (read + write), the roofline for memory-bound kernels."""
    src = torch.randn(64 * 2**20)  # 256 MiB, far above the caches
    dst = torch.empty_like(src)
    return 2 * src.numel() * FLOAT_BYTES / best_times({"copy": lambda: dst.copy_(src)}, repeat)["copy"]


def spmm_bytes(n_out: int, n_structure_rows: int, nnz: int, dim: int, index_bytes: int) -> int:
    """Bytes one spmm pass touches: row pointers, indices, values, gathered rows, written rows."""
    return (
        (n_structure_rows + 1) * 8
        + nnz * (index_bytes + FLOAT_BYTES)
        + nnz * dim * FLOAT_BYTES
        + n_out * dim * FLOAT_BYTES
    )


def bench_spmm(adj: Adjacency, dim: int, repeat: int) -> dict:
    x = torch.randn(adj.n_cols, dim, requires_grad=True)
    dy = torch.randn(adj.n_rows, dim)
    y = spmm(adj, x)
    a = torch.sparse_csr_tensor(adj.indptr, adj.indices.long(), adj.values, size=(adj.n_rows, adj.n_cols))
    y_torch = torch.sparse.mm(a, x)
    torch.testing.assert_close(y, y_torch, rtol=1e-4, atol=1e-4)
    t = best_times(
        {
            "ours_forward": lambda: spmm(adj, x.detach()),
            "torch_forward": lambda: torch.sparse.mm(a, x.detach()),
            "ours_backward": lambda: torch.autograd.grad(y, x, dy, retain_graph=True),
            "torch_backward": lambda: torch.autograd.grad(y_torch, x, dy, retain_graph=True),
        },
        repeat,
    )
    ours_fwd, torch_fwd, ours_bwd, torch_bwd = (
        t["ours_forward"], t["torch_forward"], t["ours_backward"], t["torch_backward"]
    )  # fmt: skip

    index_bytes = adj.indices.element_size()
    fwd_bytes = spmm_bytes(adj.n_rows, adj.n_rows, adj.nnz, dim, index_bytes)
    bwd_bytes = spmm_bytes(adj.n_cols, adj.n_cols, adj.nnz, dim, index_bytes)
    return {
        "ours_forward_s": ours_fwd,
        "ours_backward_s": ours_bwd,
        "torch_forward_s": torch_fwd,
        "torch_backward_s": torch_bwd,
        "speedup_forward": torch_fwd / ours_fwd,
        "speedup_backward": torch_bwd / ours_bwd,
        "forward_bytes": fwd_bytes,
        "backward_bytes": bwd_bytes,
        "ours_forward_GBps": fwd_bytes / ours_fwd / 1e9,
        "ours_backward_GBps": bwd_bytes / ours_bwd / 1e9,
    }


def bench_gat(adj: Adjacency, heads: int, head_dim: int, repeat: int, backend: str) -> dict:
    os.environ[ENV_VAR] = backend
    g = torch.Generator().manual_seed(1)
    x = torch.randn(adj.n_cols, heads, head_dim, generator=g).requires_grad_()
    s_src = torch.randn(adj.n_cols, heads, generator=g).requires_grad_()
    s_dst = torch.randn(adj.n_rows, heads, generator=g).requires_grad_()
    y = gat_aggregate(adj, x, s_src, s_dst)
    dy = torch.randn_like(y)
    t = best_times(
        {
            "forward_s": lambda: gat_aggregate(adj, x, s_src, s_dst),
            "backward_s": lambda: torch.autograd.grad(y, (x, s_src, s_dst), dy, retain_graph=True),
        },
        repeat,
    )
    os.environ[ENV_VAR] = "auto"
    return t


def bench_select_columns(adj: Adjacency, repeat: int, backend: str) -> float:
    """Seconds to drop a random half of the columns (the per-epoch boundary sampling step)."""
    os.environ[ENV_VAR] = backend
    keep = torch.rand(adj.n_cols, generator=torch.Generator().manual_seed(2)) < 0.5
    seconds = best_times({"select": lambda: adj.select_columns(keep)}, repeat)["select"]
    os.environ[ENV_VAR] = "auto"
    return seconds


def bench_between_layers(rows: int, dim: int, repeat: int) -> dict:
    """Seconds of layer norm -> ReLU -> dropout, forward and forward + backward, fused and composed."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, dim, generator=g).requires_grad_()
    norm = torch.nn.LayerNorm(dim)
    dy = torch.randn(rows, dim, generator=g)

    def fused():
        return layer_norm_relu_dropout(x, norm.weight, norm.bias, norm.eps, 0.5, training=True)

    def composed():
        return dropout(torch.relu(norm(x)), 0.5, training=True)

    def forward(step):
        with torch.no_grad():
            step()

    return best_times(
        {
            "fused_forward_s": lambda: forward(fused),
            "fused_forward_backward_s": lambda: fused().backward(dy),
            "composed_forward_s": lambda: forward(composed),
            "composed_forward_backward_s": lambda: composed().backward(dy),
        },
        repeat,
    )


_FIRST_CALL_SCRIPT = """
import json, time, torch
torch.set_num_threads({threads})
t0 = time.perf_counter()
from bnsgcn.kernels import Adjacency, gat_aggregate, spmm
adj = Adjacency.from_csr(torch.tensor([0, 2, 3]), torch.tensor([0, 1, 1]), 2, torch.ones(3))
t1 = time.perf_counter()
x = torch.randn(2, 8, requires_grad=True); spmm(adj, x).sum().backward()
t2 = time.perf_counter()
xs = torch.randn(2, 2, 4, requires_grad=True); s = torch.randn(2, 2, requires_grad=True)
gat_aggregate(adj, xs, s, s.detach().clone().requires_grad_()).sum().backward()
t3 = time.perf_counter()
print(json.dumps({{"import_s": t1 - t0, "spmm_first_call_s": t2 - t1, "gat_first_call_s": t3 - t2}}))
"""


def first_call_times(threads: int) -> dict:
    """Fresh processes: float32 first calls with an empty numba cache, then with it filled."""
    result = {}
    with tempfile.TemporaryDirectory() as cache_dir:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir, PYTHONPATH=str(REPO_ROOT), **{ENV_VAR: "numba"})
        for label in ("cold_compile", "cached"):
            out = subprocess.run(
                [sys.executable, "-c", _FIRST_CALL_SCRIPT.format(threads=threads)],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            )
            result[label] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def machine() -> dict:
    import numba
    import psutil

    return {
        "cpu": platform.processor() or platform.machine(),
        "logical_cpus": os.cpu_count(),
        "memory_GiB": round(psutil.virtual_memory().total / 2**30, 1),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "numba": numba.__version__,
        "numba_threading_layer": numba.threading_layer(),
        "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE"),
        "transparent_hugepage": Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
        if Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()
        else None,
    }


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    adj = random_graph(args.nodes, args.edges, args.seed)
    bandwidth = copy_bandwidth(args.repeat)
    spmm_result = bench_spmm(adj, args.dim, args.repeat)
    spmm_result["ours_forward_of_roofline"] = spmm_result["ours_forward_GBps"] * 1e9 / bandwidth
    spmm_result["ours_backward_of_roofline"] = spmm_result["ours_backward_GBps"] * 1e9 / bandwidth
    gat = {b: bench_gat(adj, args.heads, args.head_dim, args.repeat, b) for b in ("numba", "torch")}
    select = {b: bench_select_columns(adj, args.repeat, b) for b in ("numba", "torch")}
    between_layers = bench_between_layers(args.nodes // 2, args.dim, args.repeat)
    compile_times = first_call_times(args.threads)
    result = {
        "date": date.today().isoformat(),
        "command": "python benchmarks/kernels.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "graph": {"n_rows": adj.n_rows, "n_cols": adj.n_cols, "nnz": adj.nnz},
        "machine": machine() | {"threads": torch.get_num_threads()},
        # Other processes on the machine slow every number down; the 1-minute load says how busy it was.
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "spmm": spmm_result,
        "gat": gat,
        "select_columns_half_s": select,
        "layer_norm_relu_dropout": {"rows": args.nodes // 2, "dim": args.dim, **between_layers},
        "numba_first_call": compile_times,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(args.out.suffix + ".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
