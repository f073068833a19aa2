"""A seeded random graph with community structure, for tests and benchmarks without downloads.

``synthetic:<key=value,...>`` (every key optional, see :data:`DEFAULTS`):

* ``nodes`` N, ``classes`` C: nodes get classes in equal shares, in random order.
* ``degree`` d: mean undirected degree; about ``N * d / 2`` distinct undirected edges
  (``N * d`` directed entries after symmetrisation). Each edge picks a uniform random
  endpoint ``u``; the other endpoint is a uniform random node of ``u``'s class (an
  in-class draw) or of the other classes. Self-loops and repeats are dropped; the
  numbers of in-class and cross-class draws are raised so that, in expectation, there
  still are ``N * d / 2`` distinct edges of which a fraction ``homophily`` joins nodes of
  the same class (too dense a request is refused).
* ``features`` F, ``noise`` s: ``x_v = mu_{y_v} + s * eps_v`` with class centroids
  ``mu_c ~ N(0, I_F)`` and ``eps_v ~ N(0, I_F)``. With ``s`` of a few units one node's
  features hardly tell its class, while the mean over its ~``h * d`` same-class
  neighbours (noise ``s / sqrt(d)``) does: a GNN beats an MLP.
* ``train``, ``val``: fractions of nodes in the training and validation splits (random);
  the rest is the test split.
* ``seed``: labels, edges, features and split come from independent streams of it, so
  e.g. changing ``features`` leaves the edges unchanged.

Generation is vectorised in chunks, so memory stays a small multiple of the output
(Reddit-sized ``nodes=233000,degree=490``: see docs/datasets.md for time and memory).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from functools import partial

import numpy as np

from bnsgcn.errors import UserError
from bnsgcn.partition.graph import Graph

from . import DatasetSource, Progress, build_graph, random_split_masks

CHUNK = 1 << 22  # edges or feature rows generated per step
MAX_OVERDRAW = 4.0  # at most this many draws per wanted edge (else the graph is too dense)


@dataclass(frozen=True)
class SyntheticConfig:
    nodes: int = 5000
    degree: float = 10.0
    classes: int = 5
    features: int = 32
    homophily: float = 0.8
    noise: float = 3.0
    train: float = 0.6
    val: float = 0.2
    seed: int = 0

    def spec(self) -> str:
        """The full ``synthetic:key=value,...`` spec of this configuration."""
        return "synthetic:" + ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))


DEFAULTS = SyntheticConfig()


def _validate(config: SyntheticConfig) -> None:
    checks = (
        ("nodes", config.nodes >= 2 and config.nodes < 2**31, "an integer in [2, 2^31)"),
        ("classes", 1 <= config.classes <= config.nodes, "an integer in [1, nodes]"),
        ("degree", 0 < config.degree < config.nodes - 1, "a number in (0, nodes - 1)"),
        ("features", config.features >= 1, "a positive integer"),
        ("homophily", 0.0 <= config.homophily <= 1.0, "a probability in [0, 1]"),
        ("noise", config.noise >= 0.0 and math.isfinite(config.noise), "a finite number >= 0"),
        ("train", 0.0 < config.train < 1.0, "a fraction in (0, 1)"),
        ("val", 0.0 <= config.val and config.train + config.val < 1.0, "a fraction in [0, 1) with train + val < 1"),
        ("seed", config.seed >= 0, "an integer >= 0"),
    )
    for key, ok, expected in checks:
        if not ok:
            raise UserError(f"synthetic: {key}={getattr(config, key)} is invalid, {key} must be {expected}")
    if config.classes == 1 and config.homophily < 1.0:
        raise UserError("synthetic: with classes=1 every edge is within the class; pass homophily=1 or classes >= 2")


def parse_synthetic_spec(text: str) -> SyntheticConfig:
    """Parse ``key=value,...`` (the part after ``synthetic:``; may be empty)."""
    valid = ", ".join(f.name for f in fields(SyntheticConfig))
    types = {f.name: type(getattr(DEFAULTS, f.name)) for f in fields(SyntheticConfig)}
    values: dict[str, int | float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in types:
            raise UserError(f"synthetic: unknown key {key!r} in {item!r}; write key=value with keys from {valid}")
        try:
            values[key] = types[key](value.strip())
        except ValueError:
            kind = "an integer" if types[key] is int else "a number"
            raise UserError(f"synthetic: {key}={value.strip()!r} is not {kind}; valid keys: {valid}") from None
    config = replace(DEFAULTS, **values)
    _validate(config)
    return config


def _expected_in_class(draws: float, class_sizes: np.ndarray, num_nodes: int) -> float:
    """Expected distinct in-class edges after ``draws`` in-class draws.

    A class of n nodes gets ``draws * n / N`` of them, each a uniform ordered pair of its
    nodes, so each of its ``P = n (n - 1) / 2`` pairs is hit with probability
    ``2 / (N n)`` per draw: ``P (1 - exp(-2 draws / (N n)))`` distinct pairs expected.
    """
    pairs = class_sizes * (class_sizes - 1) / 2.0
    return float((pairs * -np.expm1(-2.0 * draws / (num_nodes * class_sizes))).sum())


def _expected_cross_class(draws: float, class_sizes: np.ndarray, num_nodes: int) -> float:
    """Expected distinct cross-class edges after ``draws`` cross-class draws (spread evenly over the pairs)."""
    pairs = num_nodes * (num_nodes - 1) / 2.0 - float((class_sizes * (class_sizes - 1) / 2.0).sum())
    return pairs * -math.expm1(-draws / pairs) if pairs > 0 else 0.0


def _draws_for(target: float, expected: Callable[[float], float], config: SyntheticConfig) -> int:
    """Fewest draws whose ``expected`` distinct edges reach ``target`` (bisection)."""
    if target == 0:
        return 0
    low, high = target, MAX_OVERDRAW * target
    if expected(high) < target:
        raise UserError(
            f"synthetic: degree={config.degree} with homophily={config.homophily} needs more distinct node pairs than "
            f"nodes={config.nodes}, classes={config.classes} offer; lower degree, homophily or classes, or add nodes"
        )
    for _ in range(60):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if expected(middle) < target else (low, middle)
    return int(math.ceil(high))


EdgeSampler = Callable[[np.random.Generator, int], tuple[np.ndarray, np.ndarray]]


def edge_sampler(config: SyntheticConfig, labels: np.ndarray) -> tuple[int, EdgeSampler]:
    """The number of edge draws of ``config`` and a function drawing ``count`` of them from ``rng``.

    ``sample(rng, count)`` returns (src, dst) int32 [count], one direction each. Drawing
    in chunks of :data:`CHUNK` from one generator gives the same edges however they are
    consumed (in memory by :func:`generate_synthetic`, streamed to disk by
    :func:`bnsgcn.partition.datasets.csr.write_synthetic_csr`).
    """
    num_nodes = config.nodes
    by_class = np.argsort(labels, kind="stable").astype(np.int32)  # nodes grouped by class
    class_sizes = np.bincount(labels, minlength=config.classes).astype(np.int64)
    class_start = np.concatenate(([0], np.cumsum(class_sizes)[:-1]))
    # Draw counts chosen so that, after repeats are dropped, N d / 2 edges are expected of
    # which a fraction h lies within classes: degree and homophily hold in expectation.
    target = num_nodes * config.degree / 2.0
    draws_in = _draws_for(config.homophily * target, lambda k: _expected_in_class(k, class_sizes, num_nodes), config)
    draws_cross = _draws_for(
        (1.0 - config.homophily) * target, lambda k: _expected_cross_class(k, class_sizes, num_nodes), config
    )
    draws = draws_in + draws_cross
    in_class_probability = draws_in / draws

    def sample(rng: np.random.Generator, count: int) -> tuple[np.ndarray, np.ndarray]:
        u = rng.integers(0, num_nodes, size=count)
        cls = labels[u]
        size, first = class_sizes[cls], class_start[cls]
        same = rng.random(count) < in_class_probability
        # In-class: a position inside u's block of by_class. Cross-class: a position in
        # the other N - n blocks, shifted past u's block.
        position = rng.integers(0, np.where(same, size, num_nodes - size))
        position += np.where(same, first, np.where(position >= first, size, 0))
        return u.astype(np.int32), by_class[position]

    return draws, sample


def _draw_edges(
    config: SyntheticConfig, labels: np.ndarray, rng: np.random.Generator, progress: Progress
) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) int32 [draws]: the drawn edges, one direction each."""
    draws, sample = edge_sampler(config, labels)
    src = np.empty(draws, dtype=np.int32)
    dst = np.empty(draws, dtype=np.int32)
    with progress.step(f"drawing {draws:,} edges"):
        for start in range(0, draws, CHUNK):
            count = min(CHUNK, draws - start)
            src[start : start + count], dst[start : start + count] = sample(rng, count)
    return src, dst


def fill_features(
    config: SyntheticConfig, labels: np.ndarray, rng: np.random.Generator, features: np.ndarray, progress: Progress
) -> None:
    """Draw the features of ``config`` into ``features`` float32 [N, F] (an array or a memory
    map), row block by row block."""
    centroids = rng.standard_normal((config.classes, config.features), dtype=np.float32)
    with progress.step(f"drawing {config.nodes:,} x {config.features} features"):
        rows = max(1, CHUNK // config.features)
        for start in range(0, config.nodes, rows):
            block = rng.standard_normal((min(rows, config.nodes - start), config.features), dtype=np.float32)
            block *= np.float32(config.noise)
            block += centroids[labels[start : start + rows]]
            features[start : start + rows] = block


def random_streams(config: SyntheticConfig) -> tuple[np.random.Generator, ...]:
    """Independent generators of labels, edges, features and split."""
    return tuple(np.random.default_rng(s) for s in np.random.SeedSequence(config.seed).spawn(4))


def draw_labels(config: SyntheticConfig, rng: np.random.Generator) -> np.ndarray:
    """Classes in equal shares, in random order, int64 [N]."""
    return rng.permutation(np.arange(config.nodes, dtype=np.int64) % config.classes)


def graph_name(config: SyntheticConfig) -> str:
    return "synthetic" if config == DEFAULTS else config.spec()


def locate_synthetic(spec_arguments: str) -> DatasetSource:
    """The graph of ``synthetic:<spec_arguments>``: no files; bad keys or values fail here."""
    return DatasetSource("synthetic", (), partial(generate_synthetic, parse_synthetic_spec(spec_arguments)))


def generate_synthetic(config: SyntheticConfig, progress: Progress) -> Graph:
    """Generate the graph of ``config`` (see the module docstring)."""
    rng_labels, rng_edges, rng_features, rng_split = random_streams(config)
    num_nodes = config.nodes
    labels = draw_labels(config, rng_labels)
    src, dst = _draw_edges(config, labels, rng_edges, progress)
    features = np.empty((num_nodes, config.features), dtype=np.float32)
    fill_features(config, labels, rng_features, features, progress)
    masks = random_split_masks(num_nodes, config.train, config.val, rng_split)
    name = graph_name(config)
    return build_graph(name, src, dst, features, labels, masks, config.classes, name, progress, symmetrized=False)
