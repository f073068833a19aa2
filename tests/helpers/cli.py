"""The command-line tools run as a user runs them (a fresh process, the environment of no
enclosing launch), and checks of what a failed run says and leaves."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from . import REPO, kernels

PARTITION = [sys.executable, "-m", "bnsgcn.partition.cli"]
TRAIN = [sys.executable, "-m", "bnsgcn.launch.cli"]
# Tiny model, few epochs: every run here is about the checks around training.
SMALL_RUN = [
    "--layers",
    "2",
    "--hidden",
    "8",
    "--epochs",
    "2",
    "--eval-every",
    "1",
    "--threads",
    "1",
    "--timeout",
    "60",
]
CLI_TIMEOUT_S = 240  # generous on a loaded machine; a hang still fails the test
# Variables that would switch bnsgcn-train into one-rank mode (torchrun / srun).
RANK_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "TORCHELASTIC_RESTART_COUNT",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_STEP_ID",
)
# Variables of an enclosing launch that must not leak into the jobs started by a test.
LAUNCH_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "BNSGCN_LAUNCH",
)


@dataclass(frozen=True)
class Outcome:
    """Exit status and output of one CLI run."""

    code: int
    stdout: str
    stderr: str

    @property
    def last_line(self) -> str:
        lines = self.stderr.strip().splitlines()
        return lines[-1] if lines else ""


def run_cli(command: list[str], args: list[str], cwd: Path) -> Outcome:
    if command == TRAIN:
        kernels.compiled()
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    done = subprocess.run([*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    return Outcome(done.returncode, done.stdout, done.stderr)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without an enclosing launch's or SLURM's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES and not k.startswith("SLURM_")}
    return env | extra


def assert_user_error(outcome: Outcome, *keywords: str) -> None:
    """Exit 2, one ``error:`` line naming the problem last, no traceback."""
    assert outcome.code == 2, outcome.stderr
    assert outcome.last_line.startswith("error: "), outcome.stderr
    for keyword in keywords:
        assert keyword in outcome.last_line, (keyword, outcome.last_line)
    assert "Traceback" not in outcome.stderr, outcome.stderr


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (all small here), by relative path."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def assert_kept(before: dict[str, bytes], directory: Path) -> None:
    """``directory`` holds the same files with the same bytes as in ``before``; only a
    run's ``log.txt`` may have grown (a failed attempt may log, never rewrite)."""
    after = snapshot(directory)
    assert sorted(after) == sorted(before)
    for name, content in before.items():
        if Path(name).name == "log.txt":
            assert after[name].startswith(content), name
        else:
            assert after[name] == content, name


def train_on(parts_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    """bnsgcn-train arguments: 2 ranks on ``parts_dir`` into ``run_dir``, the small run, ``extra``."""
    return ["--procs", "2", "--parts-dir", str(parts_dir), "--out", str(run_dir), *SMALL_RUN, *extra]


def train_without_numba(args: list[str], cwd: Path, kernels: str) -> Outcome:
    """bnsgcn-train ``args`` with ``BNSGCN_KERNELS=kernels`` where any import of numba, in
    any process of the job, fails."""
    blocker = cwd / "numba-blocker"
    blocker.mkdir()
    (blocker / "numba.py").write_text("raise ImportError('numba imported by a job on the torch kernels')\n")
    env = clean_env(BNSGCN_KERNELS=kernels, PYTHONPATH=os.pathsep.join([str(blocker), str(REPO)]))
    done = subprocess.run([*TRAIN, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    return Outcome(done.returncode, done.stdout, done.stderr)
