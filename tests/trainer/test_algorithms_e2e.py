"""End to end through Ray, a few short steps each: every algorithm recipe runs; ReMax's baseline is the reward
of the greedy response (recomputed here, outside the workers); Safe-RLHF's multiplier follows its rule and its
checkpoint carries the multiplier and the cost critic. The reward/cost model is a tiny random scorer built here."""

import json
import math
import os
import shutil

import numpy as np
import pytest
import torch
from transformers import LlamaForSequenceClassification

from helpers.models import tiny_model
from hybridflow.algorithms import compute_remax_outcome_advantage, register_adv_est
from hybridflow.config import load_config
from hybridflow.models.builtin import resolve_model_path
from hybridflow.models.hf import load_tokenizer
from hybridflow.rewards import default_compute_score
from hybridflow.trainer.main import run_ppo
from hybridflow.trainer.loop import TrainLoop
from hybridflow.trainer.remax import ReMaxTrainer
from hybridflow.trainer.scoring import build_reward
from hybridflow.trainer.setup import build_data, worker_groups
from hybridflow.utils.tracking import Tracking

pytestmark = pytest.mark.slow

SHORT = ["trainer.total_training_steps=2", "trainer.test_freq=2", "trainer.n_gpus_per_node=1",
         "trainer.logger=[jsonl]", "data.train_batch_size=4", "data.builtin_val_size=4",
         "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
         "critic.ppo_mini_batch_size=2", "critic.ppo_micro_batch_size_per_gpu=2"]

BASELINES = []  # reward_baselines seen by the estimator, one (B,) tensor per step


@register_adv_est("remax_recording")
def _remax_recording(token_level_rewards, reward_baselines, response_mask):
    BASELINES.append(reward_baselines.clone())
    return compute_remax_outcome_advantage(token_level_rewards, reward_baselines, response_mask)


@pytest.fixture(scope="module")
def score_model(tmp_path_factory):
    """A tiny random LlamaForSequenceClassification with the actor's tokenizer; scores of order 1."""
    path = tmp_path_factory.mktemp("score_model")
    tokenizer = load_tokenizer("builtin:tiny-arith")
    model = tiny_model(LlamaForSequenceClassification, seed=0, vocab_size=512, hidden_size=16, intermediate_size=32,
                       num_hidden_layers=1, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        model.score.weight.mul_(5.0)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(resolve_model_path("builtin:tiny-arith"), name), path)
    return str(path)


def _metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("recipe", ["grpo_quickstart", "rloo_quickstart", "reinforce_pp_quickstart"])
def test_ppo_family_recipe_runs_critic_free(recipe, ray_session, tmp_path):
    run_ppo(load_config(recipe, SHORT + [f"trainer.default_local_dir={tmp_path}"]))
    rows = _metrics(tmp_path)
    train = [r for r in rows if "actor/pg_loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert "val/score" in rows[0] and "val/score" in rows[-1]
    assert not any("critic/vf_loss" in r or "critic/values/mean" in r for r in train)  # no critic
    assert all(math.isfinite(r["critic/advantages/mean"]) for r in train)


def test_dapo_recipe_runs_dynamic_sampling_and_overlong_filtering(ray_session, tmp_path):
    # 6 response tokens: the tiny model's answers (~12 tokens) are cut, so most responses are truncated and
    # score 0; filtering masks them out of the loss
    run_ppo(load_config("dapo_quickstart", SHORT + [
        f"trainer.default_local_dir={tmp_path}", "data.max_response_length=6", "reward_model.overlong_buffer.len=2",
        "actor_rollout_ref.actor.overlong_filter=true"]))
    train = [r for r in _metrics(tmp_path) if "actor/pg_loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert 1 <= r["dapo/gen_batches"] <= 3 and r["response_length/clip_ratio"] > 0
        assert r["dapo/overlong_penalty_mean"] < 0  # truncated responses sit at the end of the buffer
        assert math.isfinite(r["actor/pg_loss"]) and math.isfinite(r["actor/grad_norm"])
        if r["response_length/clip_ratio"] == 1.0:  # every response truncated: nothing in the loss
            assert r["actor/pg_loss"] == 0.0 and r["actor/grad_norm"] == 0.0


def _reference_rewards(greedy, non_tensor, score_model_path):
    """Rule score + score-model score of each greedy response, computed in this process: decode the valid
    response tokens and score them with the GSM8K rule; run the scorer on each unpadded sequence alone."""
    tokenizer = load_tokenizer("builtin:tiny-arith")
    scorer = LlamaForSequenceClassification.from_pretrained(score_model_path).eval()
    b = greedy.batch
    rewards = []
    for i in range(len(greedy)):
        text = tokenizer.decode(b["responses"][i][b["response_mask"][i].bool()].tolist(), skip_special_tokens=True)
        rule = default_compute_score(non_tensor["data_source"][i], text, non_tensor["ground_truth"][i])
        tokens = b["input_ids"][i][b["attention_mask"][i].bool()][None]
        with torch.no_grad():
            model_score = scorer.score(scorer.model(input_ids=tokens).last_hidden_state)[0, -1, 0].item()
        rewards.append(rule + model_score)
    return torch.tensor(rewards)


def test_remax_baseline_is_the_reward_of_the_greedy_response(ray_session, tmp_path, score_model):
    n = 2
    cfg = load_config("remax_quickstart", SHORT + [
        f"trainer.default_local_dir={tmp_path}", "algorithm.adv_estimator=remax_recording",
        f"actor_rollout_ref.rollout.n={n}", "reward_model.enable=true", f"reward_model.model.path={score_model}"])
    train_batches, val_data, _ = build_data(cfg)
    first = next(train_batches(0))
    tracker = Tracking("hybridflow", "remax", tmp_path, ["jsonl"])
    with worker_groups(cfg, 2) as groups:
        prompts = first.select(["input_ids", "attention_mask", "position_ids"])
        prompts.meta_info = {"do_sample": False, "n": 1}
        expected = _reference_rewards(groups["actor"].generate_sequences(prompts), first.non_tensor_batch,
                                      score_model)
        BASELINES.clear()
        driver = ReMaxTrainer(cfg, groups["actor"], build_reward(groups, cfg))
        TrainLoop(cfg, driver, tracker).fit(train_batches, val_data, 2)
    tracker.finish()
    assert len(BASELINES) == 2
    # step 1 saw the same prompts with the same (not yet updated) weights; each prompt's n samples share it
    assert torch.allclose(BASELINES[0], expected.repeat_interleave(n), atol=1e-4)
    assert expected.abs().min() > 0  # the model part makes every baseline distinct from a default of 0
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows if "actor/pg_loss" in r] == [1, 2] and "val/score" in rows[-1]


def test_safe_rlhf_multiplier_and_checkpoint(ray_session, tmp_path, score_model):
    lr, threshold, steps, lambda_max = 0.5, 0.2, 3, 100.0
    cfg = load_config("safe_rlhf_quickstart", SHORT + [
        f"trainer.default_local_dir={tmp_path}", f"trainer.total_training_steps={steps}", "trainer.test_freq=3",
        "trainer.save_freq=3", "cost_model.enable=true", f"cost_model.model.path={score_model}",
        f"algorithm.lagrangian.lambda_lr={lr}", f"algorithm.lagrangian.threshold={threshold}",
        "algorithm.lagrangian.lambda_init=1.0", f"algorithm.lagrangian.lambda_max={lambda_max}"])
    run_ppo(cfg)
    rows = _metrics(tmp_path)
    train = [r for r in rows if "lagrange/lambda" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    log_lambda = 0.0
    for r in train:  # log lambda moves by lr * (window mean cost - threshold): up above it, down below it
        step = lr * (r["lagrange/window_cost"] - threshold)
        assert math.log(r["lagrange/lambda"]) == pytest.approx(min(log_lambda + step, math.log(lambda_max)), abs=1e-9)
        assert np.sign(math.log(r["lagrange/lambda"]) - log_lambda) == np.sign(r["lagrange/window_cost"] - threshold)
        log_lambda = math.log(r["lagrange/lambda"])
        assert {"cost/score/mean", "critic/score/mean", "cost_critic/vf_loss", "critic/vf_loss"} <= set(r)
    assert "val/cost" in rows[0] and "val/cost" in rows[-1]
    ckpt = tmp_path / "global_step_3"
    assert (ckpt / "cost_critic").is_dir() and (ckpt / "critic").is_dir()
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    assert state["lagrange"]["log_lambda"] == pytest.approx(log_lambda)
