"""Resume agrees on every rank: rank 0 chooses the checkpoint, every rank loads that one,
or every rank stops with the same line (one rank never starts over while another resumes)."""

from __future__ import annotations

import pytest
import torch

from bnsgcn.config import TrainConfig
from bnsgcn.errors import UserError
from bnsgcn.exchange import LocalExchange
from bnsgcn.run import checkpoint
from bnsgcn.run.train import _load_checkpoint

SIGNATURE = {"model": "graphsage"}


class _RankOne:
    """Rank 1 of 2: rank 0's broadcast is ``chosen``; the all-gather shows rank 0 fine."""

    rank, world_size = 1, 2

    def __init__(self, chosen):
        self.chosen = chosen

    def broadcast_object(self, obj, src=0):
        return (self.chosen, None)

    def all_gather_object(self, obj):
        return [None, obj]


def _save(run_dir, epoch):
    checkpoint.save(run_dir, epoch, {"model": {}, "optimizer": {}, "best": {}, "signature": SIGNATURE}, keep=5)


def test_every_rank_loads_the_checkpoint_rank_0_chose(tmp_path):
    _save(tmp_path, 2)
    _save(tmp_path, 4)
    assert checkpoint.newest(tmp_path, SIGNATURE)[0].name == "checkpoint-000004.pt"
    # Rank 0 chose epoch 2 (say epoch 4 was still being written when it looked): rank 1,
    # which can read epoch 4, still loads epoch 2.
    chosen = checkpoint.checkpoint_dir(tmp_path) / "checkpoint-000002.pt"
    state, _ = _load_checkpoint(TrainConfig(), _RankOne(chosen), tmp_path, SIGNATURE, exchange=LocalExchange())
    assert state["epoch"] == 2


def test_a_rank_that_cannot_load_the_choice_stops_the_job(tmp_path):
    _save(tmp_path, 2)
    chosen = checkpoint.checkpoint_dir(tmp_path) / "checkpoint-000002.pt"
    chosen.write_bytes(b"torn")  # what rank 1 sees there
    with pytest.raises(
        UserError,
        match=r"^rank 1: .*checkpoint-000002.pt cannot be read here \(it fails its SHA-256 checksum: the file is "
        r"damaged\); every rank must see the same run directory",
    ):
        _load_checkpoint(TrainConfig(), _RankOne(chosen), tmp_path, SIGNATURE, exchange=LocalExchange())
    chosen.unlink()
    with pytest.raises(UserError, match=r"^rank 1: .*checkpoint-000002.pt is missing on this machine"):
        _load_checkpoint(TrainConfig(), _RankOne(chosen), tmp_path, SIGNATURE, exchange=LocalExchange())


def test_newest_skips_a_torn_checkpoint_and_refuses_another_runs(tmp_path):
    _save(tmp_path, 2)
    _save(tmp_path, 4)
    (checkpoint.checkpoint_dir(tmp_path) / "checkpoint-000004.pt").write_bytes(b"torn")
    assert checkpoint.newest(tmp_path, SIGNATURE)[0].name == "checkpoint-000002.pt"
    with pytest.raises(UserError, match="written for a different run \\(model differ\\)"):
        checkpoint.newest(tmp_path, {"model": "gat"})
    assert checkpoint.newest(tmp_path / "elsewhere", SIGNATURE) is None
    path, state = checkpoint.newest(tmp_path, SIGNATURE)
    assert state["epoch"] == 2 and torch.load(path, weights_only=True)["epoch"] == 2
