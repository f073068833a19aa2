"""The training settings, in sections: one frozen dataclass per part of the job.

Each field is one setting, defined once: its default, its ``--help`` text and its flag
(``--name-with-dashes`` of the field, unless the field names another). The parser
(:func:`bnsgcn.config.flags.add_arguments`), the help and docs/cli.md follow from here.
Settings are also addressed flat, by their flag's name with underscores (``p``,
``model``, ``eval_every``): :meth:`TrainConfig.from_settings`, :meth:`TrainConfig.replace`
and ``config.json`` use those names.

Imports no torch: ``bnsgcn-train``'s launcher reads and checks the flags with this package
before it starts any rank, and importing torch would add about 2 s to every job's start and
to every refused flag.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from bnsgcn.errors import UnknownSetting

MODELS = ("graphsage", "gat", "gcn")
# --model module.path:ClassName, a model class of the user's own (docs/api.md, "Your own model")
MODEL_CLASS_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
# the keyword arguments such a class is built with, PyG's names for them (and --model-options' own)
MODEL_ARGUMENTS = ("in_channels", "hidden_channels", "out_channels", "num_layers", "dropout")
WIRE_FORMATS = ("none", "fp16", "bf16", "int8", "int4")  # what bnsgcn.comm.wire encodes
PRECISIONS = ("fp32", "tf32", "bf16")  # what bnsgcn.nn.precision sets up
EXCHANGES = ("direct", "hierarchical", "auto")
NONZERO_ROWS = ("auto", "on", "off")
NORMS = ("layer", "batch", "none")
OPTIMIZERS = ("adam", "adamw", "sgd")  # what bnsgcn.nn.optim builds
LR_SCHEDULES = ("none", "cosine", "step", "plateau")
LOGGERS = ("tensorboard", "wandb", "csv")  # what bnsgcn.metrics.loggers makes


def setting(default, help: str, *, flag: str | None = None, **argparse_options):
    """One training setting: its default, its ``--help`` text (the default is appended), its
    flag when not the field's own name, and any further
    :meth:`argparse.ArgumentParser.add_argument` options (``shown``: the default as help
    and docs show it)."""
    return field(default=default, metadata={"help": help, "flag": flag, **argparse_options})


@dataclass(frozen=True)
class DataConfig:
    """The partition set a job trains on."""

    parts_dir: Path | None = setting(
        None, "partition set written by bnsgcn-partition", type=Path, shown="found: the one set that matches"
    )
    inductive: bool = setting(False, "train on the subgraph induced by training nodes, evaluate on the full graph")
    verify: bool = setting(False, "check the SHA-256 of every partition file before training")


@dataclass(frozen=True)
class ModelConfig:
    """The GNN: its kind, its shape and what its forward pass keeps."""

    name: str = setting(
        "graphsage", "graphsage | gat | gcn, or a model class of your own as module.path:ClassName", flag="--model"
    )
    options: str | None = setting(
        None,
        "a model class of your own: more keyword arguments for its constructor, as a JSON object",
        flag="--model-options",
        type=str,
        metavar="JSON",
        shown="none",
    )
    layers: int = setting(3, "number of GNN layers")
    hidden: int = setting(256, "hidden width (per head for gat)")
    heads: int = setting(4, "attention heads for gat")
    dropout: float = setting(0.5, "dropout probability")
    norm: str = setting("layer", "layer | batch | none: normalisation between layers")
    precompute: bool | None = setting(
        None,
        "precompute the first layer's full-graph aggregation (--no-precompute: aggregate it every epoch)",
        shown="on for graphsage and gcn",
    )
    remat: bool = setting(
        False,
        "recompute each layer's aggregation (and the norm before it) in backward instead of keeping it: "
        "less memory, about one more forward pass of compute",
    )

    @property
    def builtin(self) -> bool:
        """One of the built-in models (else a class of the user's own, ``module.path:ClassName``)."""
        return self.name in MODELS

    @property
    def keyword_options(self) -> dict:
        """``--model-options`` as keyword arguments ({} without; checked by :func:`bnsgcn.config.validate`)."""
        return json.loads(self.options) if self.options else {}

    @property
    def use_precompute(self) -> bool:
        """The first layer's full-graph aggregation is precomputed where that is exact."""
        if self.precompute is None:
            return self.name in ("graphsage", "gcn")
        return self.precompute


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer, its learning-rate schedule and gradient clipping."""

    name: str = setting("adam", "adam | adamw | sgd", flag="--optimizer")
    lr: float = setting(0.01, "learning rate (with a schedule: its peak)")
    weight_decay: float = setting(
        0.0, "weight decay: added to the gradient as L2 (adam, sgd), or decoupled from it (adamw)"
    )
    momentum: float = setting(0.0, "sgd: momentum, 0 <= M < 1")
    nesterov: bool = setting(False, "sgd: Nesterov momentum (needs --momentum above 0)")
    grad_clip: float | None = setting(
        None,
        "scale the gradient down to this L2 norm over every parameter where it is larger (after the all-reduce)",
        type=float,
        metavar="NORM",
        shown="off",
    )
    lr_schedule: str = setting(
        "none",
        "none | cosine | step | plateau: the learning rate per epoch after the warm-up; cosine falls to 0 over "
        "--cosine-epochs, step multiplies it by --lr-gamma every --lr-step-epochs, plateau by --plateau-factor after "
        "--plateau-patience evaluations without a better validation score",
    )
    warmup_epochs: int = setting(0, "raise the learning rate linearly to --lr over the first N epochs")
    cosine_epochs: int | None = setting(
        None,
        "cosine: the epochs after the warm-up over which the rate falls to 0",
        type=int,
        metavar="N",
        shown="--epochs less --warmup-epochs",
    )
    lr_step_epochs: int = setting(50, "step: epochs between two multiplications by --lr-gamma")
    lr_gamma: float = setting(0.1, "step: the factor, 0 < G <= 1")
    plateau_patience: int = setting(3, "plateau: evaluations without a better validation score before a cut")
    plateau_factor: float = setting(0.1, "plateau: the factor of a cut, 0 < F < 1")

    def cosine_length(self, epochs: int) -> int:
        """The epochs the cosine falls over (``--cosine-epochs``, else the run after the warm-up)."""
        return self.cosine_epochs if self.cosine_epochs is not None else epochs - self.warmup_epochs


@dataclass(frozen=True)
class ExchangeConfig:
    """Which boundary rows move each epoch (``p``), how they travel and how stale they may be."""

    p: float = setting(0.1, "boundary node sampling probability, 0 <= p <= 1")
    mode: str = setting(
        "auto",
        "direct | hierarchical | auto: boundary rows cross between machines once per remote node and are relayed "
        "inside "
        "it (hierarchical), or once per rank that needs them (direct); auto = hierarchical when the job spans several "
        "machines and some machine runs several ranks",
        flag="--exchange",
    )
    nonzero_rows: str = setting(
        "auto",
        "auto | on | off: with on, a hidden layer's boundary rows (ReLU outputs) cross as a bitmap and their nonzero "
        "entries, and their gradients at those entries alone: exact, about a third of the bytes after dropout 0.5, for "
        "a pass more over the rows each way; auto = on when the job spans several machines",
    )
    compress: str | None = setting(
        None,
        "none | fp16 | bf16 | int8 | int4: how boundary rows cross the network "
        "(int8/int4: per-row range, stochastic rounding; sums stay float32)",
        type=str,
        shown="the compute dtype: none, bf16 with --precision bf16",
    )
    compress_grad: str | None = setting(None, "the same for the rows' gradients", type=str, shown="as --compress")
    staleness: int = setting(
        0,
        "0 | 1: with 1, each layer aggregates the boundary rows their owners sent during the previous epoch and their "
        "gradients reach the owners one epoch later, so every exchange runs behind a whole epoch of compute; the first "
        "epoch and evaluation stay exact",
    )
    stale_smoothing: float | None = setting(
        None,
        "with --staleness 1: use exponential averages (weight GAMMA on the old average, 0 < GAMMA < 1) "
        "of the stale rows and gradients",
        type=float,
        metavar="GAMMA",
        shown="off",
    )
    max_lag: int | None = setting(
        None,
        "with --staleness 1: a rank may run up to S epochs ahead of the ranks it shares boundary nodes with; rows and "
        "gradients travel point to point as their owners produce them, each rank uses the newest version at most S "
        "epochs "
        "old and waits only when it would exceed that (1: --staleness 1 itself); pair it with a decoupled --sync",
        type=int,
        metavar="S",
        shown="off",
    )


@dataclass(frozen=True)
class SyncConfig:
    """How ranks keep their parameters together, and the testing aid that makes some slower."""

    mode: str = setting(
        "allreduce",
        "allreduce | grouped:G[:N] | partial:P | gossip:K: how ranks keep parameters together when some are slower; "
        "allreduce sums gradients over every rank every step; grouped sums them inside N groups of similar speed "
        "(default 2) and averages across group leaders every G steps; partial averages the first P ranks to arrive "
        "each step; gossip averages with one random partner every K steps; all but allreduce need --p 0 or "
        "--staleness 1 and average every rank before each evaluation, checkpoint and the end",
        flag="--sync",
        metavar="MODE",
    )
    bucket_mb: float = setting(1.0, "MiB of parameter gradients per all-reduce bucket")
    work_pool: bool = setting(
        False,
        "with --p 0 and a partition set of more parts than ranks: ranks take partitions from a pool in the job's "
        "store, one step each, until every partition had its step this epoch; fast ranks take more (--inject-delay "
        "then delays every step)",
    )
    inject_delay: str | None = setting(
        None,
        "testing aid: rank R sleeps S seconds every epoch, or a seeded uniform draw in LO-HI, e.g. 0:0.8,3:0.4-0.45; "
        "reported as injected delay, not compute",
        type=str,
        metavar="R:S[,R:LO-HI...]",
        shown="none",
    )

    @property
    def bucket_bytes(self) -> int:
        """Size of a gradient all-reduce bucket (see :class:`bnsgcn.sync.reducer.GradientReducer`)."""
        return int(self.bucket_mb * 2**20)


@dataclass(frozen=True)
class EvaluationConfig:
    """When the full-graph scores are computed, and the buffers their exchange may take."""

    every: int = setting(10, "evaluate every N epochs, 0 = only at the end", flag="--eval-every")
    buffer_mib: float = setting(
        32.0,
        "MiB an evaluation exchange buffer (sent or received rows) may take: evaluation exchanges and aggregates each "
        "layer's boundary rows in column slices that fit (at least one column); 0 = every row of a layer at once",
        flag="--eval-buffer-mib",
        metavar="MIB",
    )

    @property
    def buffer_bytes(self) -> int:
        """The most bytes of an evaluation exchange buffer (0: unsliced, see :mod:`bnsgcn.run.evaluate`)."""
        return math.ceil(self.buffer_mib * 2**20)

    def due(self, epoch: int, epochs: int) -> bool:
        """Evaluate after ``epoch`` (1-based): every ``every`` epochs, and after the last."""
        return (self.every > 0 and epoch % self.every == 0) or epoch == epochs


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints: how often, how many are kept, and resuming from them."""

    every: int = setting(0, "save a checkpoint every N epochs (0: never)", flag="--checkpoint-every")
    keep: int = setting(2, "checkpoints kept", flag="--keep-checkpoints")
    resume: bool = setting(False, "continue from the newest valid checkpoint in --out")

    def due(self, epoch: int) -> bool:
        """A checkpoint is written after ``epoch`` (1-based)."""
        return self.every > 0 and epoch % self.every == 0


@dataclass(frozen=True)
class RunConfig:
    """The run as a whole: its length and seed, where it runs and where it writes."""

    epochs: int = setting(200, "training epochs")
    seed: int = setting(0, "seed of parameters, sampling and dropout")
    device: str = setting(
        "auto",
        "auto | cpu | cuda (set by --gpus / --procs); auto = cuda when this machine has a GPU per --ranks-per-gpu "
        "local ranks",
    )
    ranks_per_gpu: int = setting(
        1,
        "ranks sharing each CUDA GPU: --gpus G starts G x N ranks on this machine and local rank L trains on GPU "
        "L // N; above 1 the ranks communicate over gloo, through host memory, instead of NCCL",
        metavar="N",
    )
    precision: str = setting(
        "fp32",
        "fp32 | tf32 | bf16: the dense products' precision; tf32 lets CUDA matmuls use TF32 (no effect on CPU), bf16 "
        "runs them in bfloat16 under autocast while parameters, optimizer state, loss, sums and norms stay float32",
    )
    threads: int | None = setting(None, "CPU threads per rank", type=int, shown="cores / local ranks")
    out: Path | None = setting(None, "run directory", type=Path, shown="a new runs/<timestamp>")
    force: bool = setting(
        False, "start anew in an --out that holds an earlier run, moving that run into <out>/previous-<n>/"
    )
    log_json: Path | None = setting(None, "also write the per-epoch JSON lines here", type=Path, shown="none")
    logger: str | None = setting(
        None,
        "tensorboard | wandb | csv: experiment loggers rank 0 sends every epoch's figures to, several comma-separated "
        "(tensorboard,csv) or by repeating the flag",
        type=str,
        metavar="NAME[,NAME...]",
        shown="none",
        joined=True,
    )
    wandb_project: str = setting("bnsgcn", "wandb: the W&B project the run is logged to")
    run_name: str | None = setting(None, "wandb: the run's name in W&B", type=str, shown="the run directory's name")
    timeout: float = setting(300.0, "seconds any collective may wait before the job fails")
    debug: bool = setting(False, "show tracebacks")

    @property
    def loggers(self) -> tuple[str, ...]:
        """The experiment loggers ``--logger`` names, each once, in order: a comma-separated text (the
        command line), or a list of names (Python). Checked by :func:`bnsgcn.config.validate`."""
        if self.logger is None:
            return ()
        names = self.logger.split(",") if isinstance(self.logger, str) else self.logger
        return tuple(dict.fromkeys(str(name).strip() for name in names))


@dataclass(frozen=True)
class TrainConfig:
    """Every training setting, by section (see the module). ``TrainConfig()`` is the defaults;
    :meth:`from_settings` builds one from flat settings, as the command line names them."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    exchange: ExchangeConfig = field(default_factory=ExchangeConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @classmethod
    def from_settings(cls, **settings) -> TrainConfig:
        """A configuration from flat settings (``p=0.1, model="gat", eval_every=2``: each
        flag's name with underscores); the rest keep their defaults. Not validated (see
        :func:`bnsgcn.config.validate`)."""
        return cls().replace(**settings)

    def replace(self, **settings) -> TrainConfig:
        """This configuration with the flat ``settings`` changed."""
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise UnknownSetting(
                f"unknown training setting {unknown[0]!r}; the settings are the flags of bnsgcn-train, dashes as "
                "underscores (eval_every for --eval-every)"
            )
        changed: dict[str, dict] = {}
        for name, value in settings.items():
            section, f = SETTINGS[name]
            changed.setdefault(section, {})[f.name] = value
        return dataclasses.replace(
            self, **{s: dataclasses.replace(getattr(self, s), **values) for s, values in changed.items()}
        )

    def settings(self) -> dict:
        """Every setting by its flat name."""
        return {name: getattr(getattr(self, section), f.name) for name, (section, f) in SETTINGS.items()}

    @property
    def wire_format(self) -> str:
        """Wire format of the boundary rows: ``--compress``, else the compute dtype's (``bf16`` with
        ``--precision bf16``, else ``none``: float32)."""
        if self.exchange.compress is not None:
            return self.exchange.compress
        return "bf16" if self.run.precision == "bf16" else "none"

    @property
    def grad_wire_format(self) -> str:
        """Wire format of the boundary rows' gradients: ``--compress-grad``, else the rows' own."""
        return self.wire_format if self.exchange.compress_grad is None else self.exchange.compress_grad

    def resolved(self, run_dir: Path, device: str, threads: int) -> TrainConfig:
        """This configuration with every choice left to the run made: precompute, run
        directory, device type, threads and the wire formats of rows and gradients (what
        config.json records; the run resolves ``exchange`` itself) and, with the cosine
        schedule, its length."""
        return self.replace(
            precompute=self.model.use_precompute,
            out=run_dir,
            device=device,
            threads=threads,
            compress=self.wire_format,
            compress_grad=self.grad_wire_format,
            cosine_epochs=(self.optim.cosine_length(self.run.epochs) if self.optim.lr_schedule == "cosine" else None),
        )

    def to_json(self) -> dict:
        """Every setting by its flat name, paths as strings (config.json)."""
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in self.settings().items()}

    def model_signature(self) -> dict:
        """The settings a checkpoint must agree on to be resumed."""
        keys = ("model", "layers", "hidden", "heads", "norm", "inductive", "staleness", "stale_smoothing")
        flat = self.settings()
        # a class of the user's own is built with its options too (a built-in model takes none)
        options = {"model_options": self.model.keyword_options} if self.model.options else {}
        return {k: flat[k] for k in keys} | options | {"precompute": self.model.use_precompute}


def flag_name(f: dataclasses.Field) -> str:
    """The command-line flag of a setting's field."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def setting_name(f: dataclasses.Field) -> str:
    """A setting's flat name: its flag without dashes, ``_`` for ``-``."""
    return flag_name(f).removeprefix("--").replace("-", "_")


# flat name -> (section, field), in the order of the sections and their fields
SETTINGS: dict[str, tuple[str, dataclasses.Field]] = {
    setting_name(f): (section.name, f)
    for section in dataclasses.fields(TrainConfig)
    for f in dataclasses.fields(section.default_factory)
}
