"""Training configuration: one dataclass, its command-line flags and their validation.

Imports no torch: ``bnsgcn-train``'s launcher reads and checks the flags with this module
before it starts any rank, and importing torch would add about 2 s to every job's start and
to every refused flag.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from bnsgcn.device import DEVICES
from bnsgcn.errors import UserError
from bnsgcn.sync import stragglers as straggler

MODELS = ("graphsage", "gat", "gcn")
WIRE_FORMATS = ("none", "fp16", "bf16", "int8", "int4")  # what bnsgcn.comm.wire encodes
EXCHANGES = ("direct", "hierarchical", "auto")
NONZERO_ROWS = ("auto", "on", "off")
NORMS = ("layer", "batch", "none")


def _setting(default, help: str, **argparse_options):
    """A training setting, defined once: its default, its ``--help`` text (the default is
    appended) and any further :meth:`argparse.ArgumentParser.add_argument` options."""
    return field(default=default, metadata={"help": help, **argparse_options})


@dataclass(frozen=True)
class TrainConfig:
    """Every training flag (``--name-with-dashes`` for ``name_with_underscores``), as
    :func:`add_arguments` offers it and docs/cli.md documents it."""

    parts_dir: Path | None = _setting(
        None, "partition set written by bnsgcn-partition", type=Path, shown="found: the one set that matches"
    )
    p: float = _setting(0.1, "boundary node sampling probability, 0 <= p <= 1")
    model: str = _setting("graphsage", "graphsage | gat | gcn")
    layers: int = _setting(3, "number of GNN layers")
    hidden: int = _setting(256, "hidden width (per head for gat)")
    heads: int = _setting(4, "attention heads for gat")
    dropout: float = _setting(0.5, "dropout probability")
    norm: str = _setting("layer", "layer | batch | none: normalisation between layers")
    lr: float = _setting(0.01, "Adam learning rate")
    weight_decay: float = _setting(0.0, "Adam weight decay")
    epochs: int = _setting(200, "training epochs")
    seed: int = _setting(0, "seed of parameters, sampling and dropout")
    eval_every: int = _setting(10, "evaluate every N epochs, 0 = only at the end")
    precompute: bool | None = _setting(
        None,
        "precompute the first layer's full-graph aggregation (--no-precompute: aggregate it every epoch)",
        shown="on for graphsage and gcn",
    )
    inductive: bool = _setting(False, "train on the subgraph induced by training nodes, evaluate on the full graph")
    nonzero_rows: str = _setting(
        "auto",
        "auto | on | off: with on, a hidden layer's boundary rows (ReLU outputs) cross as a bitmap and their nonzero "
        "entries, and their gradients at those entries alone: exact, about a third of the bytes after dropout 0.5, for "
        "a pass more over the rows each way; auto = on when the job spans several machines",
    )
    remat: bool = _setting(
        False,
        "recompute each layer's aggregation (and the norm before it) in backward instead of keeping it: less memory, about one more forward pass of compute",
    )
    device: str = _setting(
        "auto", "auto | cpu | cuda (set by --gpus / --procs); auto = cuda when this machine has a GPU per local rank"
    )
    threads: int | None = _setting(None, "CPU threads per rank", type=int, shown="cores / local ranks")
    out: Path | None = _setting(None, "run directory", type=Path, shown="a new runs/<timestamp>")
    log_json: Path | None = _setting(None, "also write the per-epoch JSON lines here", type=Path, shown="none")
    timeout: float = _setting(300.0, "seconds any collective may wait before the job fails")
    exchange: str = _setting(
        "auto",
        "direct | hierarchical | auto: boundary rows cross between machines once per remote node and are relayed inside "
        "it (hierarchical), or once per rank that needs them (direct); auto = hierarchical when the job spans several "
        "machines and some machine runs several ranks",
    )
    compress: str = _setting(
        "none",
        "none | fp16 | bf16 | int8 | int4: how boundary rows cross the network (int8/int4: per-row range, stochastic rounding; compute stays float32)",
    )
    compress_grad: str | None = _setting(None, "the same for the rows' gradients", type=str, shown="as --compress")
    staleness: int = _setting(
        0,
        "0 | 1: with 1, each layer aggregates the boundary rows their owners sent during the previous epoch and their "
        "gradients reach the owners one epoch later, so every exchange runs behind a whole epoch of compute; the first "
        "epoch and evaluation stay exact",
    )
    stale_smoothing: float | None = _setting(
        None,
        "with --staleness 1: use exponential averages (weight GAMMA on the old average, 0 < GAMMA < 1) of the stale rows and gradients",
        type=float,
        metavar="GAMMA",
        shown="off",
    )
    max_lag: int | None = _setting(
        None,
        "with --staleness 1: a rank may run up to S epochs ahead of the ranks it shares boundary nodes with; rows and "
        "gradients travel point to point as their owners produce them, each rank uses the newest version at most S epochs "
        "old and waits only when it would exceed that (1: --staleness 1 itself); pair it with a decoupled --sync",
        type=int,
        metavar="S",
        shown="off",
    )
    sync: str = _setting(
        "allreduce",
        "allreduce | grouped:G[:N] | partial:P | gossip:K: how ranks keep parameters together when some are slower; "
        "allreduce sums gradients over every rank every step; grouped sums them inside N groups of similar speed "
        "(default 2) and averages across group leaders every G steps; partial averages the first P ranks to arrive "
        "each step; gossip averages with one random partner every K steps; all but allreduce need --p 0 or "
        "--staleness 1 and average every rank before each evaluation, checkpoint and the end",
        metavar="MODE",
    )
    inject_delay: str | None = _setting(
        None,
        "testing aid: rank R sleeps S seconds every epoch, or a seeded uniform draw in LO-HI, e.g. 0:0.8,3:0.4-0.45; "
        "reported as injected delay, not compute",
        type=str,
        metavar="R:S[,R:LO-HI...]",
        shown="none",
    )
    work_pool: bool = _setting(
        False,
        "with --p 0 and a partition set of more parts than ranks: ranks take partitions from a pool in the job's "
        "store, one step each, until every partition had its step this epoch; fast ranks take more (--inject-delay "
        "then delays every step)",
    )
    bucket_mb: float = _setting(1.0, "MiB of parameter gradients per all-reduce bucket")
    eval_buffer_mib: float = _setting(
        32.0,
        "MiB an evaluation exchange buffer (sent or received rows) may take: evaluation exchanges and aggregates each "
        "layer's boundary rows in column slices that fit (at least one column); 0 = every row of a layer at once",
        metavar="MIB",
    )
    checkpoint_every: int = _setting(0, "save a checkpoint every N epochs (0: never)")
    keep_checkpoints: int = _setting(2, "checkpoints kept")
    resume: bool = _setting(False, "continue from the newest valid checkpoint in --out")
    verify: bool = _setting(False, "check the SHA-256 of every partition file before training")
    debug: bool = _setting(False, "show tracebacks")

    @property
    def use_precompute(self) -> bool:
        """The first layer's full-graph aggregation is precomputed where that is exact."""
        if self.precompute is None:
            return self.model in ("graphsage", "gcn")
        return self.precompute

    @property
    def eval_buffer_bytes(self) -> int:
        """The most bytes of an evaluation exchange buffer (0: unsliced, see :mod:`bnsgcn.run.evaluate`)."""
        return math.ceil(self.eval_buffer_mib * 2**20)

    @property
    def grad_wire_format(self) -> str:
        """Wire format of the boundary rows' gradients."""
        return self.compress if self.compress_grad is None else self.compress_grad

    @property
    def bucket_bytes(self) -> int:
        """Size of a gradient all-reduce bucket (see :class:`bnsgcn.sync.reducer.GradientReducer`)."""
        return int(self.bucket_mb * 2**20)

    def resolved(self, run_dir: Path, device: str, threads: int) -> TrainConfig:
        """This configuration with every choice left to the run made: precompute, run
        directory, device type, threads and the gradients' wire format (what config.json
        records; the run resolves ``exchange`` itself)."""
        return replace(
            self,
            precompute=self.use_precompute,
            out=run_dir,
            device=device,
            threads=threads,
            compress_grad=self.grad_wire_format,
        )

    def to_json(self) -> dict:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}

    def model_signature(self) -> dict:
        """The fields a checkpoint must agree on to be resumed."""
        keys = ("model", "layers", "hidden", "heads", "norm", "inductive", "staleness", "stale_smoothing")
        return {k: getattr(self, k) for k in keys} | {"precompute": self.use_precompute}


def flag_name(name: str) -> str:
    """The command-line flag of a :class:`TrainConfig` field."""
    return "--" + name.replace("_", "-")


def shown_default(f) -> str:
    """A field's default as ``--help`` and docs/cli.md show it."""
    if "shown" in f.metadata:
        return f.metadata["shown"]
    if isinstance(f.default, bool):
        return "on" if f.default else "off"
    return f"{f.default:g}" if isinstance(f.default, float) else str(f.default)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every training flag, as :class:`TrainConfig` defines it, to ``parser``."""
    group = parser.add_argument_group("training")
    for f in fields(TrainConfig):
        options = {k: v for k, v in f.metadata.items() if k not in ("help", "shown")}
        help_text = f"{f.metadata['help']} (default {shown_default(f)})"
        if f.name == "precompute":  # a pair: --precompute / --no-precompute
            pair = group.add_mutually_exclusive_group()
            pair.add_argument("--precompute", dest="precompute", action="store_true", default=None, help=help_text)
            pair.add_argument("--no-precompute", dest="precompute", action="store_false", help=argparse.SUPPRESS)
        elif isinstance(f.default, bool):
            group.add_argument(flag_name(f.name), action="store_true", help=f.metadata["help"])
        else:
            group.add_argument(
                flag_name(f.name), default=f.default, **({"type": type(f.default)} | options), help=help_text
            )


def from_args(ns: argparse.Namespace) -> TrainConfig:
    """Build a validated :class:`TrainConfig` from parsed flags (extra attributes ignored)."""
    names = {f.name for f in fields(TrainConfig)}
    config = TrainConfig(**{k: v for k, v in vars(ns).items() if k in names})
    validate(config)
    return config


def validate(c: TrainConfig) -> None:
    for f in fields(TrainConfig):  # nan passes every comparison below: refuse it (and inf) first
        value = getattr(c, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"{flag_name(f.name)} {value} is not a finite number; pass a finite value")
    if not -(2**63) <= c.seed < 2**63:
        raise UserError(f"--seed {c.seed} does not fit in 64 bits; pass a smaller seed")
    if not 0.0 <= c.p <= 1.0:
        raise UserError(f"--p {c.p} is outside [0, 1]; pass a probability such as --p 0.1")
    if c.model not in MODELS:
        raise UserError(f"unknown model {c.model!r}; choose --model from {', '.join(MODELS)}")
    if c.norm not in NORMS:
        raise UserError(f"unknown norm {c.norm!r}; choose --norm from {', '.join(NORMS)}")
    for flag, value in (
        ("--layers", c.layers),
        ("--hidden", c.hidden),
        ("--heads", c.heads),
        ("--epochs", c.epochs),
        ("--keep-checkpoints", c.keep_checkpoints),
    ):
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
    if c.eval_buffer_mib < 0:
        raise UserError(f"--eval-buffer-mib {c.eval_buffer_mib} must be 0 (unsliced) or positive (MiB)")
    if c.resume and c.out is None:
        raise UserError("--resume continues the run in --out, but no --out was given; pass --out RUN_DIR")
    if c.exchange not in EXCHANGES:
        raise UserError(f"unknown exchange {c.exchange!r}; choose --exchange from {', '.join(EXCHANGES)}")
    if c.nonzero_rows not in NONZERO_ROWS:
        raise UserError(f"unknown --nonzero-rows {c.nonzero_rows!r}; choose from {', '.join(NONZERO_ROWS)}")
    for flag, value in (("--compress", c.compress), ("--compress-grad", c.grad_wire_format)):
        if value not in WIRE_FORMATS:
            raise UserError(f"unknown wire format {flag} {value}; choose from {', '.join(WIRE_FORMATS)}")
    if c.staleness not in (0, 1):
        raise UserError(
            f"--staleness {c.staleness} is not supported; choose --staleness 0 (exact exchange) or 1 (one epoch stale)"
        )
    if c.stale_smoothing is not None:
        if not 0.0 < c.stale_smoothing < 1.0:
            raise UserError(
                f"--stale-smoothing {c.stale_smoothing} is outside (0, 1); pass the old average's weight, e.g. --stale-smoothing 0.9"
            )
        if c.staleness != 1:
            raise UserError(
                "--stale-smoothing averages stale rows and gradients, but --staleness is 0; add --staleness 1 or drop --stale-smoothing"
            )
    straggler.check_config(c.p, c.staleness, straggler.parse_sync(c.sync), c.norm)
    _check_max_lag(c)
    if c.work_pool:
        straggler.check_work_pool(c.p, c.staleness, c.norm, c.inductive)
    straggler.parse_delays(c.inject_delay)
    if c.device not in DEVICES:
        raise UserError(f"unknown device {c.device!r}; use --device auto, cpu or cuda")
    if c.threads is not None and c.threads < 1:
        raise UserError(f"--threads {c.threads} must be a positive integer")
    if c.use_precompute and c.model == "gat":
        raise UserError("--precompute is not exact for gat (attention depends on the weights); drop --precompute")


def _check_max_lag(c: TrainConfig) -> None:
    """What ``--max-lag`` (:mod:`bnsgcn.exchange.bounded_lag`) needs, in one line each."""
    if c.max_lag is None:
        return
    if c.max_lag < 1:
        raise UserError(
            f"--max-lag {c.max_lag} must be a positive number of epochs; pass e.g. --max-lag 3 (1 is --staleness 1 itself)"
        )
    if c.staleness != 1:
        raise UserError(
            "--max-lag bounds how many epochs stale rows may be, but --staleness is 0; add --staleness 1 or drop --max-lag"
        )
    if c.exchange == "hierarchical":
        raise UserError(
            "--max-lag sends rows point to point from owner to requester; pass --exchange direct (or auto) instead of hierarchical, or drop --max-lag"
        )


def check_pool_size(num_parts: int, world: int, parts_dir: Path | str) -> None:
    """``--work-pool`` needs at least one partition per rank."""
    if num_parts < world:
        raise UserError(
            f"--work-pool hands out partitions, but {parts_dir} has {num_parts} for {world} ranks; re-partition into at least {world} parts (more than ranks lets fast ranks take more)"
        )
