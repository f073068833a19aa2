"""Training configuration: one dataclass, its command-line flags and their validation."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from .compress import FORMATS as WIRE_FORMATS
from .errors import UserError

MODELS = ("graphsage", "gat", "gcn")
EXCHANGES = ("direct", "hierarchical", "auto")
NORMS = ("layer", "batch", "none")


@dataclass(frozen=True)
class TrainConfig:
    parts_dir: Path | None = None
    p: float = 0.1
    model: str = "graphsage"
    layers: int = 3
    hidden: int = 256
    heads: int = 4
    dropout: float = 0.5
    norm: str = "layer"
    lr: float = 0.01
    weight_decay: float = 0.0
    epochs: int = 200
    seed: int = 0
    eval_every: int = 10
    precompute: bool | None = None  # None: on where exact (graphsage, gcn)
    inductive: bool = False
    device: str = "auto"  # auto | cpu | cuda
    threads: int | None = None
    out: Path | None = None
    log_json: Path | None = None
    timeout: float = 300.0
    exchange: str = "auto"  # direct | hierarchical | auto
    compress: str = "none"  # wire format of boundary rows: none | fp16 | bf16 | int8 | int4
    compress_grad: str | None = None  # of their gradients; None: as compress
    staleness: int = 0  # 1: boundary rows and their gradients one epoch stale (bnsgcn.stale)
    stale_smoothing: float | None = None  # weight of the old average of stale rows and gradients
    bucket_mb: float = 8.0
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    resume: bool = False
    verify: bool = False
    debug: bool = False

    @property
    def use_precompute(self) -> bool:
        """The first layer's full-graph aggregation is precomputed where that is exact."""
        if self.precompute is None:
            return self.model in ("graphsage", "gcn")
        return self.precompute

    @property
    def grad_wire_format(self) -> str:
        """Wire format of the boundary rows' gradients."""
        return self.compress if self.compress_grad is None else self.compress_grad

    @property
    def bucket_bytes(self) -> int:
        """Size of a gradient all-reduce bucket (see :class:`bnsgcn.reducer.GradientReducer`)."""
        return int(self.bucket_mb * 2**20)

    def resolved(self, run_dir: Path, device: str, threads: int) -> TrainConfig:
        """This configuration with every choice left to the run made: precompute, run
        directory, device type, threads and the gradients' wire format (what config.json
        records; the run resolves ``exchange`` itself)."""
        return replace(self, precompute=self.use_precompute, out=run_dir, device=device, threads=threads, compress_grad=self.grad_wire_format)

    def to_json(self) -> dict:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}

    def model_signature(self) -> dict:
        """The fields a checkpoint must agree on to be resumed."""
        keys = ("model", "layers", "hidden", "heads", "norm", "inductive", "staleness", "stale_smoothing")
        return {k: getattr(self, k) for k in keys} | {"precompute": self.use_precompute}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every training flag (documented in docs/cli.md) to ``parser``."""
    g = parser.add_argument_group("training")
    g.add_argument("--parts-dir", type=Path, help="partition set written by bnsgcn-partition (found automatically when exactly one matches)")
    g.add_argument("--p", type=float, default=0.1, help="boundary node sampling probability, 0 <= p <= 1 (default 0.1)")
    g.add_argument("--model", default="graphsage", help="graphsage | gat | gcn (default graphsage)")
    g.add_argument("--layers", type=int, default=3, help="number of GNN layers (default 3)")
    g.add_argument("--hidden", type=int, default=256, help="hidden width (default 256; per head for gat)")
    g.add_argument("--heads", type=int, default=4, help="attention heads for gat (default 4)")
    g.add_argument("--dropout", type=float, default=0.5, help="dropout probability (default 0.5)")
    g.add_argument("--norm", default="layer", help="layer | batch | none: normalisation between layers (default layer)")
    g.add_argument("--lr", type=float, default=0.01, help="Adam learning rate (default 0.01)")
    g.add_argument("--weight-decay", type=float, default=0.0, help="Adam weight decay (default 0)")
    g.add_argument("--epochs", type=int, default=200, help="training epochs (default 200)")
    g.add_argument("--seed", type=int, default=0, help="seed of parameters, sampling and dropout (default 0)")
    g.add_argument("--eval-every", type=int, default=10, help="evaluate every N epochs, 0 = only at the end (default 10)")
    pre = g.add_mutually_exclusive_group()
    pre.add_argument("--precompute", dest="precompute", action="store_true", default=None, help="precompute the first layer's full-graph aggregation (default: on for graphsage and gcn)")
    pre.add_argument("--no-precompute", dest="precompute", action="store_false", help="aggregate the first layer every epoch")
    g.add_argument("--inductive", action="store_true", help="train on the subgraph induced by training nodes, evaluate on the full graph")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda (set by --gpus / --procs)")
    g.add_argument("--threads", type=int, default=None, help="CPU threads per rank (default: cores / local ranks)")
    g.add_argument("--out", type=Path, help="run directory (default: a new runs/<timestamp>)")
    g.add_argument("--log-json", type=Path, help="also write the per-epoch JSON lines here")
    g.add_argument("--timeout", type=float, default=300.0, help="seconds any collective may wait before the job fails (default 300)")
    g.add_argument(
        "--exchange", default="auto",
        help="direct | hierarchical | auto: boundary rows cross between machines once per remote node and are relayed "
        "inside it (hierarchical), or once per rank that needs them (direct); auto = hierarchical when the job spans "
        "several machines and some machine runs several ranks (default auto)",
    )
    g.add_argument(
        "--compress", default="none",
        help="none | fp16 | bf16 | int8 | int4: how boundary rows cross the network (int8/int4: per-row range, "
        "stochastic rounding; compute stays float32) (default none)",
    )
    g.add_argument("--compress-grad", default=None, help="the same for the rows' gradients (default: as --compress)")
    g.add_argument(
        "--staleness", type=int, default=0,
        help="0 | 1: with 1, each layer aggregates the boundary rows their owners sent during the previous epoch and "
        "their gradients reach the owners one epoch later, so every exchange runs behind a whole epoch of compute; "
        "the first epoch and evaluation stay exact (default 0)",
    )
    g.add_argument(
        "--stale-smoothing", type=float, default=None, metavar="GAMMA",
        help="with --staleness 1: use exponential averages (weight GAMMA on the old average, 0 < GAMMA < 1) of the "
        "stale rows and gradients (default: off)",
    )
    g.add_argument("--bucket-mb", type=float, default=8.0, help="MiB of parameter gradients per all-reduce bucket (default 8)")
    g.add_argument("--checkpoint-every", type=int, default=0, help="save a checkpoint every N epochs (default 0: never)")
    g.add_argument("--keep-checkpoints", type=int, default=2, help="checkpoints kept (default 2)")
    g.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint in --out")
    g.add_argument("--verify", action="store_true", help="check the SHA-256 of every partition file before training")
    g.add_argument("--debug", action="store_true", help="show tracebacks")


def from_args(ns: argparse.Namespace) -> TrainConfig:
    """Build a validated :class:`TrainConfig` from parsed flags (extra attributes ignored)."""
    names = {f.name for f in fields(TrainConfig)}
    config = TrainConfig(**{k: v for k, v in vars(ns).items() if k in names})
    validate(config)
    return config


def validate(c: TrainConfig) -> None:
    if not 0.0 <= c.p <= 1.0:
        raise UserError(f"--p {c.p} is outside [0, 1]; pass a probability such as --p 0.1")
    if c.model not in MODELS:
        raise UserError(f"unknown model {c.model!r}; choose --model from {', '.join(MODELS)}")
    if c.norm not in NORMS:
        raise UserError(f"unknown norm {c.norm!r}; choose --norm from {', '.join(NORMS)}")
    for flag, value in (("--layers", c.layers), ("--hidden", c.hidden), ("--heads", c.heads), ("--epochs", c.epochs), ("--keep-checkpoints", c.keep_checkpoints)):
        if value < 1:
            raise UserError(f"{flag} {value} must be a positive integer")
    for flag, value in (("--eval-every", c.eval_every), ("--checkpoint-every", c.checkpoint_every)):
        if value < 0:
            raise UserError(f"{flag} {value} must be 0 or a positive integer")
    if not 0.0 <= c.dropout < 1.0:
        raise UserError(f"--dropout {c.dropout} is outside [0, 1); pass e.g. --dropout 0.5")
    if c.lr <= 0:
        raise UserError(f"--lr {c.lr} must be positive")
    if c.weight_decay < 0:
        raise UserError(f"--weight-decay {c.weight_decay} must be 0 or positive")
    if c.timeout <= 0:
        raise UserError(f"--timeout {c.timeout} must be positive (seconds)")
    if c.bucket_mb <= 0:
        raise UserError(f"--bucket-mb {c.bucket_mb} must be positive (MiB)")
    if c.resume and c.out is None:
        raise UserError("--resume continues the run in --out, but no --out was given; pass --out RUN_DIR")
    if c.exchange not in EXCHANGES:
        raise UserError(f"unknown exchange {c.exchange!r}; choose --exchange from {', '.join(EXCHANGES)}")
    for flag, value in (("--compress", c.compress), ("--compress-grad", c.grad_wire_format)):
        if value not in WIRE_FORMATS:
            raise UserError(f"unknown wire format {flag} {value}; choose from {', '.join(WIRE_FORMATS)}")
    if c.staleness not in (0, 1):
        raise UserError(f"--staleness {c.staleness} is not supported; choose --staleness 0 (exact exchange) or 1 (one epoch stale)")
    if c.stale_smoothing is not None:
        if not 0.0 < c.stale_smoothing < 1.0:
            raise UserError(f"--stale-smoothing {c.stale_smoothing} is outside (0, 1); pass the old average's weight, e.g. --stale-smoothing 0.9")
        if c.staleness != 1:
            raise UserError("--stale-smoothing averages stale rows and gradients, but --staleness is 0; add --staleness 1 or drop --stale-smoothing")
    if c.device not in ("auto", "cpu", "cuda"):
        raise UserError(f"unknown device {c.device!r}; use --device auto, cpu or cuda")
    if c.threads is not None and c.threads < 1:
        raise UserError(f"--threads {c.threads} must be a positive integer")
    if c.use_precompute and c.model == "gat":
        raise UserError("--precompute is not exact for gat (attention depends on the weights); drop --precompute")
