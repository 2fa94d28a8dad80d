"""End to end: GRPO steps with multi-turn tool-calling rollouts through real Ray worker groups (2 actor ranks),
on the closed-form bigram checkpoint of tests/rollout/mt_tiny.py. The trainer consumes the rollout unchanged:
the actor's recomputed logprobs equal the sampling ones before the first update (so it scores exactly the
rollout's ids in their context), the multi-turn metrics are logged, and a user reward function receives the
model turns and the tool results apart."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridflow.config import load_config
from hybridflow.trainer.main import run_ppo

pytestmark = pytest.mark.slow

_HELPERS = Path(__file__).resolve().parent.parent / "rollout" / "mt_tiny.py"
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    turns, calls = extra_info["model_turns"], extra_info["tool_calls"]
    assert solution_str == "".join(turns), (solution_str, turns)  # the model's text, tool output left out
    assert "tool_response" not in solution_str and all(c["result"] == "5" for c in calls)
    assert len(calls) == len(turns) - 1 or len(calls) == len(turns)
    return 1.0 if calls and ground_truth in turns[-1] else 0.0
'''


def _helpers():
    spec = importlib.util.spec_from_file_location("mt_tiny_e2e", _HELPERS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grpo_with_tool_calls_through_ray(tmp_path, ray_session):
    mt = _helpers()
    tok = mt.build_tokenizer()
    model_dir = mt.build_bigram_model(tok, mt.coin_table(tok), tmp_path / "model")
    rows = [{"prompt": [{"role": "user", "content": q}], "data_source": "mt/test",
             "reward_model": {"ground_truth": "5"}} for q in mt.QUESTIONS + ["2+3=?"]]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "data.parquet")
    (tmp_path / "reward.py").write_text(REWARD)
    out = tmp_path / "run"
    cfg = load_config("grpo_quickstart", [
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={tmp_path / 'data.parquet'}",
        f"data.val_files={tmp_path / 'data.parquet'}", f"reward_model.compute_score={tmp_path / 'reward.py'}:compute_score",
        "data.train_batch_size=4", "data.max_response_length=128", "data.max_prompt_length=64",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.save_freq=-1",
        f"trainer.default_local_dir={out}", "trainer.val_before_train=false",
    ])
    run_ppo(cfg)
    train = [json.loads(line) for line in open(out / "metrics.jsonl")]
    train = [r for r in train if "critic/score/mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    first = train[0]
    assert first["rollout/logprob_diff_max"] <= 1e-4
    assert 1.0 <= first["multi_turn/turns_mean"] <= 3.0
    assert first["tool/calls_mean"] > 0 and first["tool/errors"] == 0 and first["tool/latency_s_mean"] > 0
    reasons = {k: v for k, v in first.items() if k.startswith("multi_turn/finish/")}
    assert sum(reasons.values()) == pytest.approx(1.0) and reasons["multi_turn/finish/length"] == 0
    assert 0.0 <= first["critic/score/mean"] <= 1.0
