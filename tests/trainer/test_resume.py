"""Exact resume: 3 uninterrupted steps == 1 step + resume + 1 step + resume + 1 step (the first resume is
mid-epoch, the second at an epoch boundary): identical metrics and bit-identical final weights.

The earlier version ran 4 == 1 + 1 + 2; the fourth step came after the last resume's first step and restored
nothing that step had not, so 3 == 1 + 1 + 1 tests both resumes with 6 training steps instead of 8."""

import json

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from hybridflow.config import load_config
from hybridflow.trainer.main import run_ppo

pytestmark = pytest.mark.slow

# 16 prompts / 8 per step = 2 steps per epoch; checkpoint every step
COMMON = [
    "data.builtin_train_size=16", "data.train_batch_size=8", "data.builtin_val_size=8", "data.shuffle=true",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "critic.ppo_mini_batch_size=4", "critic.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.shuffle=true",
    "trainer.test_freq=2", "trainer.save_freq=1", "trainer.logger=[jsonl]", "algorithm.kl_ctrl.type=adaptive",
]
VOLATILE = ("timing", "perf/throughput", "timestamp")


def _run(out, steps):
    run_ppo(load_config("quickstart", COMMON + [f"trainer.default_local_dir={out}",
                                                f"trainer.total_training_steps={steps}"]))


def _metrics(out):
    rows = {}
    with open(out / "metrics.jsonl") as f:
        for line in f:
            row = json.loads(line)
            rows.setdefault(row["step"], {}).update(
                {k: v for k, v in row.items() if not k.startswith(VOLATILE)})
    return rows


def _weights(ckpt_dir, tmp_path, name):
    target = tmp_path / f"{name}.pt"
    dcp_to_torch_save(str(ckpt_dir), str(target))
    return torch.load(target, weights_only=False)


def test_resume_is_exact(tmp_path, ray_session):
    full, parts = tmp_path / "full", tmp_path / "parts"
    _run(full, 3)
    for steps in (1, 2, 3):  # resume at step 1 (mid-epoch) and at step 2 (epoch boundary)
        _run(parts, steps)
    a, b = _metrics(full), _metrics(parts)
    assert sorted(a) == sorted(b) == [0, 1, 2, 3]
    for step in a:
        # the partial runs also validate at their last step (1); compare validation where both ran it
        same_keys = [k for k in a[step] if not k.startswith("val/")] if step == 1 else list(a[step])
        assert {k: a[step][k] for k in same_keys} == {k: b[step].get(k) for k in same_keys}, f"step {step}"
    for role in ("actor", "critic"):
        wa = _weights(full / "global_step_3" / role, tmp_path, f"a_{role}")
        wb = _weights(parts / "global_step_3" / role, tmp_path, f"b_{role}")
        assert wa["model"].keys() == wb["model"].keys()
        for key in wa["model"]:
            assert torch.equal(wa["model"][key], wb["model"][key]), f"{role} {key}"
        start = _weights(full / "global_step_1" / role, tmp_path, f"s_{role}")
        assert any(not torch.equal(start["model"][k], wa["model"][k]) for k in wa["model"])  # it trained
