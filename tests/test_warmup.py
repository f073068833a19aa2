"""The CPU kernels are compiled before the ranks load anything (bnsgcn.kernels.warmup):

* every kernel signature a training rank calls (each model, sampled and full boundary,
  layer norm, dropout, --remat, compressed rows, evaluation) is one the warm-up compiles;
* a job that finds no stamp compiles first, in a process of its own (one line from one
  rank), and leaves the stamp; the next job finds it and starts no such process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bnsgcn.config import TrainConfig

from .helpers import kernels
from .helpers.cli import RANK_VARIABLES, TRAIN
from .helpers.graphs import partition, random_graph
from .helpers.ranks import run_ranks

REPO = Path(__file__).resolve().parents[1]


def kernel_signatures() -> dict[str, list[str]]:
    """Every numba dispatcher of the numba backend and the signatures this process has
    compiled or loaded for it."""
    from numba.core.registry import CPUDispatcher

    from bnsgcn.kernels import numba_backend

    found = {}
    for name, value in vars(numba_backend).items():
        dispatcher = getattr(value, "kernel", value)
        if isinstance(dispatcher, CPUDispatcher):
            found[name] = sorted(str(signature) for signature in dispatcher.signatures)
    return found


def collect_signatures():
    """``run_ranks`` instrument: the signatures after the run."""
    return kernel_signatures


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    return partition(
        random_graph(num_nodes=80, avg_degree=6, features=8, seed=5), 2, tmp_path_factory.mktemp("warmup") / "parts"
    )


def test_the_warm_up_compiles_every_kernel_signature_training_calls(parts, tmp_path):
    configs = [
        TrainConfig.from_settings(
            parts_dir=parts,
            model=model,
            p=p,
            norm=norm,
            remat=remat,
            compress=compress,
            layers=3,
            hidden=8,
            heads=2,
            dropout=0.5,
            epochs=2,
            eval_every=1,
            seed=0,
            device="cpu",
            out=tmp_path / f"run{i}",
        )
        for i, (model, p, norm, remat, compress) in enumerate(
            [
                ("graphsage", 0.5, "layer", True, "int8"),
                ("gcn", 1.0, "none", False, "int4"),
                ("gat", 0.5, "layer", True, "none"),
            ]
        )
    ]
    results = run_ranks(2, configs, instrument=collect_signatures)
    used = {}
    for rank in results:
        for name, signatures in rank[-1]["instrumented"].items():
            used.setdefault(name, set()).update(signatures)
    script = (
        "import json, torch; from bnsgcn.kernels import warmup; from tests.test_warmup import "
        "kernel_signatures; warmup.exercise(); print(json.dumps(kernel_signatures()))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600, check=True
    )
    warmed = json.loads(done.stdout.strip().splitlines()[-1])
    assert sum(map(len, used.values())) >= 8, used  # the instrument saw the training's kernels
    missing = {name: sorted(set(signatures) - set(warmed.get(name, []))) for name, signatures in used.items()}
    assert not any(missing.values()), f"training called kernels the warm-up does not compile: {missing}"


def test_a_job_without_the_stamp_compiles_in_one_process_first_and_the_next_job_not_at_all(parts, tmp_path):
    from bnsgcn.kernels import warmup

    kernels.compiled()  # the shared cache holds every kernel, to be copied below

    shared = warmup.stamp_path()
    assert shared is not None, "numba has no writable cache directory here"
    # The jobs get a cache of their own, holding the kernels but not the stamp (as after an
    # upgrade): jobs of other tests running meanwhile (pytest-xdist) would write the stamp
    # into the shared one.
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES and k != "BNSGCN_KERNELS"} | {
        "NUMBA_CACHE_DIR": str(tmp_path / "numba")
    }
    where = subprocess.run(
        [sys.executable, "-c", "from bnsgcn.kernels import warmup; print(warmup.stamp_path())"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    stamp = Path(where.stdout.strip().splitlines()[-1])
    assert stamp.parent != shared.parent
    stamp.parent.mkdir(parents=True, exist_ok=True)
    for cached in shared.parent.glob("*.nb[ic]"):
        shutil.copy2(cached, stamp.parent / cached.name)
    argv = [
        *TRAIN,
        "--procs",
        "2",
        "--parts-dir",
        str(parts),
        "--threads",
        "1",
        "--epochs",
        "1",
        "--model",
        "gcn",
        "--layers",
        "2",
        "--hidden",
        "8",
        "--p",
        "0.5",
    ]
    first = subprocess.run(
        [*argv, "--out", str(tmp_path / "first")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert first.returncode == 0, first.stderr[-3000:]
    compiled = [line for line in first.stderr.splitlines() if "compiling the CPU kernels" in line and "done in" in line]
    assert len(compiled) == 1 and compiled[0].startswith("[rank 0]"), first.stderr[-3000:]
    assert stamp.exists()
    second = subprocess.run(
        [*argv, "--out", str(tmp_path / "second")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "compiling the CPU kernels" not in second.stderr, second.stderr[-3000:]


def test_a_failed_warm_up_is_one_line_naming_the_command_to_rerun(monkeypatch, tmp_path):
    from bnsgcn.run import train

    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'ImportError: no module named numba' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setattr(train.sys, "executable", str(broken))
    message = train._run_warmup(0)
    assert (
        message == "compiling the CPU kernels failed (ImportError: no module named numba); run python -m "
        "bnsgcn.kernels.warmup to see the error, or set BNSGCN_KERNELS=torch"
    )
