"""A worker process killed in the middle of training: the driver stops with an error naming the role and the
rank within 60 s (no hang), shuts down the Ray cluster it started, and the last checkpoint stays usable."""

import os
import subprocess
import sys
import time

import psutil
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from hybridflow.trainer.checkpoint import CheckpointManager, load_trainer_state

pytestmark = pytest.mark.slow


def _worker_pids(role_class: str) -> list[int]:
    pids = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if cmd.startswith(f"ray::{role_class}"):
            pids.append(proc.pid)
    return sorted(pids)


def test_killed_worker_fails_fast_and_keeps_checkpoint(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "hybridflow", "train", "quickstart", "trainer.total_training_steps=500",
           "trainer.save_freq=1", "trainer.test_freq=-1", "trainer.val_before_train=false",
           "trainer.logger=[jsonl]", f"trainer.default_local_dir={out}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 240
        while not (out / "global_step_2" / "trainer_state.pt").exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "no checkpoint within 240 s"
            time.sleep(0.5)
        pids = _worker_pids("ActorRolloutRefWorker")
        assert len(pids) == 2, pids
        os.kill(pids[1], 9)
        killed_at = time.time()
        output, _ = proc.communicate(timeout=60)
        elapsed = time.time() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert elapsed < 60
    assert "worker group 'actor'" in output and "rank" in output, output[-3000:]
    # Ray was shut down: its worker processes exit within seconds (they may lag the driver's exit a little)
    deadline = time.time() + 30
    while (_worker_pids("ActorRolloutRefWorker") or _worker_pids("CriticWorker")) and time.time() < deadline:
        time.sleep(0.5)
    assert not _worker_pids("ActorRolloutRefWorker") and not _worker_pids("CriticWorker")
    # the newest complete checkpoint is intact and loadable
    latest = CheckpointManager(str(out)).resolve("auto")
    step = load_trainer_state(latest)["global_step"]
    assert step >= 2
    dcp_to_torch_save(os.path.join(latest, "actor"), str(tmp_path / "actor.pt"))
    weights = torch.load(tmp_path / "actor.pt", weights_only=False)["model"]
    assert all(torch.isfinite(t).all() for t in weights.values())
