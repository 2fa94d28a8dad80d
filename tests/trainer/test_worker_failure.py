"""A worker process killed in the middle of training: the driver stops with an error naming the role and the
rank within 60 s (no hang), shuts down the Ray cluster it started, and the last checkpoint stays usable.

The quickstart's roles run colocated (``trainer.colocate_roles``): the killed process hosts the actor, the critic
and the rule reward of its rank, so the error names whichever of those groups the driver was waiting for."""

import os
import re
import subprocess
import sys
import time

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from helpers.ray_procs import role_pids, running
from hybridflow.trainer.checkpoint import CheckpointManager, load_trainer_state

pytestmark = pytest.mark.slow


# 8 prompts a step instead of the recipe's 32: the steps before the kill only have to make checkpoints
SMALL = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2"]


def test_killed_worker_fails_fast_and_keeps_checkpoint(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "hybridflow", "train", "quickstart", "trainer.total_training_steps=500",
           "trainer.save_freq=1", "trainer.test_freq=-1", "trainer.val_before_train=false",
           "trainer.logger=[jsonl]", f"trainer.default_local_dir={out}", *SMALL]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 240
        while not (out / "global_step_2" / "trainer_state.pt").exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "no checkpoint within 240 s"
            time.sleep(0.5)
        pids = role_pids(proc.pid, "ActorRolloutRefWorker")  # this run's, not another's on the machine
        assert len(pids) == 2, pids
        assert role_pids(proc.pid, "CriticWorker") == pids  # colocated: the same process per rank
        assert role_pids(proc.pid, "RuleRewardWorker") == pids
        workers = pids
        os.kill(pids[1], 9)
        killed_at = time.time()
        output, _ = proc.communicate(timeout=60)
        elapsed = time.time() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert elapsed < 60
    # the process of rank 1 held the actor, critic and reward of rank 1: the error names one of those groups and a
    # rank; rank 0 may be the one named, when its process died first in a collective with the killed rank
    assert re.search(r"worker group '(actor|critic|reward)': rank [01] failed", output), output[-3000:]
    # Ray was shut down: the run's worker processes exit within seconds (they may lag the driver's exit a little)
    deadline = time.time() + 30
    while running(workers) and time.time() < deadline:
        time.sleep(0.5)
    assert not running(workers)
    # the newest complete checkpoint is intact and loadable
    latest = CheckpointManager(str(out)).resolve("auto")
    step = load_trainer_state(latest)["global_step"]
    assert step >= 2
    dcp_to_torch_save(os.path.join(latest, "actor"), str(tmp_path / "actor.pt"))
    weights = torch.load(tmp_path / "actor.pt", weights_only=False)["model"]
    assert all(torch.isfinite(t).all() for t in weights.values())
