"""Batches that do not split evenly over the generation ranks, end to end through Ray (2 ranks).

The dispatch pads the prompts to a multiple of the ranks and the rollout returns n samples per prompt, so the
padding has to be removed from the outputs n rows per padding prompt. One set of worker groups (GRPO, tiny
builtin model, 4-token responses) serves every case:

* training: 2 PPO steps with 1, 3 and 5 prompts x n=2 (``TrainLoop.fit``, validation at the end with
  ``val_kwargs.do_sample=true, n=2`` on an odd-sized validation set). With n=1 or 3 an odd number of prompts
  gives an odd number of sequences, which the PPO update cannot split over 2 ranks: the config loader refuses
  those before Ray starts (checked here too).
* validation: validation sets of 1, 3 and 5 prompts with sampled n in {1, 2, 3} (plus the greedy pass).

Expected values are counts and keys, derived from the prompt counts, never read back from the code.
"""

import json

import pytest

from hybridflow.config import ConfigError, load_config
from hybridflow.trainer.loop import TrainLoop
from hybridflow.trainer.ppo import PPOTrainer
from hybridflow.trainer.scoring import build_reward
from hybridflow.trainer.setup import build_data, worker_groups
from hybridflow.trainer.validate import validate
from hybridflow.utils.tracking import Tracking

pytestmark = pytest.mark.timeout(900)

PROMPT_COUNTS = (1, 3, 5)
STEPS = 2


def _config(tmp_path, prompts=1, n=2, val_n=2, val_size=3, extra=()):
    return load_config("quickstart", [
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
        f"actor_rollout_ref.rollout.n={n}", "actor_rollout_ref.rollout.micro_batch_size_per_gpu=2",
        f"data.train_batch_size={prompts}", f"data.builtin_train_size={max(PROMPT_COUNTS) * STEPS}",
        f"data.builtin_val_size={val_size}", "data.max_response_length=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true", f"actor_rollout_ref.rollout.val_kwargs.n={val_n}",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        f"trainer.total_training_steps={STEPS}", f"trainer.test_freq={STEPS}", "trainer.val_before_train=false",
        "trainer.save_freq=-1", "trainer.resume_mode=disable", "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={tmp_path}", *extra,
    ])


@pytest.fixture(scope="module")
def groups(ray_session, tmp_path_factory):
    cfg = _config(tmp_path_factory.mktemp("groups"))
    with worker_groups(cfg, STEPS * len(PROMPT_COUNTS)) as g:
        yield g


@pytest.mark.slow
@pytest.mark.parametrize("prompts", PROMPT_COUNTS)
def test_train_two_steps_with_n2_and_validate_odd_set(groups, tmp_path, prompts):
    out = tmp_path / "run"
    cfg = _config(out, prompts=prompts, val_size=prompts)
    batches, val_data, _ = build_data(cfg)
    assert len(val_data) == prompts
    tracker = Tracking("t", "uneven", out, backends=["jsonl"])
    try:
        trainer = PPOTrainer(cfg, groups["actor"], None, build_reward(groups, cfg))
        last_val = TrainLoop(cfg, trainer, tracker).fit(batches, val_data, STEPS)
    finally:
        tracker.finish()
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:  # every sample of every prompt made it into the batch (n=2 rows per prompt)
        assert row["perf/total_num_tokens"] > 0 and "actor/pg_loss" in row
    assert 0.0 <= last_val["val/mean@2"] <= 1.0 and 0.0 <= last_val["val/score"] <= 1.0
    assert rows[-1]["val/mean@2"] == last_val["val/mean@2"]


@pytest.mark.parametrize("prompts,n", [(p, n) for p in PROMPT_COUNTS for n in (1, 3)])
def test_odd_sequence_count_is_refused_at_load(tmp_path, prompts, n):
    with pytest.raises(ConfigError, match=rf"ppo_mini_batch_size \* actor_rollout_ref.rollout.n = 1 \* {n} = {n}"):
        _config(tmp_path, prompts=prompts, n=n, extra=["actor_rollout_ref.actor.ppo_mini_batch_size=1"])


@pytest.mark.slow
def test_validation_with_odd_sets_and_n_samples(groups, tmp_path):
    for size in PROMPT_COUNTS:
        for n in (1, 2, 3):
            cfg = _config(tmp_path, val_n=n, val_size=size)
            _, val_data, _ = build_data(cfg)
            metrics = validate(cfg, groups["actor"], build_reward(groups, cfg), val_data)
            assert 0.0 <= metrics["val/score"] <= 1.0, (size, n)
            assert 0.0 <= metrics[f"val/mean@{n}"] <= 1.0, (size, n)
            if n >= 2:  # 0/1 rule scores: best@n is pass@n, and at least the mean
                assert metrics[f"val/best@{n}"] == pytest.approx(metrics[f"val/pass@{n}"]), (size, n)
                assert metrics[f"val/pass@{n}"] >= metrics[f"val/mean@{n}"] - 1e-9, (size, n)
                assert 0.0 <= metrics.get(f"val/maj@{n}", 0.0) <= 1.0, (size, n)


@pytest.mark.slow
@pytest.mark.parametrize("size", PROMPT_COUNTS)
def test_generation_returns_n_rows_per_prompt_in_prompt_order(groups, tmp_path, size):
    """Row i*n + j holds prompt i: the rows the padding prompt (a copy of prompt 0) produced are the ones dropped."""
    _, val_data, _ = build_data(_config(tmp_path, val_size=size))
    prompts = val_data.select(["input_ids", "attention_mask", "position_ids"])
    for n in (1, 2, 3):
        prompts.meta_info.update(do_sample=True, temperature=1.0, n=n, seed=1)
        gen = groups["actor"].generate_sequences(prompts)
        expected = val_data.batch["input_ids"].repeat_interleave(n, dim=0)
        assert gen.batch["prompts"].tolist() == expected.tolist(), n
