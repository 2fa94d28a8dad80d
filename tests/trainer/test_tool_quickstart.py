"""recipes/tool_grpo_quickstart.yaml end to end through Ray for 2 steps: the multi-turn loop with the calculator runs
on builtin:tool-arith with builtin:tiny-tool, tool calls happen and are logged, and validation reports the tool
metrics of the held-out problems."""

import json
import math

import pytest

from hybridflow.config import load_config
from hybridflow.data.tool_task import DATA_SOURCE
from hybridflow.trainer.main import run_ppo

pytestmark = pytest.mark.slow

SHORT = ["trainer.total_training_steps=2", "trainer.test_freq=2", "trainer.n_gpus_per_node=1",
         "trainer.logger=[jsonl]", "data.train_batch_size=4", "data.builtin_train_size=8", "data.builtin_val_size=8",
         "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"]


def test_recipe_loads_with_the_tool_task_and_model():
    cfg = load_config("tool_grpo_quickstart")
    assert cfg.actor_rollout_ref.rollout.multi_turn.enable
    assert cfg.data.train_files == cfg.data.val_files == "builtin:tool-arith"
    assert cfg.actor_rollout_ref.model.path == "builtin:tiny-tool"


def test_tool_grpo_quickstart_two_steps(ray_session, tmp_path):
    run_ppo(load_config("tool_grpo_quickstart", SHORT + [f"trainer.default_local_dir={tmp_path}"]))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "actor/pg_loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert math.isfinite(r["actor/pg_loss"]) and r["tool/errors"] >= 0
        assert 1.0 <= r["multi_turn/turns_mean"] <= 3.0
    assert sum(r["tool/calls_mean"] for r in train) > 0  # 32 trajectories at ~30% calls: some call the calculator
    val = [r for r in rows if "val/score" in r]
    assert val and all(f"val/score/{DATA_SOURCE}" in r and 0.0 <= r["val/tool/correct_call"] <= 1.0 for r in val)
