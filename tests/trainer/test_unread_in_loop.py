"""The train loop reports a worker-group call the driver never read: after the step, and before a checkpoint (which
is then not written). Ray stands in: string refs, a stand-in ``ray.wait`` and fetch."""

import os
import types

import pytest
import torch

from hybridflow.config import load_config
from hybridflow.controller import WorkerError, unread
from hybridflow.controller.futures import DataProtoFuture
from hybridflow.protocol import DataProto
from hybridflow.trainer.driver import Driver
from hybridflow.trainer.loop import TrainLoop


@pytest.fixture
def failed(monkeypatch):
    """The refs whose (finished) call failed; every ref counts as finished."""
    failed = set()

    def get_outputs(refs, ranks, group, method, timeout_s=None):
        for ref, rank in zip(refs, ranks):
            if ref in failed:
                raise WorkerError(group, rank, method, RuntimeError("the update diverged"))
        return [None for _ in refs]

    monkeypatch.setattr(unread.ray, "wait", lambda refs, num_returns=1, timeout=None, fetch_local=True: (refs, []))
    monkeypatch.setattr(unread, "get_outputs", get_outputs)
    monkeypatch.setattr(unread, "_ABANDONED", {})
    monkeypatch.setattr(unread, "_LIVE", unread.weakref.WeakValueDictionary())
    return failed


def update_actor(refs):
    """A tracked ``actor.update_actor`` call whose rank ``i`` answers ``refs[i]``; its future."""
    ranks = list(range(len(refs)))
    return DataProtoFuture(DataProto.concat, refs, source=("actor", "update_actor", ranks),
                           call=unread.track(refs, ranks, "actor", "update_actor"))


class DroppingDriver(Driver):
    """Calls ``update_actor`` every step and never reads it; step 2's fails on rank 1."""

    def __init__(self, failed):
        self.failed, self.steps = failed, []

    def step(self, batch):
        self.steps.append(self.global_step)
        refs = [f"s{self.global_step}r0", f"s{self.global_step}r1"]
        if self.global_step == 2:
            self.failed.add(refs[1])
        update_actor(refs)  # not read
        return {}


def batches(position):
    while True:
        yield DataProto.from_dict({"x": torch.zeros(2)})


class SavesActor(Driver):
    """A driver that checkpoints one group named ``actor`` (a stand-in: the loop only reads its name first)."""

    def checkpointed_groups(self):
        return {"actor": types.SimpleNamespace(name="actor", save_checkpoint=None)}


def test_a_checkpoint_is_not_written_after_an_unread_failed_update(tmp_path, failed):
    cfg = load_config("quickstart", [f"trainer.default_local_dir={tmp_path}"])
    loop = TrainLoop(cfg, SavesActor())
    held = update_actor(["a0", "a1"])  # held, unread: the blocking check before the save checks it too
    failed.add("a0")
    ahead = DataProtoFuture(DataProto.concat, ["g0"], source=("generator", "generate_sequences", [0]),
                            call=unread.track(["g0"], [0], "generator", "generate_sequences"))
    failed.add("g0")  # a group the checkpoint does not save: not waited for (a look-ahead generation)
    loop.global_step = 3
    with pytest.raises(WorkerError, match=r"worker group 'actor': rank 0 failed in update_actor\(\)"):
        loop.save_checkpoint()
    assert os.listdir(tmp_path) == []
    assert [r.group for r in unread.unread_calls(include_live=True)] == ["generator"]  # left for its reader
    del held, ahead


def test_fit_stops_after_the_step_whose_unread_update_failed(tmp_path, failed):
    cfg = load_config("quickstart", [f"trainer.default_local_dir={tmp_path}", "trainer.save_freq=2",
                                     "trainer.test_freq=-1", "trainer.val_before_train=False"])
    driver = DroppingDriver(failed)
    with pytest.raises(WorkerError, match=r"worker group 'actor': rank 1 failed in update_actor\(\)") as caught:
        TrainLoop(cfg, driver).fit(batches, None, total_steps=4)
    assert (caught.value.rank, driver.steps) == (1, [1, 2])  # raised after step 2, before its checkpoint
    assert os.listdir(tmp_path) == []
