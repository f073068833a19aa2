"""How this job was started, as the launcher tells the engine (which never imports it).

The launcher exports :data:`LAUNCH_VARIABLE` as a JSON object ``{"mode", "job_id",
"nodes"}`` to every rank: ``mode`` is ``local`` (``bnsgcn-train`` started the ranks,
possibly one launcher per node under ``srun``), ``torchrun`` or ``slurm`` (one ``srun``
task per rank); ``job_id`` is SLURM's job id (or torchrun's run id), ``nodes`` the hosts
of the job where known. The run directory's name, config.json and report.json record it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path

LAUNCH_VARIABLE = "BNSGCN_LAUNCH"
RUNS_ROOT = Path("runs")  # where runs without --out go
UNKNOWN = {"mode": None, "job_id": None, "nodes": None}


def launch_info(environ: Mapping[str, str] | None = None) -> dict:
    """The launch record of this rank; every field None when the engine runs without the
    launcher (e.g. ``bnsgcn.run.train.run`` called from Python)."""
    environ = os.environ if environ is None else environ
    text = environ.get(LAUNCH_VARIABLE)
    if not text:
        return dict(UNKNOWN)
    record = json.loads(text)  # written by the launcher: malformed JSON is a bug, with its traceback
    return {key: record.get(key) for key in UNKNOWN}


def run_name_suffix(info: Mapping[str, object]) -> str:
    """What a new run directory's name adds to its timestamp: ``-<mode>-<job id>`` when the
    job has an id (two jobs started in the same second stay apart and findable), else ""."""
    job_id = info.get("job_id")
    if not job_id or job_id == "none":  # torchrun --standalone's run id is "none"
        return ""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", str(job_id))
    return f"-{info.get('mode') or 'job'}-{safe}"


def new_run_dir(info: Mapping[str, object]) -> Path:
    """The directory of a run without ``--out``: ``runs/<timestamp><suffix>``
    (:func:`run_name_suffix` of the launch record ``info``), ``.1``, ``.2``, ... appended
    while the name is taken. Not created."""
    run_dir = RUNS_ROOT / (datetime.now().strftime("%Y%m%d-%H%M%S") + run_name_suffix(info))
    suffix = 1
    while run_dir.exists():
        run_dir = run_dir.with_name(f"{run_dir.name.split('.')[0]}.{suffix}")
        suffix += 1
    return run_dir
