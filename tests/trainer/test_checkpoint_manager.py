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


def _read(path):
    with open(path) as f:
        return f.read()


def test_keep_one_and_a_failing_save_keeps_the_previous_checkpoint(tmp_path):
    ckpt = CheckpointManager(str(tmp_path), max_to_keep=1)
    ckpt.save(1, {"actor": _writer("one")}, {"global_step": 1})
    ckpt.save(2, {"actor": _writer("two")}, {"global_step": 2})
    assert ckpt.steps() == [2]

    def full_disk(path):
        os.makedirs(path, exist_ok=True)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        ckpt.save(3, {"actor": _writer("three"), "critic": full_disk}, {"global_step": 3})
    assert ckpt.steps() == [2] and ckpt.latest() == str(tmp_path / "global_step_2")
    assert _read(tmp_path / "global_step_2" / "actor" / "shard.txt") == "two"


def test_retention_applies_after_a_resume(tmp_path):
    # a first run kept everything; the resumed run (a new manager, as after a restart) with a limit of 2 prunes
    # what the first run left
    first = CheckpointManager(str(tmp_path))
    for step in (1, 2, 3):
        first.save(step, {"actor": _writer(f"a{step}")}, {"global_step": step})
    resumed = CheckpointManager(str(tmp_path), max_to_keep=2)
    resumed.save(4, {"actor": _writer("a4")}, {"global_step": 4})
    assert resumed.steps() == [3, 4]


def test_retention_never_removes_the_checkpoint_just_written(tmp_path):
    # a run restarted from scratch (resume_mode=disable) into a directory holding steps 1..4 of an older run: its
    # step-2 checkpoint is the newest, whatever the step numbers of the older run say
    old = CheckpointManager(str(tmp_path))
    for step in (1, 2, 3, 4):
        old.save(step, {"actor": _writer(f"old{step}")}, {"global_step": step})
    ckpt = CheckpointManager(str(tmp_path), max_to_keep=1)
    ckpt.save(2, {"actor": _writer("new2")}, {"global_step": 2})
    assert ckpt.steps() == [2]
    assert ckpt.latest() == str(tmp_path / "global_step_2")
    assert _read(tmp_path / "global_step_2" / "actor" / "shard.txt") == "new2"
    ckpt2 = CheckpointManager(str(tmp_path), max_to_keep=2)
    ckpt2.save(3, {"actor": _writer("new3")}, {"global_step": 3})
    assert ckpt2.steps() == [2, 3]


def test_replacing_a_checkpoint_of_the_same_step_keeps_it_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    ckpt = CheckpointManager(str(tmp_path), max_to_keep=1)
    ckpt.save(2, {"actor": _writer("old")}, {"global_step": 2})
    real_replace = os.replace

    def failing_replace(src, dst):  # the rename of the new checkpoint into place fails (e.g. an I/O error)
        if os.path.basename(src) == ".tmp_global_step_2":
            raise OSError(5, "Input/output error")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="Input/output error"):
        ckpt.save(2, {"actor": _writer("new")}, {"global_step": 2})
    monkeypatch.setattr(os, "replace", real_replace)
    assert ckpt.latest() == str(tmp_path / "global_step_2")
    assert _read(tmp_path / "global_step_2" / "actor" / "shard.txt") == "old"
    ckpt.save(2, {"actor": _writer("new")}, {"global_step": 2})
    assert _read(tmp_path / "global_step_2" / "actor" / "shard.txt") == "new"
    assert sorted(os.listdir(tmp_path)) == ["global_step_2", "latest_checkpointed_iteration.txt"]


def test_an_interrupted_replacement_is_put_back_by_the_next_save(tmp_path):
    # the process died after moving the old step-2 checkpoint aside and before the new one landed
    ckpt = CheckpointManager(str(tmp_path))
    ckpt.save(2, {"actor": _writer("old")}, {"global_step": 2})
    os.replace(tmp_path / "global_step_2", tmp_path / ".tmp_replaced_global_step_2")
    ckpt.save(3, {"actor": _writer("three")}, {"global_step": 3})
    assert ckpt.steps() == [2, 3]
    assert _read(tmp_path / "global_step_2" / "actor" / "shard.txt") == "old"
