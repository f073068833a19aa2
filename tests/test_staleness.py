"""``--staleness 1``: boundary rows and their gradients one epoch stale (bnsgcn.exchange.stale).

The runs are checked against a dense float64 implementation of the stale update written
here, independent of the engine's layers, kernels and exchange: in epoch t, every
partition r aggregates, at the boundary columns of its epoch-t sample, a leaf tensor T_r
holding what the owners sent in epoch t-1 (exponentially averaged with smoothing), and
the loss gets the surrogate term <s_l^t, G_l^{t-1}>, which adds the summed gradients
dL_{t-1}/dT (averaged with smoothing) to the sent tensors' gradients one epoch late.
Epoch 0 is exact.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from bnsgcn.config import TrainConfig
from bnsgcn.data.format import load_partition
from bnsgcn.data.sampler import sample_boundary

from .helpers.graphs import partition, random_graph
from .helpers.ranks import run_ranks
from .helpers.reference import dense_adjacency, exact_config, initial_params

WORLD = 3
NODES = [0, 0, 1]  # two ranks share a node: rows are relayed there (node-aware exchange)


@pytest.fixture(scope="module")
def graph():
    return random_graph(60, avg_degree=4, seed=5)


@pytest.fixture(scope="module")
def parts(graph, tmp_path_factory):
    return partition(graph, WORLD, tmp_path_factory.mktemp("stale") / "parts")


class StaleReference:
    """Partition-parallel training with stale boundary rows, simulated in one process."""

    def __init__(self, config: TrainConfig, graph, parts_dir: Path):
        self.config, self.graph = config, graph
        n = graph.num_nodes
        self.a = dense_adjacency(graph)
        self.deg = self.a.sum(1)
        self.part_of = np.empty(n, dtype=np.int64)
        self.boundary = []  # per rank: global ids of its boundary columns, and their owner counts
        for r in range(WORLD):
            arrays = load_partition(parts_dir, r)
            self.part_of[np.asarray(arrays["inner_nodes"])] = r
            self.boundary.append(
                (torch.from_numpy(np.array(arrays["boundary_nodes"])), np.diff(arrays["boundary_offsets"]).tolist())
            )
        self.part_of_t = torch.from_numpy(self.part_of)
        self.x = torch.from_numpy(graph.features).double()

    def sampled(self, epoch: int) -> list[Tensor]:
        """Per rank: bool [N], the boundary nodes it samples in ``epoch``."""
        out = []
        for r, (nodes, counts) in enumerate(self.boundary):
            keep = sample_boundary(counts, self.config.exchange.p, self.config.run.seed, r, epoch)
            mask = torch.zeros(self.graph.num_nodes, dtype=torch.bool)
            mask[nodes[keep]] = True
            out.append(mask)
        return out

    def aggregate(self, norm: Tensor, s: Tensor, remote: list[Tensor], sampled: list[Tensor]) -> Tensor:
        """Rows of each partition r: its own columns from ``s``, sampled boundary columns
        from ``remote[r]`` scaled by 1/p."""
        out = torch.zeros(s.shape[0], *s.shape[1:], dtype=s.dtype)
        for r in range(WORLD):
            rows = self.part_of_t == r
            own = norm[rows][:, rows] @ s[rows]
            cols = sampled[r]
            out = out.index_put(
                (rows.nonzero().flatten(),), own + norm[rows][:, cols] @ remote[r][cols] / self.config.exchange.p
            )
        return out

    def gat(self, p: dict, h: Tensor, z: Tensor, remote_z: list[Tensor], sampled: list[Tensor], last: bool) -> Tensor:
        out = torch.zeros(h.shape[0], *z.shape[1:], dtype=h.dtype)
        for r in range(WORLD):
            rows = self.part_of_t == r
            z_src = torch.where(rows[:, None, None], z, remote_z[r])
            usable = rows | sampled[r]
            weight = torch.where(rows, 1.0, 1.0 / self.config.exchange.p).double()
            s_src = (z_src * p["att_src"]).sum(-1)
            s_dst = (z[rows] * p["att_dst"]).sum(-1)
            e = F.leaky_relu(s_dst[:, None, :] + s_src[None, :, :], 0.2) + torch.log(weight)[None, :, None]
            mask = (self.a[rows] > 0) & usable[None, :]
            alpha = torch.softmax(e.masked_fill(~mask[:, :, None], float("-inf")), dim=1)
            out = out.index_put((rows.nonzero().flatten(),), torch.einsum("vuh,uhd->vhd", alpha, z_src))
        out = out.mean(1) if last else out.reshape(out.shape[0], -1)
        return out + p["bias"]

    def train(self, smoothing: float | None = None) -> tuple[list[float], dict[str, Tensor]]:
        c = self.config
        params = {k: v.requires_grad_(True) for k, v in initial_params(c, self.graph).items() if "running" not in k}
        opt = torch.optim.Adam(params.values(), lr=c.optim.lr, weight_decay=c.optim.weight_decay)
        labels = torch.from_numpy(self.graph.labels)
        train_mask = torch.from_numpy(self.graph.train_mask)
        mean_norm = self.a / self.deg[:, None]
        sym_norm = self.a / torch.sqrt(self.deg[:, None] * self.deg[None, :])
        previous_sent: dict[int, Tensor] = {}
        row_average: dict[tuple[int, int], Tensor] = {}
        row_seen: dict[tuple[int, int], Tensor] = {}
        stale_grads: dict[int, Tensor] = {}
        grad_average: dict[int, Tensor] = {}
        losses = []
        for epoch in range(c.run.epochs):
            sampled = self.sampled(epoch)
            leaves: dict[int, list[Tensor]] = {}
            sent: dict[int, Tensor] = {}

            def remote(layer: int, s: Tensor) -> list[Tensor]:
                """What each partition aggregates at its boundary columns for ``layer``."""
                sent[layer] = s
                if epoch == 0:
                    return [s] * WORLD  # the first epoch is exact
                values = []
                for r in range(WORLD):
                    value = previous_sent[layer]
                    if smoothing is not None:
                        key, fresh = (r, layer), sampled[r]
                        average = row_average.setdefault(key, torch.zeros_like(value))
                        seen = row_seen.setdefault(key, torch.zeros(value.shape[0], dtype=torch.bool))
                        mixed = torch.where(
                            seen.view(-1, *[1] * (value.dim() - 1)),
                            smoothing * average + (1 - smoothing) * value,
                            value,
                        )
                        average[fresh] = mixed[fresh]
                        seen |= fresh
                        value = average.clone()
                    values.append(value.clone().requires_grad_(True))
                leaves[layer] = values
                return values

            h = self.x
            for i in range(c.model.layers):
                last = i == c.model.layers - 1
                p = {k.split(".", 2)[2]: v for k, v in params.items() if k.startswith(f"layers.{i}.")}
                if c.model.name in ("graphsage", "gcn") and i == 0:  # precomputed: the exact full-graph aggregation
                    norm = mean_norm if c.model.name == "graphsage" else sym_norm
                    if c.model.name == "graphsage":
                        h = h @ p["lin_self.weight"].T + p["lin_self.bias"] + (norm @ self.x) @ p["lin_neigh.weight"].T
                    else:
                        h = (norm @ self.x) @ p["lin.weight"].T + p["bias"]
                elif c.model.name == "graphsage":
                    w_n = p["lin_neigh.weight"]
                    first = w_n.shape[1] > w_n.shape[0]  # multiply first: the product is sent
                    s = h @ w_n.T if first else h
                    agg = self.aggregate(mean_norm, s, remote(i, s), sampled)
                    h = h @ p["lin_self.weight"].T + p["lin_self.bias"] + (agg if first else agg @ w_n.T)
                elif c.model.name == "gcn":
                    w = p["lin.weight"]
                    first = w.shape[1] > w.shape[0]
                    s = h @ w.T if first else h
                    agg = self.aggregate(sym_norm, s, remote(i, s), sampled)
                    h = (agg if first else agg @ w.T) + p["bias"]
                else:
                    w = p["lin.weight"]
                    z = (h @ w.T).view(h.shape[0], c.model.heads, -1)
                    if w.shape[1] < w.shape[0]:  # the layer's input is sent, z computed on arrival
                        remote_z = [(t @ w.T).view(z.shape) for t in remote(i, h)]
                    else:
                        remote_z = remote(i, z)
                    h = self.gat(p, h, z, remote_z, sampled, last)
                if not last:
                    h = F.layer_norm(h, h.shape[1:], params[f"norms.{i}.weight"], params[f"norms.{i}.bias"])
                    h = F.elu(h) if c.model.name == "gat" else F.relu(h)
            loss = F.cross_entropy(h[train_mask], labels[train_mask])
            surrogate = sum((sent[layer] * g).sum() for layer, g in stale_grads.items())
            opt.zero_grad()
            (loss + surrogate).backward()
            opt.step()
            losses.append(loss.item())
            stale_grads = {}
            for layer, values in leaves.items():
                if not sent[layer].requires_grad:
                    continue  # input features: no gradient goes back
                summed = sum(v.grad for v in values)
                if smoothing is not None:
                    summed = grad_average[layer] = (
                        summed
                        if layer not in grad_average
                        else smoothing * grad_average[layer] + (1 - smoothing) * summed
                    )
                stale_grads[layer] = summed
            previous_sent = {layer: s.detach() for layer, s in sent.items()}
        return losses, {k: v.detach() for k, v in params.items()}


def losses_of(run_dir: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def stale_config(model: str, parts, out, **overrides) -> TrainConfig:
    return exact_config(model, model != "gat", parts, out, **({"staleness": 1, "epochs": 6} | overrides))


CASES = [
    ("graphsage", 1.0, None),
    ("graphsage", 0.5, None),
    ("graphsage", 0.5, 0.7),
    ("gcn", 1.0, None),
    ("gcn", 0.5, 0.6),
    ("gat", 1.0, None),
    ("gat", 0.5, 0.7),
]


def test_staleness_one_equals_the_stale_reference(graph, parts, tmp_path):
    configs = [stale_config(m, parts, tmp_path / f"{m}-{p}-{s}", p=p, stale_smoothing=s) for m, p, s in CASES]
    results = run_ranks(WORLD, configs, nodes=NODES)
    for i, config in enumerate(configs):
        ref_losses, ref_params = StaleReference(config, graph, parts).train(config.exchange.stale_smoothing)
        label = f"{config.model.name} p={config.exchange.p} smoothing={config.exchange.stale_smoothing}"
        assert losses_of(config.run.out) == pytest.approx(ref_losses, rel=1e-5, abs=1e-6), label
        for rank in range(WORLD):
            for name, ref in ref_params.items():
                got = torch.from_numpy(results[rank][i]["params"][name]).double()
                torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"{label} {name}: {m}")


def test_the_reference_tells_stale_from_exact(graph, parts, tmp_path):
    # The reference's stale path must matter on this graph, or the test above proves nothing.
    config = stale_config("graphsage", parts, tmp_path, p=1.0)
    stale, _ = StaleReference(config, graph, parts).train()
    exact, _ = StaleReference(config.replace(epochs=1), graph, parts).train()
    assert stale[0] == exact[0]  # the first epoch is exact
    from .helpers.reference import train

    exact_losses, _ = train(config.replace(staleness=0), graph)
    assert stale[0] == pytest.approx(exact_losses[0], rel=1e-9)
    assert abs(stale[-1] - exact_losses[-1]) > 1e-4


def test_resume_equals_the_uninterrupted_run_and_a_seed_repeats(parts, tmp_path):
    # p < 1, dropout, int8 on the wire, smoothing: every piece of state a resume needs.
    base = dict(p=0.5, dropout=0.3, compress="int8", stale_smoothing=0.8, epochs=7)
    whole = stale_config("gat", parts, tmp_path / "whole", **base)
    again = whole.replace(out=tmp_path / "again")
    first = whole.replace(out=tmp_path / "resumed", epochs=4, checkpoint_every=2)
    rest = first.replace(epochs=7, resume=True)
    results = run_ranks(WORLD, [whole, again, first, rest], nodes=NODES)
    assert losses_of(whole.run.out) == losses_of(again.run.out)
    assert losses_of(rest.run.out) == losses_of(whole.run.out)
    for rank in range(WORLD):
        for name, value in results[rank][0]["params"].items():
            assert np.array_equal(results[rank][1]["params"][name], value), name
            assert np.array_equal(results[rank][3]["params"][name], value), name
    # the newest two checkpoints (keep_checkpoints), each with one part per rank, and their checksums
    expected = [f"checkpoint-{e:06d}{part}.pt" for e in (4, 6) for part in ["", *(f".rank-{r}" for r in range(WORLD))]]
    expected += [f"{name}.sha256" for name in expected]  # each file's checksum (bnsgcn.run.checkpoint)
    assert sorted(p.name for p in (first.run.out / "checkpoints").iterdir()) == sorted(expected)
    # The stale rows were drawn for p = 0.5: another p cannot continue from them.
    with pytest.raises(
        AssertionError,
        match=r"checkpoint-000006.rank-\d.pt holds stale boundary rows sampled with --p 0.5 --seed 3; resume "
        "--staleness 1 with those",
    ):
        run_ranks(WORLD, [rest.replace(p=0.3, epochs=8)], nodes=NODES)


def bytes_by_kind(run_dir: Path) -> dict[str, int]:
    """Feature and gradient bytes sent across nodes over all epochs (inside a node, relayed
    gradients are summed in float32 before they cross, whatever the wire format)."""
    records = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    return {kind: sum(r["bytes_inter_node_by_kind"][kind] for r in records) for kind in ("features", "gradients")}


# Loss deviation from the exact-wire reference per format: far above what was measured
# (fp16 8e-6, bf16 9e-5, int8 6e-5, int4 1.3e-3 over 4 epochs), far below a broken exchange.
WIRE_LOSS_BOUND = {"none": 1e-6, "fp16": 1e-4, "bf16": 1e-3, "int8": 1e-3, "int4": 2e-2}


def test_staleness_composes_with_every_wire_format(graph, parts, tmp_path):
    configs = [
        stale_config("graphsage", parts, tmp_path / name, p=0.5, compress=name, epochs=4) for name in WIRE_LOSS_BOUND
    ]
    run_ranks(WORLD, configs, nodes=NODES)
    reference, _ = StaleReference(configs[0], graph, parts).train()
    for config in configs:
        deviation = np.abs(np.array(losses_of(config.run.out)) - reference).max()
        assert deviation <= WIRE_LOSS_BOUND[config.exchange.compress], (config.exchange.compress, deviation)
    sent = {c.exchange.compress: bytes_by_kind(c.run.out) for c in configs}
    for kind in ("features", "gradients"):
        assert sent["none"][kind] > 0
        assert sent["fp16"][kind] == sent["bf16"][kind] == sent["none"][kind] // 2
        assert sent["fp16"][kind] > sent["int8"][kind] > sent["int4"][kind] > 0


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (
            ["--staleness", "2"],
            "error: --staleness 2 is not supported; choose --staleness 0 (exact exchange) or 1 (one epoch stale)",
        ),
        (
            ["--staleness", "1", "--stale-smoothing", "1.5"],
            "error: --stale-smoothing 1.5 is outside (0, 1); pass the old average's weight, e.g. --stale-smoothing 0.9",
        ),
        (
            ["--staleness", "1", "--stale-smoothing", "0"],
            "error: --stale-smoothing 0.0 is outside (0, 1); pass the old average's weight, e.g. --stale-smoothing 0.9",
        ),
        (
            ["--stale-smoothing", "0.9"],
            "error: --stale-smoothing averages stale rows and gradients, but --staleness is 0; add --staleness 1 or "
            "drop --stale-smoothing",
        ),
    ],
    ids=["staleness-2", "smoothing-above-1", "smoothing-0", "smoothing-without-staleness"],
)
def test_bad_staleness_flags_are_one_line_errors(tmp_path, flags, line):
    done = subprocess.run(
        [sys.executable, "-m", "bnsgcn.launch.cli", "--parts-dir", str(tmp_path), *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [line]
    assert not any(tmp_path.iterdir())  # nothing written
