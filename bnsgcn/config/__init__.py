"""Training configuration: the settings in sections, their flags and their checks.

* :mod:`~bnsgcn.config.sections`: one frozen dataclass per part of the job, gathered in
  :class:`TrainConfig`: every setting's default and help, defined once;
* :mod:`~bnsgcn.config.flags`: the command-line parser built from them;
* :mod:`~bnsgcn.config.checks`: what a run refuses, in one line each.
"""

from bnsgcn.config.checks import (
    SyncMode,
    check_flags,
    check_pool_size,
    check_world,
    parse_delays,
    parse_sync,
    validate,
)
from bnsgcn.config.flags import add_arguments, from_args, shown_default, to_argv
from bnsgcn.config.sections import (
    PRECISIONS,
    SETTINGS,
    WIRE_FORMATS,
    CheckpointConfig,
    DataConfig,
    EvaluationConfig,
    ExchangeConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    SyncConfig,
    TrainConfig,
    flag_name,
)

__all__ = [
    "PRECISIONS",
    "SETTINGS",
    "WIRE_FORMATS",
    "CheckpointConfig",
    "DataConfig",
    "EvaluationConfig",
    "ExchangeConfig",
    "ModelConfig",
    "OptimConfig",
    "RunConfig",
    "SyncConfig",
    "SyncMode",
    "TrainConfig",
    "add_arguments",
    "check_flags",
    "check_pool_size",
    "check_world",
    "flag_name",
    "from_args",
    "parse_delays",
    "parse_sync",
    "shown_default",
    "to_argv",
    "validate",
]
