"""``bnsgcn.train(parts, **settings)``: ``bnsgcn-train`` called from Python.

The settings become the command's flags (:func:`bnsgcn.config.to_argv`) and take the
command's own path on one machine: its parser, :func:`~bnsgcn.launch.cli.prepare_local_ranks`
(every check before any rank starts) and the supervisor
(:func:`~bnsgcn.launch.supervisor.supervise_outcome`), which starts each rank as a process
of its own (``python -m bnsgcn.launch.rank``): the caller's script or notebook is never
imported again, so it needs no ``if __name__ == "__main__"`` guard. Ctrl-C (SIGINT) or
SIGTERM during the call stops every rank, then reaches the caller as it would have
(KeyboardInterrupt for Ctrl-C). When the ranks are done, the run directory is read back
into a :class:`Result`.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bnsgcn.config import TrainConfig, to_argv
from bnsgcn.errors import UserError
from bnsgcn.run.provenance import new_run_dir

from .cli import build_parser, prepare_local_ranks
from .environment import launch_record
from .supervisor import Outcome, supervise_outcome

if TYPE_CHECKING:
    import torch

    from bnsgcn.run.inference import WholeGraph


class RankFailed(UserError):
    """A rank of the job failed: the message is ``bnsgcn-train``'s last line without
    ``error:`` (``rank R failed (exit code 2): error: [rank R] <its message>``), ``status``
    the command's exit status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Result:
    """What a training run produced, read from its run directory.

    ``model``: the GNN (a ``torch.nn.Module``) on the CPU in eval mode, with the parameters of
    the best validation epoch (``best_model.pt``); ``config``: every setting as the run
    resolved it (``config.json``); ``metrics``: one dict per epoch line of ``metrics.jsonl``
    (``epoch``, ``loss``, ``time``, bytes, and ``train_score``/``val_score``/``test_score``
    on evaluated epochs); ``summary``: its last line (``final_loss``, ``best_val_score``,
    ``best_epoch``, ``test_score``); ``run_dir`` the run directory.
    """

    model: torch.nn.Module
    config: TrainConfig
    metrics: list[dict]
    summary: dict
    run_dir: Path
    _graph: WholeGraph | None = field(default=None, repr=False)

    @property
    def best_val_score(self) -> float:
        """Accuracy (micro-F1 for multi-label) on the validation nodes at the best epoch."""
        return self.summary["best_val_score"]

    @property
    def best_epoch(self) -> int:
        return self.summary["best_epoch"]

    @property
    def test_score(self) -> float:
        """Test accuracy (micro-F1) at the best validation epoch."""
        return self.summary["test_score"]

    @property
    def parts_dir(self) -> Path:
        """The partition set trained on."""
        return self.config.data.parts_dir

    @classmethod
    def read(cls, run_dir: str | os.PathLike) -> Result:
        """The result of the finished run in ``run_dir``."""
        from bnsgcn.run.inference import load_model

        run_dir = Path(run_dir)
        model, config = load_model(run_dir)
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        summary = next((line for line in reversed(lines) if line.get("summary")), {})
        return cls(model, config, [line for line in lines if not line.get("summary")], summary, run_dir)

    def logits(self) -> torch.Tensor:
        """The model's logits over every node of the partition set's graph, float32 [N, C] in
        the graph's node order, computed in this process (the whole graph must fit in it)."""
        from bnsgcn.run.inference import read_whole_graph, whole_graph_logits

        if self._graph is None:
            self._graph = read_whole_graph(self.parts_dir)
        return whole_graph_logits(self.model, self.config, self._graph)


def train(
    parts: str | os.PathLike | None = None,
    config: TrainConfig | None = None,
    *,
    procs: int | None = None,
    gpus: int | None = None,
    **settings,
) -> Result:
    """Train on the partition set ``parts`` (a directory, or what ``bnsgcn.partition`` returned)
    with one rank per partition on this machine, and return the :class:`Result`.

    ``settings`` are ``bnsgcn-train``'s training flags by their names with underscores
    (``epochs=50, p=0.1, model="gcn", eval_every=5``; docs/cli.md lists them), applied on top
    of ``config`` (a :class:`~bnsgcn.config.TrainConfig`, default: every default). ``procs``
    starts that many CPU ranks, ``gpus`` that many GPU ranks (``ranks_per_gpu=K``: K on
    each of them); neither: one rank per partition, on GPUs when there are enough. Without ``out`` the run goes to a new
    ``runs/<timestamp>``. The ranks' output is forwarded to this process's stdout/stderr.
    ``model`` may be a model class of your own (defined in a module the ranks can import)
    and ``model_options`` a dict of its keyword arguments (docs/api.md, "Your own model").

    Raises :class:`UserError` with the command's one-line message for bad input found before
    any rank starts (an unknown setting is also a ``TypeError``), :class:`RankFailed` when a
    rank fails, and lets Ctrl-C through as KeyboardInterrupt once every rank has stopped.
    """
    if config is not None and not isinstance(config, TrainConfig):
        raise UserError(f"config is {type(config).__name__}; pass a bnsgcn.TrainConfig or settings by name")
    config = _named_model((config or TrainConfig()).replace(**settings))
    if parts is not None:
        config = config.replace(parts_dir=Path(os.fspath(parts)).expanduser())
    launch = [f"--{name}={value}" for name, value in (("procs", procs), ("gpus", gpus)) if value is not None]
    while True:
        # without --out, the run directory is named here: it must be known to read it back
        named = config if config.run.out is not None else config.replace(out=new_run_dir(_launch_record()))
        argv = to_argv(named) + launch
        parser = build_parser()
        parser.raises = True  # the command's one-line message, raised instead of printed with exit status 2
        children = prepare_local_ranks(parser.parse_args(argv), argv)
        if named is config:
            break
        try:  # created only now, when no check failed; taken meanwhile (a call in the same second): name another
            named.run.out.mkdir(parents=True)
            break
        except FileExistsError:
            continue
    raise_for_outcome(supervise_outcome(children))
    return Result.read(named.run.out)


def raise_for_outcome(outcome: Outcome) -> None:
    """Once the ranks are done: let an interrupting signal through to the caller, or raise
    :class:`RankFailed` for a failed rank."""
    if outcome.signum is not None:
        # every rank has stopped: the signal now does what it would have done to the caller
        signal.raise_signal(outcome.signum)
        raise KeyboardInterrupt(outcome.message)
    if outcome.status:
        raise RankFailed(outcome.message, outcome.status)


def _named_model(config: TrainConfig) -> TrainConfig:
    """``config`` with ``model`` given as a class named ``module.path:ClassName`` and
    ``model_options`` given as a dict written as JSON: what the command takes (the ranks
    import the class by that name)."""
    model, options = config.model.name, config.model.options
    if isinstance(model, type):
        if model.__module__ == "__main__" or "<locals>" in model.__qualname__:
            where = "inside a function" if "<locals>" in model.__qualname__ else "in __main__ (a script or a notebook)"
            raise UserError(
                f"model={model.__qualname__} is defined {where}, where the ranks cannot import it; define it in a "
                "module of its own (e.g. my_model.py beside the script) and import it from there"
            )
        model = f"{model.__module__}:{model.__qualname__}"
    elif not isinstance(model, str):
        raise UserError(f"model is a {type(model).__name__} object; pass a class (model=MyGNN) or a name (model='gcn')")
    if isinstance(options, dict):
        try:
            options = json.dumps(options)
        except (TypeError, ValueError) as exc:
            raise UserError(f"model_options cannot be written as JSON ({exc}); pass numbers, strings, lists and dicts")
    return config.replace(model=model, model_options=options)


def _launch_record() -> dict:
    """What the run's name records of this launch, as ``bnsgcn-train`` on one machine records it."""
    return launch_record("local", os.environ, None)
