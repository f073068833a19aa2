"""The checks of a training configuration, and the parsing of the settings that have a syntax
of their own (``--sync MODE``, ``--inject-delay R:S[,...]``).

Every check raises :class:`~bnsgcn.errors.UserError` in one line naming the flag and the
fix. Those that need the number of ranks (:func:`check_flags`) run in the launcher before
any rank starts and again on every rank (torchrun and srun start ranks directly).
"""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from bnsgcn.config.sections import (
    EXCHANGES,
    LOGGERS,
    LR_SCHEDULES,
    MODEL_ARGUMENTS,
    MODEL_CLASS_PATH,
    MODELS,
    NONZERO_ROWS,
    NORMS,
    OPTIMIZERS,
    PRECISIONS,
    SETTINGS,
    WIRE_FORMATS,
    OptimConfig,
    RunConfig,
    TrainConfig,
    flag_name,
)
from bnsgcn.device import DEVICES
from bnsgcn.errors import UserError

SYNC_KINDS = ("allreduce", "grouped", "partial", "gossip")
# --logger NAME -> the package it needs (csv needs none); pip installs both with bnsgcn[loggers]
LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
OPTIONS_EXAMPLE = """'{"eps": 0.1}'"""  # --model-options as a shell takes it
DEFAULT_GROUPS = 2  # grouped:G without :N: a fast and a slow group


def validate(config: TrainConfig) -> None:
    """Refuse a configuration no run can use, in one line naming the flag and the fix."""
    for section, f in SETTINGS.values():  # nan passes every comparison below: refuse it (and inf) first
        value = getattr(getattr(config, section), f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"{flag_name(f)} {value} is not a finite number; pass a finite value")
    c = SimpleNamespace(**config.settings())  # the checks read as the flags they name
    if not -(2**63) <= c.seed < 2**63:
        raise UserError(f"--seed {c.seed} does not fit in 64 bits; pass a smaller seed")
    if not 0.0 <= c.p <= 1.0:
        raise UserError(f"--p {c.p} is outside [0, 1]; pass a probability such as --p 0.1")
    _check_model(config)
    if c.norm not in NORMS:
        raise UserError(f"unknown norm {c.norm!r}; choose --norm from {', '.join(NORMS)}")
    for flag, value in (
        ("--layers", c.layers),
        ("--hidden", c.hidden),
        ("--heads", c.heads),
        ("--epochs", c.epochs),
        ("--keep-checkpoints", c.keep_checkpoints),
        ("--ranks-per-gpu", c.ranks_per_gpu),
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
    _check_optimizer(c)
    _check_schedule(config)
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
    for flag, value in (("--compress", config.wire_format), ("--compress-grad", config.grad_wire_format)):
        if value not in WIRE_FORMATS:
            raise UserError(f"unknown wire format {flag} {value}; choose from {', '.join(WIRE_FORMATS)}")
    if c.staleness not in (0, 1):
        raise UserError(
            f"--staleness {c.staleness} is not supported; choose --staleness 0 (exact exchange) or 1 (one epoch stale)"
        )
    if c.stale_smoothing is not None:
        if not 0.0 < c.stale_smoothing < 1.0:
            raise UserError(
                f"--stale-smoothing {c.stale_smoothing} is outside (0, 1); pass the old average's weight, e.g. "
                "--stale-smoothing 0.9"
            )
        if c.staleness != 1:
            raise UserError(
                "--stale-smoothing averages stale rows and gradients, but --staleness is 0; add --staleness 1 or drop "
                "--stale-smoothing"
            )
    check_sync(c.p, c.staleness, parse_sync(c.sync), c.norm)
    _check_max_lag(c)
    if c.work_pool:
        check_work_pool(c.p, c.staleness, c.norm, c.inductive)
    parse_delays(c.inject_delay)
    if c.precision not in PRECISIONS:
        raise UserError(f"unknown precision {c.precision!r}; choose --precision from {', '.join(PRECISIONS)}")
    if c.device not in DEVICES:
        raise UserError(f"unknown device {c.device!r}; use --device auto, cpu or cuda")
    if c.threads is not None and c.threads < 1:
        raise UserError(f"--threads {c.threads} must be a positive integer")
    if config.model.use_precompute and c.model == "gat":
        raise UserError("--precompute is not exact for gat (attention depends on the weights); drop --precompute")
    _check_loggers(config.run)


def _check_loggers(run: RunConfig) -> None:
    """``--logger``: known names whose packages are installed (found without importing them: the launcher stays
    light), and the W&B flags only with wandb, in one line each."""
    for name in run.loggers:
        if name not in LOGGERS:
            raise UserError(
                f"unknown logger {name!r}; choose --logger from {', '.join(LOGGERS)} (several comma-separated)"
            )
        package = LOGGER_PACKAGES.get(name)
        if package is not None and importlib.util.find_spec(package) is None:
            raise UserError(
                f"--logger {name} needs the {package} package, which is not installed; pip install {package} (or pip "
                f"install 'bnsgcn[loggers]'), or drop {name} from --logger"
            )
    defaults = RunConfig()
    for flag, given in (
        ("--wandb-project", run.wandb_project != defaults.wandb_project),
        ("--run-name", run.run_name is not None),
    ):
        if given and "wandb" not in run.loggers:
            raise UserError(
                f"{flag} is for the W&B logger, but --logger has no wandb; add --logger wandb or drop {flag}"
            )


def _check_model(config: TrainConfig) -> None:
    """``--model`` (a built-in name or ``module.path:ClassName``) and what only one kind
    takes, in one line each. Whether the class can be imported and built is checked where
    it is (:mod:`bnsgcn.nn.user_model`): importing it may import torch."""
    m = config.model
    if not isinstance(m.name, str) or not (m.builtin or MODEL_CLASS_PATH.fullmatch(m.name)):
        raise UserError(
            f"unknown model {m.name!r}; choose --model from {', '.join(MODELS)}, or name a model class of your own as "
            "module.path:ClassName"
        )
    if m.builtin:
        if m.options is not None:
            raise UserError(
                f"--model-options passes keyword arguments to a model class of your own, but --model is {m.name}; drop "
                "--model-options"
            )
        return
    for flag, given in (("--precompute", m.precompute), ("--remat", m.remat)):
        if given:
            raise UserError(
                f"{flag} applies to the built-in models, but --model is {m.name}, a class of your own; drop {flag}"
            )
    if m.options is None:
        return
    try:
        options = json.loads(m.options)
    except (TypeError, ValueError) as exc:
        raise UserError(
            f"--model-options {m.options} is not JSON text ({exc}); pass an object, e.g. {OPTIONS_EXAMPLE}"
        ) from None
    if not isinstance(options, dict):
        raise UserError(f"--model-options {m.options} is not a JSON object; pass one, e.g. {OPTIONS_EXAMPLE}")
    if taken := sorted(set(options) & set(MODEL_ARGUMENTS)):
        raise UserError(
            f"--model-options names {taken[0]}, which bnsgcn passes itself (from --layers, --hidden, --dropout and the "
            "data); set it with its flag instead"
        )


def _check_optimizer(c: SimpleNamespace) -> None:
    """``--optimizer`` and what only SGD takes, in one line each."""
    if c.optimizer not in OPTIMIZERS:
        raise UserError(f"unknown optimizer {c.optimizer!r}; choose --optimizer from {', '.join(OPTIMIZERS)}")
    if not 0.0 <= c.momentum < 1.0:
        raise UserError(f"--momentum {c.momentum} is outside [0, 1); pass e.g. --momentum 0.9")
    for flag, given in (("--momentum", c.momentum != 0.0), ("--nesterov", c.nesterov)):
        if given and c.optimizer != "sgd":
            raise UserError(
                f"{flag} is for --optimizer sgd, but the optimizer is {c.optimizer} (which keeps moments of its own); "
                f"add --optimizer sgd or drop {flag}"
            )
    if c.nesterov and c.momentum == 0.0:
        raise UserError("--nesterov needs momentum, but --momentum is 0; pass e.g. --momentum 0.9")
    if c.grad_clip is not None and c.grad_clip <= 0:
        raise UserError(f"--grad-clip {c.grad_clip} must be a positive gradient norm; pass e.g. --grad-clip 1.0")


def _check_schedule(config: TrainConfig) -> None:
    """``--lr-schedule``, its warm-up and the parameters of each schedule, in one line each.
    A schedule's parameter given to another schedule is refused (it would do nothing)."""
    o, epochs = config.optim, config.run.epochs
    if o.lr_schedule not in LR_SCHEDULES:
        raise UserError(f"unknown --lr-schedule {o.lr_schedule!r}; choose from {', '.join(LR_SCHEDULES)}")
    if o.warmup_epochs < 0:
        raise UserError(f"--warmup-epochs {o.warmup_epochs} must be 0 or a positive integer")
    defaults = OptimConfig()
    for flag, schedule, given in (
        ("--cosine-epochs", "cosine", o.cosine_epochs is not None),
        ("--lr-step-epochs", "step", o.lr_step_epochs != defaults.lr_step_epochs),
        ("--lr-gamma", "step", o.lr_gamma != defaults.lr_gamma),
        ("--plateau-patience", "plateau", o.plateau_patience != defaults.plateau_patience),
        ("--plateau-factor", "plateau", o.plateau_factor != defaults.plateau_factor),
    ):
        if given and o.lr_schedule != schedule:
            raise UserError(
                f"{flag} sets the {schedule} schedule, but --lr-schedule is {o.lr_schedule}; add --lr-schedule "
                f"{schedule} or drop {flag}"
            )
    if o.lr_schedule == "cosine":
        length = o.cosine_length(epochs)
        if o.cosine_epochs is not None and o.cosine_epochs < 1:
            raise UserError(f"--cosine-epochs {o.cosine_epochs} must be a positive integer")
        if length < epochs - o.warmup_epochs:
            raise UserError(
                f"--cosine-epochs {length} ends the decay before the last epoch (--epochs {epochs} less "
                f"--warmup-epochs {o.warmup_epochs}), leaving a learning rate of 0; pass --cosine-epochs "
                f"{epochs - o.warmup_epochs} or more"
            )
        if length < 1:
            raise UserError(
                f"--warmup-epochs {o.warmup_epochs} leaves no epoch of --epochs {epochs} for the cosine; pass fewer "
                "warm-up epochs or --cosine-epochs N"
            )
    if o.lr_step_epochs < 1:
        raise UserError(f"--lr-step-epochs {o.lr_step_epochs} must be a positive integer")
    if not 0.0 < o.lr_gamma <= 1.0:
        raise UserError(f"--lr-gamma {o.lr_gamma} is outside (0, 1]; pass e.g. --lr-gamma 0.1")
    if o.plateau_patience < 1:
        raise UserError(f"--plateau-patience {o.plateau_patience} must be a positive number of evaluations")
    if not 0.0 < o.plateau_factor < 1.0:
        raise UserError(f"--plateau-factor {o.plateau_factor} is outside (0, 1); pass e.g. --plateau-factor 0.5")
    if o.lr_schedule == "plateau" and config.evaluation.every == 0:
        raise UserError(
            "--lr-schedule plateau acts on the validation score of each evaluation, but --eval-every is 0 (only after "
            "the last epoch); pass --eval-every N"
        )


def _check_max_lag(c: SimpleNamespace) -> None:
    """What ``--max-lag`` (:mod:`bnsgcn.exchange.bounded_lag`) needs, in one line each."""
    if c.max_lag is None:
        return
    if c.max_lag < 1:
        raise UserError(
            f"--max-lag {c.max_lag} must be a positive number of epochs; pass e.g. --max-lag 3 (1 is --staleness 1 "
            "itself)"
        )
    if c.staleness != 1:
        raise UserError(
            "--max-lag bounds how many epochs stale rows may be, but --staleness is 0; add --staleness 1 or drop "
            "--max-lag"
        )
    if c.exchange == "hierarchical":
        raise UserError(
            "--max-lag sends rows point to point from owner to requester; pass --exchange direct (or auto) instead of "
            "hierarchical, or drop --max-lag"
        )


def parse_delays(spec: str | None) -> dict[int, tuple[float, float]]:
    """``"0:0.8,3:0.4-0.45"`` -> {0: (0.8, 0.8), 3: (0.4, 0.45)} (seconds); None or "" -> {}.
    Raises :class:`UserError` in one line naming the bad entry."""
    if not spec:
        return {}
    delays: dict[int, tuple[float, float]] = {}
    for entry in spec.split(","):
        rank_text, _, seconds = entry.strip().partition(":")
        low_text, dash, high_text = seconds.partition("-")
        try:
            rank, low = int(rank_text), float(low_text)
            high = float(high_text) if dash else low
        except ValueError:
            raise UserError(
                f"--inject-delay entry {entry!r} is not R:S or R:LO-HI; pass e.g. --inject-delay 0:0.8,3:0.4-0.45"
            ) from None
        if rank < 0:
            raise UserError(f"--inject-delay entry {entry!r} names rank {rank}; ranks are 0 or more")
        if not (0.0 <= low <= high < float("inf")):
            raise UserError(
                f"--inject-delay entry {entry!r} needs 0 <= LO <= HI seconds (finite); pass e.g. {rank}:0.4-0.45"
            )
        if rank in delays:
            raise UserError(f"--inject-delay names rank {rank} twice; give each rank one entry")
        delays[rank] = (low, high)
    return delays


@dataclass(frozen=True)
class SyncMode:
    """A parsed ``--sync``: ``kind`` and its numbers. ``every``: G steps between leader
    averages (grouped), P ranks per round (partial), K steps between gossip rounds (gossip);
    ``groups``: the number of speed groups (grouped only)."""

    kind: str = "allreduce"
    every: int = 0
    groups: int = DEFAULT_GROUPS

    @property
    def decoupled(self) -> bool:
        """Ranks do not sum gradients over the whole job every step: they may drift apart
        between the points where every rank meets (evaluation, checkpoint, the end)."""
        return self.kind != "allreduce"


def parse_sync(spec: str) -> SyncMode:
    """``allreduce`` | ``grouped:G[:N]`` | ``partial:P`` | ``gossip:K`` -> :class:`SyncMode`;
    :class:`UserError` in one line otherwise."""
    kind, *numbers = spec.split(":")
    usage = "choose --sync allreduce, grouped:G[:N], partial:P or gossip:K (e.g. --sync partial:2)"
    if kind not in SYNC_KINDS:
        raise UserError(f"unknown --sync {spec!r}; {usage}")
    if kind == "allreduce":
        if numbers:
            raise UserError(f"--sync allreduce takes no number (got {spec!r}); {usage}")
        return SyncMode()
    allowed = 2 if kind == "grouped" else 1
    try:
        values = [int(n) for n in numbers]
    except ValueError:
        values = []
    if not 1 <= len(values) <= allowed or any(v < 1 for v in values) or len(values) != len(numbers):
        raise UserError(
            f"--sync {spec!r} needs positive integers: "
            f"{kind}:{'G[:N]' if kind == 'grouped' else 'P' if kind == 'partial' else 'K'}; {usage}"
        )
    return SyncMode(kind, values[0], values[1] if len(values) > 1 else DEFAULT_GROUPS)


def check_sync(p: float, staleness: int, sync: SyncMode, norm: str) -> None:
    """What a decoupled sync needs, in one line: ranks must not wait on each other every layer."""
    if sync.decoupled and norm == "batch":
        raise UserError(
            f"--sync {sync.kind} lets ranks run apart, but --norm batch sums statistics over every rank in every "
            "layer; use --norm layer or none, or --sync allreduce"
        )
    if sync.decoupled and p > 0.0 and staleness == 0:
        raise UserError(
            f"--sync {sync.kind} only helps when ranks do not exchange boundary rows every layer, but --p is {p:g} "
            "with "
            "--staleness 0; add --staleness 1 (stale exchange) or pass --p 0, or use --sync allreduce"
        )


def check_work_pool(p: float, staleness: int, norm: str, inductive: bool) -> None:
    """What ``--work-pool`` needs, in one line: partitions trained on their own."""
    if p != 0.0:
        raise UserError(
            f"--work-pool trains each partition on its own subgraph (boundary nodes dropped), but --p is {p:g}; pass "
            "--p 0"
        )
    if staleness:
        raise UserError(
            "--work-pool exchanges no boundary rows, so --staleness 1 has nothing to delay; drop --staleness"
        )
    if norm == "batch":
        raise UserError(
            "--work-pool lets ranks take different numbers of steps, but --norm batch sums statistics over every rank "
            "in every layer; use --norm layer or none"
        )
    if inductive:
        raise UserError("--work-pool does not support --inductive; drop one of them")


def check_world(delays: dict[int, tuple[float, float]], sync: SyncMode, world_size: int) -> None:
    """The checks that need the number of ranks (the launcher's, and every rank's)."""
    beyond = sorted(r for r in delays if r >= world_size)
    if beyond:
        raise UserError(
            f"--inject-delay names rank {beyond[0]}, but the job has {world_size} ranks (0 to {world_size - 1})"
        )
    if sync.kind == "partial" and sync.every > world_size:
        raise UserError(
            f"--sync partial:{sync.every} averages {sync.every} ranks per round, but the job has {world_size}; pass P "
            f"<= {world_size}"
        )
    if sync.kind == "grouped" and sync.groups > world_size:
        raise UserError(
            f"--sync grouped:{sync.every}:{sync.groups} asks for {sync.groups} groups of {world_size} ranks; pass N "
            f"<= {world_size}"
        )


def check_flags(config: TrainConfig, world_size: int) -> None:
    """``--inject-delay`` and ``--sync`` of a :class:`TrainConfig` against the job's
    ``world_size`` (the launcher's check before any rank starts; every rank repeats it)."""
    check_world(parse_delays(config.sync.inject_delay), parse_sync(config.sync.mode), world_size)


def check_pool_size(num_parts: int, world: int, parts_dir: Path | str) -> None:
    """``--work-pool`` needs at least one partition per rank."""
    if num_parts < world:
        raise UserError(
            f"--work-pool hands out partitions, but {parts_dir} has {num_parts} for {world} ranks; re-partition into "
            f"at least {world} parts (more than ranks lets fast ranks take more)"
        )
