"""CheckpointManager: atomic saves, the latest pointer, retention and resume lookup (no Ray needed)."""

import os

import pytest

from hybridflow.trainer.checkpoint import CheckpointManager, load_trainer_state


def _writer(tag):
    def write(path):
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "shard.txt"), "w") as f:
            f.write(tag)
    return write


def test_save_points_to_latest_and_prunes(tmp_path):
    ckpt = CheckpointManager(str(tmp_path), max_to_keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, {"actor": _writer(f"a{step}")}, {"global_step": step})
    assert ckpt.steps() == [2, 3]
    assert ckpt.resolve("auto") == str(tmp_path / "global_step_3")
    assert load_trainer_state(ckpt.latest())["global_step"] == 3
    assert ckpt.resolve("disable") is None
    assert ckpt.resolve(str(tmp_path / "global_step_2")) == str(tmp_path / "global_step_2")


def test_crash_during_save_keeps_previous_checkpoint(tmp_path):
    ckpt = CheckpointManager(str(tmp_path))
    ckpt.save(1, {"actor": _writer("good"), "critic": _writer("good")}, {"global_step": 1})

    def crash(path):
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "partial"), "w") as f:
            f.write("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ckpt.save(2, {"actor": _writer("new"), "critic": crash}, {"global_step": 2})
    # the pointer and the previous checkpoint are untouched; the half-written one is not a checkpoint
    assert ckpt.steps() == [1]
    assert ckpt.resolve("auto") == str(tmp_path / "global_step_1")
    with open(tmp_path / "global_step_1" / "actor" / "shard.txt") as f:
        assert f.read() == "good"
    # the next save cleans the leftover temporary directory
    ckpt.save(2, {"actor": _writer("new")}, {"global_step": 2})
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp_")]
    assert ckpt.steps() == [1, 2]


def test_explicit_path_must_be_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such path"):
        CheckpointManager(str(tmp_path)).resolve(str(tmp_path / "nope"))
    (tmp_path / "not_a_ckpt").mkdir()
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        CheckpointManager(str(tmp_path)).resolve(str(tmp_path / "not_a_ckpt"))
    assert CheckpointManager(str(tmp_path)).resolve("auto") is None
