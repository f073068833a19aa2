"""``bnsgcn-predict RUN_DIR``: a finished run's model over every node of its partition set,
and ``bnsgcn.predict(run_dir)``, the same from Python.

The ranks start as training's do (:func:`~bnsgcn.launch.cli.prepare_local_ranks`, the run's
own settings as flags, every check before any rank starts); each runs
``python -m bnsgcn.launch.predict --rank <request> <training flags>``
(:func:`bnsgcn.run.predict.run`), and rank 0 writes the file (formats: docs/cli.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from bnsgcn.cli import Parser
from bnsgcn.config import from_args, to_argv

from .api import raise_for_outcome
from .cli import build_parser, prepare_local_ranks
from .rank import die_with_launcher, exit_rank, rank_from_environment, report_errors, training_parser
from .supervisor import Child, supervise, supervise_outcome

if TYPE_CHECKING:
    import torch

    from bnsgcn.run.predict import PredictRequest

PROG = "bnsgcn-predict"
RANK_FLAG = "--rank"  # first argument of a rank process: the request (JSON) follows, then the training flags


def build_predict_parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description="Write a trained run's predictions for every node. See docs/cli.md.")
    parser.add_argument(
        "run_dir", type=Path, metavar="RUN_DIR", help="the run directory of a finished bnsgcn-train run"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="FILE",
        help="where to write: a .pt (dict of tensors) or .npy file (default RUN_DIR/predictions.pt)",
    )
    parser.add_argument(
        "--embeddings",
        type=int,
        default=None,
        metavar="LAYER",
        help="write the output of layer LAYER (0-based) instead of the logits and predictions",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--gpus", type=int, metavar="N", help="start N ranks on this machine, one CUDA GPU each")
    where.add_argument("--procs", type=int, metavar="N", help="start N ranks on this machine, on CPU")
    parser.add_argument(
        "--ranks-per-gpu",
        type=int,
        default=1,
        metavar="K",
        help="with --gpus N: N x K ranks, K sharing each GPU (gloo) (default 1)",
    )
    parser.add_argument(
        "--parts-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="the partition set (default: the one the run trained on, as config.json names it)",
    )
    return parser


def prepare(
    run_dir: Path,
    out: Path | None,
    embeddings: int | None,
    parts_dir: Path | None,
    procs: int | None,
    gpus: int | None,
    ranks_per_gpu: int = 1,
) -> tuple[list[Child], PredictRequest]:
    """The ranks to start for a prediction, every check done first."""
    from bnsgcn.run.predict import check_request

    config, request = check_request(run_dir, out, embeddings, parts_dir)
    # the ranks and their device and threads are this machine's, as for a new training run
    config = config.replace(device="auto", ranks_per_gpu=ranks_per_gpu, threads=None, resume=False)
    launch = [f"--{name}={value}" for name, value in (("procs", procs), ("gpus", gpus)) if value is not None]
    argv = to_argv(config) + launch
    parser = build_parser()
    parser.raises = True  # the one-line message, raised
    children = prepare_local_ranks(parser.parse_args(argv), argv, prog=PROG)
    rank = [sys.executable, "-m", "bnsgcn.launch.predict", RANK_FLAG, request.to_json()]
    # a training rank's command line is [python, -m, bnsgcn.launch.rank, *its flags]
    return [dataclasses.replace(child, argv=rank + list(child.argv[3:])) for child in children], request


def predict(
    run_dir: str | os.PathLike,
    out: str | os.PathLike | None = None,
    embeddings: int | None = None,
    *,
    procs: int | None = None,
    gpus: int | None = None,
    ranks_per_gpu: int = 1,
    parts_dir: str | os.PathLike | None = None,
) -> dict[str, torch.Tensor]:
    """``bnsgcn-predict`` from Python: write the predictions of the run in ``run_dir`` to ``out``
    (default ``run_dir/predictions.pt``) and return what was written, as the ``.pt`` dict
    holds it: ``node_ids`` and ``logits`` and ``predictions``, or ``embeddings`` (layer
    ``embeddings``, 0-based). ``procs``, ``gpus`` and ``ranks_per_gpu`` start the ranks as
    :func:`bnsgcn.train`'s do. Raises :class:`UserError` for bad input and
    :class:`~bnsgcn.launch.api.RankFailed` when a rank fails."""
    from bnsgcn.run.predict import read

    children, request = prepare(
        Path(run_dir),
        None if out is None else Path(out),
        embeddings,
        None if parts_dir is None else Path(parts_dir),
        procs,
        gpus,
        ranks_per_gpu,
    )
    raise_for_outcome(supervise_outcome(children))
    return read(request.out, embeddings is not None)


def _rank(argv: Sequence[str]) -> NoReturn:
    """One rank: ``argv`` is the request (JSON) and the training flags."""
    die_with_launcher()
    from bnsgcn.run.predict import PredictRequest, run

    request = PredictRequest.from_json(argv[0])
    args = training_parser("python -m bnsgcn.launch.predict", "One rank of bnsgcn-predict.").parse_args(argv[1:])

    def work() -> int:
        run(from_args(args), request)
        return 0

    exit_rank(report_errors(work, rank=rank_from_environment(), debug=args.debug))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [RANK_FLAG]:
        _rank(argv[1:])
    args = build_predict_parser().parse_args(argv)

    def launch() -> int:
        children, request = prepare(
            args.run_dir, args.out, args.embeddings, args.parts_dir, args.procs, args.gpus, args.ranks_per_gpu
        )
        status = supervise(children)
        if status == 0:
            print(f"{PROG}: wrote {request.out}", flush=True)
        return status

    return report_errors(launch, rank=None, debug=False)


def entry() -> NoReturn:
    """The ``bnsgcn-predict`` command."""
    exit_rank(main())


if __name__ == "__main__":
    entry()
