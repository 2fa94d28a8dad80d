"""End to end through Ray: PPO steps where the actor trains in one layout and generates in another (2 ranks): tp=2
(FSDP2 shards), dp=2 replicated (``fsdp_size`` auto picks it for the tiny model) and dp=2 sharded (``-1``)."""

import json

import pytest

from hybridflow.config import load_config
from hybridflow.trainer.main import run_ppo

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("tp,tp_g,fsdp_size", [(2, 1, "auto"), (1, 2, "auto"), (1, 2, -1)],
                         ids=["train-tp2-gen-tp1", "train-dp2-gen-tp2", "train-dp2-sharded-gen-tp2"])
def test_ppo_with_different_training_and_generation_layouts(tmp_path, tp, tp_g, fsdp_size):
    out = tmp_path / "run"
    cfg = load_config("quickstart", [
        "trainer.total_training_steps=2", "trainer.test_freq=2", f"trainer.default_local_dir={out}",
        "data.train_batch_size=8", "data.builtin_val_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "critic.ppo_mini_batch_size=4", "critic.ppo_micro_batch_size_per_gpu=2", "trainer.save_freq=2",
        f"actor_rollout_ref.actor.tensor_model_parallel_size={tp}",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp_g}",
        f"actor_rollout_ref.actor.fsdp_config.fsdp_size={fsdp_size}", f"critic.fsdp_config.fsdp_size={fsdp_size}",
    ])
    run_ppo(cfg)
    with open(out / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    train = [r for r in rows if "critic/score/mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    # the resharded generation model samples from exactly the policy the training layout recomputes
    assert train[0]["rollout/logprob_diff_max"] <= 1e-5
    assert "val/score" in rows[0] and "val/score" in rows[-1]
    assert train[1]["rollout/kl"] != 0.0  # the update reached the generation weights
    assert (out / "global_step_2").is_dir()  # sharded checkpoint of the training layout
