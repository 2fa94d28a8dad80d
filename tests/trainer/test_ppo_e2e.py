"""End to end: a few PPO steps through real Ray worker groups (2 ranks each for actor and critic)."""

import json

import pytest

from hybridflow.config import load_config
from hybridflow.trainer.main import run_ppo

pytestmark = pytest.mark.slow


def _read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_ppo_steps_through_ray(tmp_path):
    out = tmp_path / "run"
    cfg = load_config(
        "quickstart",
        [
            "trainer.total_training_steps=2",
            "trainer.test_freq=2",
            f"trainer.default_local_dir={out}",
            "data.train_batch_size=8",
            "data.builtin_val_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "critic.ppo_mini_batch_size=4",
            "critic.ppo_micro_batch_size_per_gpu=2",
        ],
    )
    run_ppo(cfg)
    rows = _read_metrics(out / "metrics.jsonl")
    train = [r for r in rows if "critic/score/mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    # Before the first update the actor's recomputed logprobs are those the rollout sampled from (fp32).
    assert train[0]["rollout/logprob_diff_max"] <= 1e-5
    assert "val/score" in rows[0] and "val/score" in rows[-1]
    for key in ("actor/pg_loss", "critic/vf_loss", "actor/entropy", "rollout/kl", "response_length/mean",
                "timing_s/gen", "timing_s/update_actor", "perf/throughput"):
        assert key in train[-1], key
    # the policy changed after one update: the KL to the reference is non-zero at step 2
    assert train[1]["rollout/kl"] != 0.0
