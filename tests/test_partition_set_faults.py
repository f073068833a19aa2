"""Faults while writing a partition set.

What is covered:

* temporary files and directories that never follow a symbolic link planted at their name,
  and are removed when a write fails.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest

from bnsgcn.data.format import MANIFEST_NAME, read_manifest, write_array, write_manifest
from bnsgcn.data.shard import load_shard

from .distributed import partition, random_graph

# --- sets to damage ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def originals(tmp_path_factory) -> dict[str, Path]:
    """Sets of one graph: two of 2 parts (random assignment, seeds 0 and 1: equal part sizes,
    different boundaries) and one of 3 parts."""
    graph = random_graph(num_nodes=120, avg_degree=4, seed=1)
    root = tmp_path_factory.mktemp("originals")
    return {
        "two": partition(graph, 2, root / "two"),
        "other-two": partition(graph, 2, root / "other-two", seed=1),
        "three": partition(graph, 3, root / "three"),
    }


@pytest.fixture
def sets(originals: dict[str, Path], tmp_path: Path) -> dict[str, Path]:
    """Private copies of the original sets, to damage."""
    return {name: Path(shutil.copytree(path, tmp_path / "parts" / name)) for name, path in originals.items()}


# --- temporary files ------------------------------------------------------------------------------


def test_manifest_is_not_written_through_a_planted_symbolic_link(sets, tmp_path):
    base = sets["two"]
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    (base / (MANIFEST_NAME + ".tmp")).symlink_to(victim)  # the temporary name manifests once had
    manifest = read_manifest(base)
    write_manifest(base, {key: value for key, value in manifest.items() if key not in ("format", "version")})
    assert victim.read_text() == "keep me\n"
    assert read_manifest(base) == manifest
    assert sorted(p.name for p in base.iterdir() if p.is_file()) == [MANIFEST_NAME, MANIFEST_NAME + ".tmp"]


def test_array_is_not_written_through_a_planted_symbolic_link(tmp_path):
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"keep me")
    part_dir = tmp_path / "part-0"
    part_dir.mkdir()
    (part_dir / "features.npy").symlink_to(victim)
    features = np.arange(12, dtype=np.float32).reshape(4, 3)
    write_array(part_dir, "features", features)
    assert victim.read_bytes() == b"keep me"
    assert not (part_dir / "features.npy").is_symlink()
    assert np.array_equal(np.load(part_dir / "features.npy"), features)
    assert [p.name for p in part_dir.iterdir()] == ["features.npy"]


def test_temporary_directory_is_not_a_planted_symbolic_link(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    out = tmp_path / "set"
    # the temporary directory's name before it became unpredictable
    (tmp_path / f"set.tmp-{socket.gethostname()}-{os.getpid()}").symlink_to(victim, target_is_directory=True)
    partition(random_graph(num_nodes=40, seed=3), 2, out)
    assert list(victim.iterdir()) == []
    assert out.is_dir() and not out.is_symlink()
    load_shard(out, 0, 2, verify=True)


def test_failed_array_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError, match=re.escape(str(tmp_path / "degree.npy"))) as caught:
        write_array(tmp_path, "degree", np.ones(10, dtype=np.float32))
    monkeypatch.undo()
    assert caught.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []
