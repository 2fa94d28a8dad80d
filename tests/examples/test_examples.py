"""The programs in examples/ run as written (a few short steps each, on the session's Ray)."""

import json

import pytest

pytestmark = pytest.mark.slow

SHORT = ["data.train_batch_size=8", "data.builtin_val_size=8", "trainer.n_gpus_per_node=1",
         "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
         "trainer.total_training_steps=2", "trainer.logger=[jsonl]"]


def test_ppo_driver(repo_script, ray_session, tmp_path, capsys):
    driver = repo_script("examples/ppo_driver.py")
    result = driver.main(SHORT + ["critic.ppo_mini_batch_size=4", "critic.ppo_micro_batch_size_per_gpu=4",
                                  f"trainer.default_local_dir={tmp_path}"])
    out = capsys.readouterr().out
    assert "step 1 | reward" in out and "step 2 | reward" in out
    assert 0.0 <= result["before"] <= 1.0 and 0.0 <= result["after"] <= 1.0


def test_custom_estimator(repo_script, ray_session, tmp_path):
    module = repo_script("examples/custom_estimator.py")
    result = module.main(SHORT + [f"trainer.default_local_dir={tmp_path}", "trainer.test_freq=2"])
    assert "val/score" in result
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    train = [r for r in rows if "critic/advantages/mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    # the estimator ran: group-median-centred outcome scores of 0/1 rewards lie in [-1, 1]
    assert all(-1.0 <= r["critic/advantages/min"] <= r["critic/advantages/max"] <= 1.0 for r in train)
