"""Driver selection (algorithm.driver) and what each driver needs, checked at load time."""

import subprocess
import sys

import pytest

from hybridflow.config import ConfigError, load_config, need_critic


def _problems(recipe, *overrides):
    with pytest.raises(ConfigError) as err:
        load_config(recipe, list(overrides))
    return err.value.problems


def test_default_driver_is_ppo_and_the_quickstart_is_unchanged():
    cfg = load_config("quickstart")
    assert cfg.algorithm.driver == "ppo" and cfg.algorithm.adv_estimator == "gae" and need_critic(cfg)
    assert not cfg.reward_model.enable and cfg.cost_model.rule is None


@pytest.mark.parametrize("recipe, driver, estimator, critic", [
    ("grpo_quickstart", "ppo", "grpo", False), ("rloo_quickstart", "ppo", "rloo", False),
    ("reinforce_pp_quickstart", "ppo", "reinforce_plus_plus", False), ("remax_quickstart", "remax", "remax", False),
    ("safe_rlhf_quickstart", "safe_rlhf", "gae", True), ("async_grpo_quickstart", "async", "grpo", False),
    ("dapo_quickstart", "ppo", "grpo", False), ("drgrpo_quickstart", "ppo", "grpo", False)])
def test_recipes_select_their_driver(recipe, driver, estimator, critic):
    cfg = load_config(recipe)
    assert (cfg.algorithm.driver, cfg.algorithm.adv_estimator, need_critic(cfg)) == (driver, estimator, critic)


def test_misspelled_driver_gets_a_suggestion():
    (problem,) = _problems("quickstart", "algorithm.driver=remx")
    assert problem == "algorithm.driver: 'remx' is not one of ppo, remax, safe_rlhf, async; did you mean remax?"


def test_remax_estimator_needs_the_remax_driver():
    (problem,) = _problems("quickstart", "algorithm.adv_estimator=remax")
    assert problem.startswith("algorithm.adv_estimator=remax needs algorithm.driver=remax")


def test_remax_driver_trains_no_critic():
    (problem,) = _problems("remax_quickstart", "critic.enable=true")
    assert problem.startswith("algorithm.driver=remax trains no critic")


def test_safe_rlhf_needs_gae_and_a_cost():
    problems = _problems("quickstart", "algorithm.driver=safe_rlhf", "algorithm.adv_estimator=grpo")
    assert len(problems) == 2
    assert problems[0].startswith("algorithm.driver=safe_rlhf uses a reward critic and a cost critic")
    assert problems[1].startswith("algorithm.driver=safe_rlhf needs a cost: set cost_model.rule")


def test_lagrangian_and_score_model_values():
    problems = _problems("safe_rlhf_quickstart", "algorithm.lagrangian.lambda_init=2.0",
                         "algorithm.lagrangian.lambda_max=1.0", "algorithm.lagrangian.lambda_lr=-1",
                         "cost_model.enable=true", "reward_model.enable=true", "cost_model.rule=nope")
    assert "algorithm.lagrangian.lambda_lr: must be >= 0, got -1.0" in problems
    assert "algorithm.lagrangian.lambda_max (1.0) must be null or >= algorithm.lagrangian.lambda_init (2.0)" in problems
    assert "reward_model.enable=true needs reward_model.model.path (a local sequence- or token-classification " \
           "checkpoint)" in problems
    assert any(p.startswith("cost_model.enable=true needs cost_model.model.path") for p in problems)
    assert any(p.startswith("cost_model.rule: unknown rule cost 'nope'") for p in problems)


def test_async_driver_needs_a_generator_pool_of_its_own():
    (problem,) = _problems("grpo_quickstart", "algorithm.driver=async", "actor_rollout_ref.actor.policy_loss=aipo")
    assert "resource_pool.mapping.generator" in problem and "'global_pool'" in problem


def test_async_staleness_and_queue_bounds():
    problems = _problems("async_grpo_quickstart", "async_training.max_staleness=-1", "async_training.queue_size=0")
    assert problems == ["async_training.max_staleness must be >= 0, got -1",
                        "async_training.queue_size must be null or >= 1, got 0"]


def test_bypass_old_log_prob_is_for_the_ppo_and_async_drivers():
    (problem,) = _problems("remax_quickstart", "algorithm.bypass_old_log_prob=true")
    assert "drivers ppo and async" in problem and "remax" in problem


def test_async_generator_ranks_must_divide_the_batch_and_the_queue_is_bounded():
    (problem,) = _problems("async_grpo_quickstart", "resource_pool.pools={trainer: [1], generator: [3]}")
    assert "data.train_batch_size (16)" in problem and "'generator' has 3 ranks" in problem
    (problem,) = _problems("async_grpo_quickstart", "async_training.max_staleness=40")
    assert problem.startswith("async_training.queue_size (default max_staleness + 1 = 41) must be <= 32")


UNCORRECTED = ["actor_rollout_ref.actor.policy_loss=vanilla", "algorithm.bypass_old_log_prob=false",
               "async_training.max_staleness=1"]  # the async recipe minus its corrections: PPO clip on stale samples
CORRECTIONS = ("actor_rollout_ref.actor.policy_loss=aipo", "actor_rollout_ref.actor.tis_imp_ratio_cap",
               "algorithm.bypass_old_log_prob=true")


def test_async_with_stale_samples_and_no_correction_exits_2_before_ray(tmp_path):
    # through the CLI in a fresh interpreter: exit 2, one problem naming every correction, Ray never imported
    code = ("import sys; from hybridflow.cli import main; "
            f"rc = main(['train', 'async_grpo_quickstart', *{UNCORRECTED!r}]); print(rc, 'ray' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["2", "False"], proc.stderr
    assert proc.stderr.startswith("invalid config (1 problem):"), proc.stderr
    assert "async_training.max_staleness=1" in proc.stderr
    assert all(option in proc.stderr for option in CORRECTIONS), proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("fix", ["actor_rollout_ref.actor.policy_loss=aipo",
                                 "actor_rollout_ref.actor.tis_imp_ratio_cap=2.0",
                                 "algorithm.bypass_old_log_prob=true",
                                 "async_training.max_staleness=0"])
def test_each_off_policy_correction_makes_async_valid(fix):
    cfg = load_config("async_grpo_quickstart", UNCORRECTED + [fix])
    assert cfg.algorithm.driver == "async"


def test_gspo_with_tis_is_a_correction_and_without_is_not():
    load_config("async_grpo_quickstart", UNCORRECTED + ["actor_rollout_ref.actor.policy_loss=gspo",
                                                        "actor_rollout_ref.actor.tis_imp_ratio_cap=2.0"])
    (problem,) = _problems("async_grpo_quickstart", *UNCORRECTED, "actor_rollout_ref.actor.policy_loss=gspo",
                           "async_training.max_staleness=2")
    assert "max_staleness=2" in problem and "policy_loss=gspo" in problem


def test_shipped_async_recipe_is_corrected():
    cfg = load_config("async_grpo_quickstart")
    assert cfg.async_training.max_staleness >= 1 and cfg.actor_rollout_ref.actor.policy_loss == "aipo"


def test_lagrangian_lambda_min_is_a_floor_below_lambda_init():
    assert load_config("safe_rlhf_quickstart").algorithm.lagrangian.lambda_min == 0.01  # the schema default
    problems = _problems("safe_rlhf_quickstart", "algorithm.lagrangian.lambda_min=2.0")
    assert problems == ["algorithm.lagrangian.lambda_min (2.0) must be in [0, algorithm.lagrangian.lambda_init "
                        "(1.0)] (0: no floor)"]
    assert _problems("safe_rlhf_quickstart", "algorithm.lagrangian.lambda_min=-1")[0].startswith(
        "algorithm.lagrangian.lambda_min (-1.0)")
def test_dapo_and_drgrpo_recipes_set_their_methods():
    dapo = load_config("dapo_quickstart")
    actor = dapo.actor_rollout_ref.actor
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.loss_agg_mode) == (0.2, 0.28, "token-mean")
    assert dapo.algorithm.filter_groups.enable and dapo.algorithm.filter_groups.metric == "acc"
    assert dapo.reward_model.overlong_buffer.enable and dapo.reward_model.overlong_buffer.len == 8
    drgrpo = load_config("drgrpo_quickstart")
    assert drgrpo.actor_rollout_ref.actor.loss_agg_mode == "seq-mean-token-sum-norm"
    assert drgrpo.actor_rollout_ref.actor.loss_scale_factor is None  # -> data.max_response_length
    assert not drgrpo.algorithm.norm_adv_by_std_in_grpo


def test_dapo_keys_are_checked_at_load():
    problems = _problems("grpo_quickstart", "algorithm.filter_groups.enable=true", "actor_rollout_ref.rollout.n=1",
                         "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=40",
                         "reward_model.overlong_buffer.penalty_factor=-1", "actor_rollout_ref.actor.loss_scale_factor=0",
                         "algorithm.filter_groups.metric=accuracy", "algorithm.filter_groups.on_limit=skip",
                         "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4")
    assert "reward_model.overlong_buffer.penalty_factor: must be >= 0, got -1.0" in problems
    assert "actor_rollout_ref.actor.loss_scale_factor: must be null or > 0, got 0.0" in problems
    assert "algorithm.filter_groups.metric: 'accuracy' is not one of acc, score, seq_reward" in problems
    assert any(p.startswith("algorithm.filter_groups.on_limit: 'skip' is not one of error, train") for p in problems)
    assert any(p.startswith("algorithm.filter_groups.enable=true needs groups: set actor_rollout_ref.rollout.n >= 2")
               for p in problems)
    assert "reward_model.overlong_buffer.len must be in [1, data.max_response_length=32] when " \
           "reward_model.overlong_buffer.enable=true, got 40" in problems
    assert len(problems) == 6


def test_dapo_pieces_name_the_drivers_that_run_them():
    problems = _problems("remax_quickstart", "algorithm.filter_groups.enable=true",
                         "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=4",
                         "actor_rollout_ref.rollout.n=2", "data.train_batch_size=32",
                         "actor_rollout_ref.actor.ppo_mini_batch_size=16")
    assert any("filter_groups.enable=true (DAPO dynamic sampling) is supported by the ppo driver, got "
               "algorithm.driver=remax" in p for p in problems)
    assert any("overlong_buffer.enable=true is supported by the drivers ppo and async, got algorithm.driver=remax"
               in p for p in problems)
