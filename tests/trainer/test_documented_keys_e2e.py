"""The documented keys act in a real run (2-rank Ray worker groups): a user ``reward_model.compute_score`` scores
every response, ``trainer.device=cpu`` runs and ``trainer.device=cuda`` without GPUs stops before any worker
starts, and a run with the critic's offload switched on trains and checkpoints (on CPU offload moves nothing)."""

import json

import pytest

from hybridflow.config import load_config
from hybridflow.errors import UserError
from hybridflow.trainer.main import run_ppo

pytestmark = pytest.mark.slow

QUICK = ["trainer.total_training_steps=1", "trainer.test_freq=-1", "trainer.val_before_train=false",
         "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2",
         "trainer.logger=[jsonl]"]

# 0.25 for every response of the built-in task: a value the built-in GSM8K-style reward (0 or 1) never gives
USER_REWARD = '''
def quarter(data_source, solution_str, ground_truth, extra_info=None):
    assert data_source == "hybridflow/arith" and isinstance(solution_str, str) and ground_truth
    return 0.25
'''


def test_user_reward_cpu_device_and_critic_offload(tmp_path, ray_session):
    (tmp_path / "reward.py").write_text(USER_REWARD)
    out = tmp_path / "run"
    run_ppo(load_config("quickstart", QUICK + [
        f"trainer.default_local_dir={out}", f"reward_model.compute_score={tmp_path / 'reward.py'}:quarter",
        "trainer.device=cpu", "critic.fsdp_config.param_offload=true", "critic.fsdp_config.optimizer_offload=true",
        "trainer.save_freq=1"]))
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["critic/score/mean"] == row["critic/score/max"] == row["critic/score/min"] == 0.25
    assert (out / "global_step_1" / "critic").is_dir()


def test_cuda_device_without_gpus_stops_before_the_workers(tmp_path, ray_session):
    cfg = load_config("quickstart", QUICK + [f"trainer.default_local_dir={tmp_path}", "trainer.device=cuda"])
    with pytest.raises(UserError, match="trainer.device=cuda, but (the Ray cluster|this machine) has no GPU"):
        run_ppo(cfg)
    assert not (tmp_path / "metrics.jsonl").exists()
