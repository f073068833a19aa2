"""The lean engine: recomputation in backward (``--remat`` and the always-on cheap segments of
:class:`bnsgcn.nn.model.GNN`) and partition files used in place.

* At p = 1 without dropout, ``--remat`` runs equal the dense float64 reference (every model,
  batch norm too, whose all-reduce stays outside the recomputed segments).
* With sampling and dropout (and int8 rows, rounded at random), ``--remat`` gives the losses and,
  every step, the gradients of the run without it: the dropout masks are redrawn from the
  restored random state and the recomputed layers take the rows received in forward.
* Rows still cross once per layer and direction: the bytes sent are the same.
* Saved activations per rank (the accounting's saved-tensor hook plus the kept segment
  inputs) drop by at least 2x.
* Partition files are mapped copy-on-write: tensors of the file's dtype are the mapping
  itself (no copy), a write to them never reaches the file, and a run leaves every file of
  the set byte for byte as it was.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bnsgcn.data.format import PART_ARRAYS, sha256_file
from bnsgcn.data.shard import load_shard
from bnsgcn.metrics import report

from .helpers import reference
from .helpers.graphs import partition, random_graph
from .helpers.ranks import record_gradients, run_ranks

VARIANTS = [("graphsage", True), ("graphsage", False), ("gcn", True), ("gcn", False), ("gat", False)]


@pytest.fixture(scope="module")
def graph():
    return random_graph(num_nodes=64, avg_degree=6, features=12, seed=11)


@pytest.fixture(scope="module")
def parts(graph, tmp_path_factory):
    return partition(graph, 2, tmp_path_factory.mktemp("remat") / "parts", method="random")


@pytest.fixture(scope="module")
def larger_parts(tmp_path_factory):
    """Large enough that activations, not tensors of constant size, dominate what backward keeps."""
    graph = random_graph(num_nodes=1200, avg_degree=6, features=32, seed=12)
    return partition(graph, 2, tmp_path_factory.mktemp("remat-larger") / "parts", method="random")


def test_remat_at_p1_matches_the_dense_reference(graph, parts, tmp_path):
    configs = [reference.exact_config(m, pre, parts, tmp_path / f"{m}-{pre}", remat=True) for m, pre in VARIANTS]
    configs.append(reference.exact_config("graphsage", False, parts, tmp_path / "batchnorm", norm="batch", remat=True))
    results = run_ranks(2, configs)
    for i, config in enumerate(configs):
        reference.assert_run_matches(config, graph, [results[rank][i]["params"] for rank in range(2)])


def _losses(run_dir: Path) -> list[float]:
    return [
        line["loss"] for line in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in line
    ]


def _sampled(model: str, pre: bool, parts: Path, out: Path, **overrides):
    base = dict(p=0.5, dropout=0.5, hidden=128, epochs=3)
    return reference.exact_config(model, pre, parts, out, **(base | overrides))


def test_remat_gives_the_same_losses_gradients_and_traffic_and_keeps_less(larger_parts, tmp_path):
    parts = larger_parts
    plain = [_sampled(m, pre, parts, tmp_path / f"plain-{m}-{pre}") for m, pre in VARIANTS]
    plain.append(_sampled("graphsage", False, parts, tmp_path / "plain-batch", norm="batch"))
    plain.append(_sampled("gcn", False, parts, tmp_path / "plain-stale", staleness=1))
    # int8 rows are rounded at random when encoded: a recomputed layer must reuse them
    plain += [
        _sampled(m, False, parts, tmp_path / f"plain-int8-{m}", compress="int8", compress_grad="none")
        for m in ("graphsage", "gat")
    ]
    remat = [c.replace(remat=True, out=c.run.out.with_name(c.run.out.name.replace("plain", "remat"))) for c in plain]
    results = run_ranks(2, plain + remat, instrument=record_gradients)
    for i, (a, b) in enumerate(zip(plain, remat)):
        label = (
            f"{a.model.name} precompute={a.model.use_precompute} norm={a.model.norm} "
            f"staleness={a.exchange.staleness} compress={a.wire_format}"
        )
        assert _losses(b.run.out) == pytest.approx(_losses(a.run.out), rel=1e-5, abs=1e-6), label
        for rank in range(2):
            steps_a, steps_b = results[rank][i]["instrumented"], results[rank][len(plain) + i]["instrumented"]
            assert len(steps_a) == len(steps_b) == a.run.epochs
            for grads_a, grads_b in zip(steps_a, steps_b):
                for ga, gb in zip(grads_a, grads_b):
                    np.testing.assert_allclose(gb, ga, rtol=1e-4, atol=1e-6, err_msg=label)
        report_a, report_b = report.load(a.run.out), report.load(b.run.out)
        for ra, rb in zip(report_a["ranks"], report_b["ranks"]):
            for kind in ("features", "gradients", "selections"):  # recomputed layers move no rows
                assert rb["per_epoch"][f"sent_{kind}"] == ra["per_epoch"][f"sent_{kind}"], (label, kind)
            # GraphSAGE keeps a layer's input, the norm's input and mask and the aggregation:
            # with remat one of them, half or less. GCN and GAT keep less to begin with, batch
            # norm stays outside the segments, decoded int8 rows are kept (no view of an
            # exchange buffer): less, by less.
            saved = (ra["saved_activation_bytes"], rb["saved_activation_bytes"])
            halved = a.model.name == "graphsage" and a.model.norm == "layer" and a.wire_format == "none"
            assert saved[1] * (2 if halved else 1) < saved[0], (label, saved)


def _mapped_files() -> dict[str, tuple[int, int]]:
    """Path -> (start, end) of every file mapping of this process, from /proc/self/maps."""
    spans: dict[str, tuple[int, int]] = {}
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            old = spans.get(fields[5], (start, end))
            spans[fields[5]] = (min(old[0], start), max(old[1], end))
    return spans


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs /proc/self/maps (Linux)")
def test_partition_arrays_are_used_in_place_and_never_written(parts):
    files = {name: Path(parts) / "part-0" / f"{name}.npy" for name in PART_ARRAYS}
    before = {name: sha256_file(path) for name, path in files.items()}
    shard = load_shard(parts, 0, 2)
    spans = _mapped_files()
    topo = shard.topology
    in_place = {
        "features": shard.features,
        "adj_indices": topo.indices,
        "adj_indptr": topo.indptr,
        "degree": topo.degree,
        "send_nodes": topo.send_nodes,
        "labels": shard.labels,
        "train_mask": shard.train_mask,
    }
    for name, tensor in in_place.items():
        start, end = spans[str(files[name].resolve())]
        assert start <= tensor.data_ptr() < end, f"{name} was copied, not used in place"
    shard.features[0, 0] += 1.0  # a private page now: the file keeps its bytes
    topo.indices[0] = 0
    del shard, topo, in_place
    assert {name: sha256_file(path) for name, path in files.items()} == before


def test_a_run_leaves_the_partition_set_unchanged(parts, tmp_path):
    """Read-only files (an open for writing fails, unless the tests run as root) keep their
    bytes and modification times through a run."""
    files = sorted(p for p in Path(parts).rglob("*") if p.is_file())
    before = {p: (sha256_file(p), p.stat().st_mtime_ns) for p in files}
    modes = {p: p.stat().st_mode for p in files}
    for p in files:
        p.chmod(0o444)
    try:
        run_ranks(2, [_sampled("graphsage", False, parts, tmp_path / "run", compress="none")])
    finally:
        for p, mode in modes.items():
            p.chmod(mode)
    assert {p: (sha256_file(p), p.stat().st_mtime_ns) for p in files} == before
