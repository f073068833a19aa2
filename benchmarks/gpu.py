"""One GPU: the engine against PyTorch Geometric on the same GPU, at each precision, rank
count and p, and the sparse products against the GPU's memory bandwidth.

For each graph (the 200k reference graph; a Reddit-sized synthetic graph, 232,965 nodes,
~114M directed edges, 602 features, when it fits), each model (GraphSAGE 3 x 128, GAT
3 x 32 x 4 heads, the suite's sizes), each ``--precision`` (fp32, tf32, bf16; default fp32)
each ``--ranks`` count (default 1) and each ``--p`` (default 1), it records:

* the engine (``bnsgcn-train --gpus 1 --ranks-per-gpu R --precision P --p p``: R ranks
  sharing the GPU, on a partition set of R parts; with ``--device cpu`` they are
  ``--procs R`` ranks): steady-state epoch time (median of the epochs after the first two),
  peak device memory allocated and reserved per rank and their maximum (report.json). With
  one rank no boundary row exists, so every p is the same job: it runs at p = 1 alone;
* PyTorch Geometric (benchmarks/pyg_reference.py's models, moved to the device), one
  process, at each precision (bf16: the forward pass under ``torch.autocast``; tf32: TF32
  matmuls on CUDA): both aggregation paths for GraphSAGE (``edge_index`` gather/scatter and
  CSR ``adj_t``), the edge list for GAT; epoch time (median after the first two, each
  epoch synchronised) and peak device memory (reset for each precision; the host's peak
  resident memory is the process's so far); a path that runs out of memory is recorded as
  such;
* the sparse products ``A X`` and ``A^T Y`` of the engine's kernels at widths 128 and F:
  time (CUDA events, median of repeats) and the bytes they must touch (CSR arrays once,
  ``X`` read once, ``Y`` written once) over the time, as a fraction of the device's copy
  bandwidth measured here (``copy_`` of a large buffer: read + write bytes / time); also
  the fraction with every edge's row gathered (the bytes with no cache reuse);
* one layer's aggregation per model (``A X`` at width 128; GAT's attention over 4 heads x
  32), forward and backward, under torch's profiler: its time and largest operations.

Results go to ``RESULTS/gpu.json`` (merged by graph, model, implementation, precision and
ranks, so graphs can run in separate calls) and ``RESULTS/gpu.md``. On a GPU machine::

    python -m benchmarks.gpu --graphs reference --precision fp32,tf32,bf16 --ranks 1,2,4 --p 1,0.1   # then:
    python -m benchmarks.gpu --graphs reddit --precision fp32,tf32,bf16 --ranks 1,2,4 --p 1,0.1

``--device cpu --quick`` runs every step on a tiny graph on the CPU (gloo, numba kernels,
host timers; ``--ranks 1,2`` as CPU ranks), to check the script end to end without a GPU;
it writes ``gpu-quick.*``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.suite import MODELS, REPO, execute, machine, size_flags
from bnsgcn.config import PRECISIONS
from bnsgcn.data.format import load_partition
from bnsgcn.nn.precision import allow_tf32, compute_precision

GRAPHS = {
    # the tool writes the Reddit layout; without it, the same sizes from the synthetic
    # generator
    "reference": "synthetic:nodes=200000,degree=25,features=128,classes=16",
    "reddit": "synthetic:nodes=232965,degree=490,features=602,classes=41",
    "quick": "synthetic:nodes=600,degree=6,features=16,classes=4",
}
REFERENCE_TOOL = REPO.parent / "shared" / "tools" / "make_reference_graph.py"
EPOCHS = 10
WARMUP = 2  # epochs left out of the medians (kernel compilation, allocator, cuSPARSE handles)
TIMEOUT_S = 540


def log(text: str) -> None:
    print(f"[gpu-bench] {text}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- graphs
def prepare_graph(
    name: str, work: Path, tool: Path = REFERENCE_TOOL, num_parts: int = 1
) -> tuple[Path, str, str | None]:
    """A set of ``num_parts`` partitions of graph ``name`` under ``work``: (path, how it was made, error)."""
    parts = work / (f"parts-{name}" if num_parts == 1 else f"parts-{name}-{num_parts}")
    if (parts / "manifest.json").is_file():
        return parts, "reused", None
    if name == "reference" and tool.is_file():
        data = work / "data-reference"
        if not data.is_dir():
            _, error = execute(["python", str(tool), "--out", str(data)], os.cpu_count() or 1, TIMEOUT_S)
            if error:
                return parts, "make_reference_graph.py", error
        command, source = (
            ["bnsgcn-partition", "reddit", "--data-dir", str(data)],
            "make_reference_graph.py (200k nodes, 128 features, 16 classes)",
        )
    else:
        command, source = ["bnsgcn-partition", GRAPHS[name]], GRAPHS[name]
    _, error = execute([*command, "--parts", str(num_parts), "--out", str(parts)], os.cpu_count() or 1, TIMEOUT_S)
    return parts, source, error


# ----------------------------------------------------------------------------- engine
def run_engine(
    parts: Path,
    model: str,
    device: str,
    epochs: int,
    work: Path,
    threads: int,
    precision: str = "fp32",
    ranks: int = 1,
    p: float = 1.0,
) -> dict:
    """``bnsgcn-train`` of ``model`` on ``parts`` (a set of ``ranks`` partitions), one rank
    per partition (on CUDA all sharing the one GPU), at ``precision`` and ``p``: its epoch
    time and each rank's peak memory."""
    run_dir = work / f"run-{parts.name}-{model}-{device}-{precision}-p{p:g}"
    if device == "cuda":
        where = ["--gpus", "1", "--ranks-per-gpu", str(ranks)]
    else:
        where = ["--procs", str(ranks), "--threads", str(max(1, threads // ranks))]
    command = [
        "bnsgcn-train",
        "--parts-dir",
        str(parts),
        *where,
        "--model",
        model,
        *size_flags(model),
        "--precision",
        precision,
        "--p",
        f"{p:g}",
        "--epochs",
        str(epochs),
        "--eval-every",
        "0",
        "--out",
        str(run_dir),
    ]
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    wall, error = execute(command, threads, TIMEOUT_S)
    result = {"impl": "bnsgcn", "command": " ".join(command), "wall_s": wall}
    if error:
        return result | {"error": error, "out_of_memory": "out of memory" in error.lower()}
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    times = [line["time"]["epoch"] for line in lines if "time" in line]
    per_rank = json.loads((run_dir / "report.json").read_text())["ranks"]

    def peaks(key: str) -> list[int | None]:
        return [rank.get(key) for rank in per_rank]

    def largest(values: list[int | None]) -> int | None:
        return None if None in values else max(values)

    allocated, reserved = peaks("peak_cuda_allocated_bytes"), peaks("peak_cuda_reserved_bytes")
    return result | {
        "epoch_time_s": statistics.median(times[WARMUP:] or times),
        "epoch_times_s": times,
        # the largest of any rank, and each rank's (index = rank)
        "peak_device_allocated_bytes": largest(allocated),
        "peak_device_reserved_bytes": largest(reserved),
        "peak_rss_bytes": largest(peaks("peak_rss_bytes")),
        "per_rank_peak_device_allocated_bytes": allocated,
        "per_rank_peak_device_reserved_bytes": reserved,
        "per_rank_peak_rss_bytes": peaks("peak_rss_bytes"),
        "time_split_s": per_rank[0]["time_split"],
    }


# ----------------------------------------------------------------------------- PyG
def pyg_worker(args: argparse.Namespace) -> list[dict]:
    """PyG's measurements of one model and aggregation path in this process (run as a
    subprocess: its own memory peaks), one per precision of ``args.precision``."""
    import torch_geometric
    from torch_geometric.utils import spmm

    from benchmarks.fullgraph import load_full_graph, peak_rss_bytes
    from benchmarks.pyg_reference import PygGAT, PygSAGE, adjacency

    device = torch.device(args.device)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    graph = load_full_graph(args.parts_dir)
    adj = adjacency(graph, args.variant)
    sizes = MODELS[args.model]
    features, labels, mask = graph.features.to(device), graph.labels.to(device), graph.train_mask.to(device)
    adj = adj.to(device)
    if args.model == "graphsage":
        csr = adj if args.variant == "csr" else adjacency(graph, "csr").to(device)
        x_agg = spmm(csr, features, reduce="mean")  # once, like the engine's precomputation
        model = PygSAGE(features.shape[1], sizes["hidden"], graph.num_classes, sizes["layers"], 0.5).to(device)
    else:
        x_agg = None
        model = PygGAT(features.shape[1], sizes["hidden"], graph.num_classes, sizes["layers"], sizes["heads"], 0.5).to(
            device
        )
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    index = mask.nonzero().flatten()
    n_train = index.numel()
    results = []
    for precision in args.precision.split(","):
        measured = {"impl": "pyg", "variant": args.variant, "precision": precision, "ranks": 1}
        # the engine's own switches: TF32 matmuls on CUDA, autocast to bfloat16 (the loss in float32)
        allow_tf32(precision, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        try:
            for _ in range(args.epochs):
                start = time.perf_counter()
                model.train()
                optimizer.zero_grad()
                with compute_precision(precision, device):
                    logits = model(features, x_agg, adj)
                loss = F.cross_entropy(logits[index].float(), labels[index], reduction="sum") / n_train
                loss.backward()
                optimizer.step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - start)
        except RuntimeError as exc:  # e.g. a sparse product without a bfloat16 kernel
            if precision == "fp32" or "out of memory" in str(exc).lower():
                raise
            results.append(measured | {"error": str(exc).splitlines()[0][:300], "unsupported_precision": True})
            continue
        result = measured | {
            "torch_geometric": torch_geometric.__version__,
            "epoch_time_s": statistics.median(times[WARMUP:] or times),
            "epoch_times_s": times,
            "peak_rss_bytes": peak_rss_bytes(),
        }
        if device.type == "cuda":
            result |= {
                "peak_device_allocated_bytes": torch.cuda.max_memory_allocated(device),
                "peak_device_reserved_bytes": torch.cuda.max_memory_reserved(device),
            }
        results.append(result)
    return results


def run_pyg(
    parts: Path, model: str, variant: str, device: str, epochs: int, threads: int, precisions: list[str]
) -> list[dict]:
    """PyG's measurements of ``model`` by ``variant``, one per precision (see :func:`pyg_worker`)."""
    command = [
        sys.executable,
        "-m",
        "benchmarks.gpu",
        "--pyg-worker",
        "--parts-dir",
        str(parts),
        "--model",
        model,
        "--variant",
        variant,
        "--device",
        device,
        "--epochs",
        str(epochs),
        "--threads",
        str(threads),
        "--precision",
        ",".join(precisions),
    ]
    failed = {"impl": "pyg", "variant": variant, "ranks": 1}
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
    try:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return [failed | {"precision": p, "error": f"timed out after {TIMEOUT_S} s"} for p in precisions]
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-6:])
        error = {"error": tail, "out_of_memory": "out of memory" in tail.lower()}
        return [failed | {"precision": p} | error for p in precisions]
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- bandwidth
def _timer(device: torch.device):
    """Seconds of one call of ``fn``: CUDA events on CUDA, host time elsewhere."""

    def measure(fn) -> float:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return measure


def median_time(fn, device: torch.device, repeats: int) -> float:
    measure = _timer(device)
    fn()  # warm-up
    return statistics.median(measure(fn) for _ in range(repeats))


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int) -> float:
    """Bytes per second of ``copy_`` between two buffers (read + write counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    return 2 * nbytes / median_time(lambda: dst.copy_(src), device, repeats)


def whole_graph_adjacency(parts: Path, device: torch.device):
    """The whole graph's :class:`~bnsgcn.kernels.Adjacency` on ``device``, GraphSAGE-normalised (mean)."""
    from benchmarks.fullgraph import load_full_graph
    from bnsgcn.kernels import Adjacency

    graph = load_full_graph(parts)
    degree = graph.indptr.diff().to(torch.float32)
    values = 1.0 / torch.repeat_interleave(degree, graph.indptr.diff())
    return Adjacency.from_csr(graph.indptr, graph.indices, graph.num_nodes, values).to(device)


def spmm_bandwidth(adj, device: torch.device, widths: list[int], repeats: int, copy_bps: float) -> list[dict]:
    """The engine's sparse products over ``adj`` (:func:`whole_graph_adjacency`) against ``copy_bps``."""
    from bnsgcn.kernels import kernel_backend

    backend = kernel_backend(device)
    n, nnz = adj.n_rows, adj.nnz
    csr_bytes = (n + 1) * 8 + nnz * (adj.indices.element_size() + 4)
    rows = []
    for width in widths:
        x = torch.randn(n, width, device=device)
        for name, fn in (("A X", lambda: backend.spmm(adj, x)), ("A^T Y", lambda: backend.spmm_transposed(adj, x))):
            seconds = median_time(fn, device, repeats)
            compulsory = csr_bytes + 2 * n * width * 4
            gathered = csr_bytes + (nnz + n) * width * 4
            rows.append(
                {
                    "product": name,
                    "width": width,
                    "nodes": n,
                    "nnz": nnz,
                    "seconds": seconds,
                    "bytes_compulsory": compulsory,
                    "bytes_gathered": gathered,
                    "achieved_bytes_per_s": compulsory / seconds,
                    "fraction_of_copy_bandwidth": compulsory / seconds / copy_bps,
                    "gathered_fraction_of_copy_bandwidth": gathered / seconds / copy_bps,
                }
            )
    return rows


def profile_aggregation(adj, device: torch.device, model: str, top: int = 12) -> dict:
    """One layer's aggregation, forward and backward, under torch's profiler: milliseconds
    per call in all and the ``top`` operations by their own time (on CUDA: the kernels and
    copies, by device time).
    GraphSAGE: ``A X`` at width 128; GAT: attention over ``H x D`` of the suite's sizes."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from bnsgcn.kernels import gat_aggregate, spmm

    n, sizes = adj.n_rows, MODELS[model]
    if model == "gat":
        heads, width = sizes["heads"], sizes["hidden"]
        x = torch.randn(n, heads, width, device=device, requires_grad=True)
        src, dst = (torch.randn(n, heads, device=device, requires_grad=True) for _ in range(2))
        step = lambda: gat_aggregate(adj, x, src, dst).sum().backward()  # noqa: E731
    else:
        x = torch.randn(n, sizes["hidden"], device=device, requires_grad=True)
        step = lambda: spmm(adj, x).sum().backward()  # noqa: E731
    calls = 2
    step()  # warm-up: cuSPARSE handles, the allocator
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        for _ in range(calls):
            step()
        if cuda:
            torch.cuda.synchronize(device)
    # On CUDA the device's own events (kernels, copies) alone: an operator's device time is
    # that of its kernels, listed too, so counting both would count it twice (torch's own
    # table totals them so).
    own = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    timed = (e for e in prof.key_averages() if not cuda or e.device_type == DeviceType.CUDA)
    events = sorted((e for e in timed if own(e) > 0), key=own, reverse=True)
    total_us = sum(own(e) for e in events)
    return {
        "model": model,
        "nodes": n,
        "nnz": adj.nnz,
        "ms_per_call": total_us / calls / 1e3,
        "clock": "device" if cuda else "host",
        "ops": [{"name": e.key, "calls": e.count // calls, "ms_per_call": own(e) / calls / 1e3} for e in events[:top]],
    }


# ----------------------------------------------------------------------------- output
def _merge(path: Path, document: dict) -> dict:
    """Add this call's results to those already in ``path`` (same graph/model/impl/precision/ranks/p replaced)."""
    if path.is_file():
        old = json.loads(path.read_text())

        def key(r: dict) -> tuple:
            return (
                r.get("graph"),
                r.get("model"),
                r.get("impl"),
                r.get("variant"),
                r.get("precision", "fp32"),  # records of earlier calls: fp32, one rank
                r.get("ranks", 1),
                r.get("p", 1.0),
                r.get("product"),
                r.get("width"),
            )

        for section in ("runs", "spmm", "profiles"):
            fresh = {key(r) for r in document.get(section, [])}
            document[section] = [r for r in old.get(section, []) if key(r) not in fresh] + document.get(section, [])
        # a set partitioned by an earlier call keeps that call's description of its source
        fresh_graphs = {
            g: info
            for g, info in document["graphs"].items()
            if info["source"] != "reused" or g not in old.get("graphs", {})
        }
        document["graphs"] = old.get("graphs", {}) | fresh_graphs
    return document


def save(results: Path, stem: str, document: dict) -> None:
    """Write ``RESULTS/stem.json`` and ``.md`` with this call's results so far (after every
    measurement: a call stopped part way keeps what it measured). Each file is written
    beside and renamed into place: a call killed while writing leaves the last whole one."""
    results.mkdir(parents=True, exist_ok=True)
    document = _merge(results / f"{stem}.json", document)
    for name, text in ((f"{stem}.json", json.dumps(document, indent=1) + "\n"), (f"{stem}.md", render(document))):
        partial = results / f"{name}.tmp"
        partial.write_text(text)
        os.replace(partial, results / name)


def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def _short(kernel: str, width: int = 110) -> str:
    """A CUDA kernel's name without ``void`` and cut to ``width`` (the JSON keeps it whole):
    a templated kernel's full signature runs to a thousand characters."""
    kernel = kernel.removeprefix("void ")
    return kernel if len(kernel) <= width else kernel[: width - 3] + "..."


def render(document: dict) -> str:
    m = document["machine"]
    lines = [
        f"Device: {m.get('device_name')} ({m.get('device')}), torch {m.get('torch')}, "
        f"copy bandwidth {m.get('copy_bandwidth_gb_s', float('nan')):.0f} GB/s",
        "",
        "| graph | model | implementation | precision | ranks | p | epoch (s) | peak device allocated (MiB) "
        "| peak device reserved (MiB) | vs PyG epoch | vs PyG memory |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    runs = document["runs"]
    for run in runs:
        # earlier calls: fp32, one rank, p = 1
        precision, ranks, p = run.get("precision", "fp32"), run.get("ranks", 1), run.get("p", 1.0)
        best_pyg = min(
            (
                r
                for r in runs
                if r["impl"] == "pyg"
                and r["graph"] == run["graph"]
                and r["model"] == run["model"]
                and r.get("precision", "fp32") == precision
                and "epoch_time_s" in r
            ),
            key=lambda r: r["epoch_time_s"],
            default=None,
        )
        name = run["impl"] + (f" ({run['variant']})" if run.get("variant") else "")
        setting = f"| {run['graph']} | {run['model']} | {name} | {precision} | {ranks} | {p:g} "
        if "error" in run:
            failure = "out of memory" if run.get("out_of_memory") else "failed"
            failure = "not at this precision" if run.get("unsupported_precision") else failure
            lines.append(setting + f"| {failure} | | | | |")
            continue
        ratio = memory = ""
        if run["impl"] == "bnsgcn" and best_pyg is not None:
            ratio = f"{run['epoch_time_s'] / best_pyg['epoch_time_s']:.2f}x"
            if run.get("peak_device_allocated_bytes") and best_pyg.get("peak_device_allocated_bytes"):
                memory = f"{run['peak_device_allocated_bytes'] / best_pyg['peak_device_allocated_bytes']:.2f}x"
        lines.append(
            setting + f"| {run['epoch_time_s']:.4f} | {_mib(run.get('peak_device_allocated_bytes'))} | "
            f"{_mib(run.get('peak_device_reserved_bytes'))} | {ratio} | {memory} |"
        )
    lines += [
        "",
        "| graph | product | width | time (ms) | GB/s (compulsory bytes) | of copy bandwidth "
        "| with every row gathered |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in document["spmm"]:
        lines.append(
            f"| {row['graph']} | {row['product']} | {row['width']} | {row['seconds'] * 1e3:.2f} "
            f"| {row['achieved_bytes_per_s'] / 1e9:.0f} | "
            f"{row['fraction_of_copy_bandwidth']:.0%} | {row['gathered_fraction_of_copy_bandwidth']:.0%} |"
        )
    for profile in document.get("profiles", []):
        lines += [
            "",
            f"{profile['graph']}, {profile['model']}: one layer's aggregation, forward and backward, "
            f"{profile['ms_per_call']:.2f} ms ({profile['clock']} time)"
            f"{' (' + profile['note'] + ')' if profile.get('note') else ''}; its largest operations:",
            "",
            "| operation | calls | ms |",
            "|---|---|---|",
        ]
        lines += [f"| `{_short(op['name'])}` | {op['calls']} | {op['ms_per_call']:.3f} |" for op in profile["ops"]]
    return "\n".join(lines) + "\n"


def _precisions(text: str) -> list[str]:
    """The precisions of ``--precision`` (each once, in order), or ValueError naming the choices."""
    names = list(dict.fromkeys(name.strip() for name in text.split(",")))
    unknown = [name for name in names if name not in PRECISIONS]
    if unknown:
        raise ValueError(f"unknown --precision {unknown[0]!r}; choose from {', '.join(PRECISIONS)}, comma-separated")
    return names


def _number_list(text: str, flag: str, kind: type, valid, what: str, example: str) -> list:
    """The numbers of a comma-separated ``flag`` (each once, in order), or ValueError saying
    it is not a list of ``what``."""
    try:
        numbers = list(dict.fromkeys(kind(number) for number in text.split(",")))
    except ValueError:
        numbers = []
    if not numbers or not all(valid(number) for number in numbers):
        raise ValueError(f"{flag} {text} is not a list of {what}; pass e.g. {flag} {example}")
    return numbers


def _rank_counts(text: str) -> list[int]:
    """The rank counts of ``--ranks``, or ValueError."""
    return _number_list(text, "--ranks", int, lambda n: n >= 1, "positive rank counts", "1,2,4")


def _sampling_rates(text: str) -> list[float]:
    """The ps of ``--p``, or ValueError."""
    return _number_list(text, "--p", float, lambda p: 0 <= p <= 1, "sampling rates in [0, 1]", "1,0.1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--quick", action="store_true", help="a tiny graph, 3 epochs, few repeats: checks the script, measures nothing"
    )
    parser.add_argument(
        "--graphs", default="reference,reddit", help="comma-separated: reference, reddit (with --quick: quick)"
    )
    parser.add_argument("--models", default="graphsage,gat")
    parser.add_argument(
        "--ranks", default="1", help="comma-separated rank counts, e.g. 1,2,4 (on CUDA: ranks sharing the one GPU)"
    )
    parser.add_argument(
        "--p", default="1", help="comma-separated boundary sampling rates, e.g. 1,0.1 (one rank: p = 1 alone)"
    )
    parser.add_argument("--precision", default="fp32", help="comma-separated: fp32, tf32, bf16 (bnsgcn-train's)")
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--work",
        type=Path,
        default=Path(tempfile.gettempdir()) / "bnsgcn-gpu-bench",
        help="partition sets and runs (GBs for the Reddit-sized graph)",
    )
    parser.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--skip-pyg", action="store_true")
    parser.add_argument(
        "--reference-tool",
        type=Path,
        default=REFERENCE_TOOL,
        help="make_reference_graph.py "
        "(default ../shared/tools/; where it is missing, the synthetic generator at the same sizes)",
    )
    # internal: one PyG measurement in a process of its own
    parser.add_argument("--pyg-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--parts-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.pyg_worker:
        print(json.dumps(pyg_worker(args)))
        return 0
    try:
        precisions, rank_counts, rates = _precisions(args.precision), _rank_counts(args.ranks), _sampling_rates(args.p)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA GPU visible; pass --device cpu --quick to check the script on the CPU", file=sys.stderr)
        return 2
    graphs = ["quick"] if args.quick else args.graphs.split(",")
    epochs = 3 if args.quick else args.epochs
    repeats = 3 if args.quick else 20
    device = torch.device(args.device)
    args.work.mkdir(parents=True, exist_ok=True)
    copy_bps = copy_bandwidth(device, (16 if args.quick else 1024) * 2**20, repeats)
    info = machine() | {
        "device": args.device,
        "device_name": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "copy_bandwidth_gb_s": copy_bps / 1e9,
        "cuda": torch.version.cuda,
    }
    document: dict = {"machine": info, "graphs": {}, "runs": [], "spmm": [], "profiles": []}
    stem = "gpu-quick" if args.quick else "gpu"
    for graph in graphs:
        log(f"{graph}: partition sets")
        # one partition (PyG's and the sparse products' whole graph), and one per rank of each count
        prepared = {
            n: prepare_graph(graph, args.work, args.reference_tool, n) for n in dict.fromkeys([1, *rank_counts])
        }
        errors = [error for _, _, error in prepared.values() if error]
        parts = {n: path for n, (path, _, _) in prepared.items()}
        document["graphs"][graph] = {"source": prepared[1][1], "error": errors[0] if errors else None}
        if errors:
            log(f"{graph}: could not be prepared: {errors[0]}")
            save(args.results, stem, document)
            continue
        single = parts[1]
        for model in args.models.split(","):
            for precision in precisions:
                for ranks in rank_counts:
                    for p in rates if ranks > 1 else [1.0]:  # one rank has no boundary row to sample
                        log(f"{graph} {model}: bnsgcn, {precision}, {ranks} rank(s), p = {p:g}")
                        document["runs"].append(
                            {"graph": graph, "model": model, "precision": precision, "ranks": ranks, "p": p}
                            | run_engine(
                                parts[ranks], model, args.device, epochs, args.work, args.threads, precision, ranks, p
                            )
                        )
                        save(args.results, stem, document)
            if not args.skip_pyg:
                for variant in ("edge_index", "csr") if model == "graphsage" else ("edge_index",):
                    log(f"{graph} {model}: pyg {variant}, {args.precision}")
                    document["runs"] += [
                        {"graph": graph, "model": model} | run
                        for run in run_pyg(single, model, variant, args.device, epochs, args.threads, precisions)
                    ]
                    save(args.results, stem, document)
        log(f"{graph}: sparse products")
        widths = sorted({128, int(load_partition(single, 0)["features"].shape[1])})
        try:
            adj = whole_graph_adjacency(single, device)
            document["spmm"] += [
                {"graph": graph} | row for row in spmm_bandwidth(adj, device, widths, repeats, copy_bps)
            ]
            for model in args.models.split(","):
                log(f"{graph} {model}: profile of one layer's aggregation")
                document["profiles"].append({"graph": graph} | profile_aggregation(adj, device, model))
            del adj
        except torch.OutOfMemoryError as exc:
            document["graphs"][graph]["spmm_error"] = f"out of memory: {exc}"[:300]
        save(args.results, stem, document)
    print((args.results / f"{stem}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
