"""Registries: lookup errors list the names; user registration; the uniform advantage calling convention."""

import pytest
import torch

from hybridflow.algorithms import (
    UnknownNameError,
    compute_policy_loss_vanilla,
    get_adv_estimator_fn,
    get_policy_loss_fn,
    register_adv_est,
    register_policy_loss,
)
from hybridflow.algorithms.policy_loss_registry import POLICY_LOSSES
from hybridflow.algorithms.registry import Registry


def test_unknown_names_list_known_ones():
    with pytest.raises(KeyError) as err:
        get_adv_estimator_fn("gea")
    assert isinstance(err.value, ValueError)
    assert str(err.value).startswith("unknown advantage estimator 'gea'; known: gae, grpo")
    with pytest.raises(UnknownNameError, match="unknown policy loss 'ppo'; known: .*vanilla"):
        get_policy_loss_fn("ppo")


def test_vanilla_is_registered():
    assert get_policy_loss_fn("vanilla") is compute_policy_loss_vanilla


def test_duplicate_name_with_other_function_is_refused():
    reg = Registry("thing")

    @reg.register("a")
    def first():
        return 1

    reg.register("a")(first)  # same function again: fine
    with pytest.raises(ValueError, match="'a' is already registered"):
        reg.register("a")(lambda: 2)
    with pytest.raises(ValueError, match="non-empty string"):
        reg.register("")
    assert reg.names() == ["a"] and "a" in reg and ["a"] not in reg


def test_user_estimator_uniform_call():
    @register_adv_est("test_reinforce_baseline")
    def reinforce(token_level_rewards, response_mask, baseline, scale=1.0, config=None):
        adv = (token_level_rewards.sum(-1, keepdim=True) - baseline) * scale * response_mask
        return adv, adv

    class Cfg:
        baseline = 0.5
        scale = 2.0

    fn = get_adv_estimator_fn("test_reinforce_baseline")
    rewards, mask = torch.tensor([[0.0, 1.0]]), torch.ones(1, 2)
    # baseline and scale from the config; unused keywords (values, index) ignored: (1 - 0.5) * 2 = 1
    adv, _ = fn(token_level_rewards=rewards, response_mask=mask, values=None, index=None, config=Cfg())
    assert adv.tolist() == [[1.0, 1.0]]
    # a keyword wins over the config: (1 - 0) * 2 = 2
    adv, _ = fn(token_level_rewards=rewards, response_mask=mask, baseline=0.0, config=Cfg())
    assert adv.tolist() == [[2.0, 2.0]]
    with pytest.raises(TypeError, match="'test_reinforce_baseline' needs 'baseline'"):
        fn(token_level_rewards=rewards, response_mask=mask)
    # the decorated function keeps its natural signature
    assert reinforce(rewards, mask, 1.0)[0].tolist() == [[0.0, 0.0]]


def test_estimator_with_var_kwargs_receives_extra_inputs():
    seen = {}

    @register_adv_est("test_var_kwargs")
    def est(token_level_rewards, response_mask, **kwargs):
        seen.update(kwargs)
        return token_level_rewards, token_level_rewards

    get_adv_estimator_fn("test_var_kwargs")(token_level_rewards=torch.zeros(1, 1), response_mask=torch.ones(1, 1),
                                            reward_baselines=torch.ones(1), config=None)
    assert set(seen) == {"reward_baselines"}


def test_user_policy_loss():
    @register_policy_loss("test_reinforce")
    def reinforce_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                       rollout_log_probs=None, **agg_kwargs):
        zero = torch.zeros(())
        return -(advantages * log_prob).sum(), zero, zero, zero

    loss, *_ = get_policy_loss_fn("test_reinforce")(None, torch.ones(1, 2), torch.full((1, 2), 2.0), None)
    assert loss.item() == -4.0


def test_policy_loss_without_rollout_log_probs_is_refused():
    # the actor passes rollout_log_probs= to every loss; one that would swallow it into **agg_kwargs is refused
    def old_style(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                  **agg_kwargs):
        raise AssertionError("never called")

    with pytest.raises(TypeError, match="'test_old_style' .* must accept the keyword rollout_log_probs"):
        register_policy_loss("test_old_style")(old_style)
    with pytest.raises(UnknownNameError):
        get_policy_loss_fn("test_old_style")

    def fixed(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
              rollout_log_probs=None, **agg_kwargs):
        raise AssertionError("never called")

    register_policy_loss("test_old_style")(fixed)  # the refused one left nothing behind
    assert get_policy_loss_fn("test_old_style") is fixed


def test_policy_loss_with_args_and_kwargs_registers():
    # the call the actor makes reaches it through *args / **kwargs (tests/workers/test_generic_policy_loss.py)
    @register_policy_loss("test_star_loss")
    def star_loss(*args, **kwargs):
        zero = torch.zeros(())
        return zero, zero, zero, zero

    try:
        assert get_policy_loss_fn("test_star_loss") is star_loss  # registered as written, no wrapper
    finally:
        POLICY_LOSSES.unregister("test_star_loss")


def test_policy_loss_missing_a_parameter_is_refused_in_one_line():
    def no_config(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                  rollout_log_probs=None, num_tokens=None, num_seqs=None, loss_scale_factor=None):
        raise AssertionError("never called")

    with pytest.raises(TypeError) as err:
        register_policy_loss("test_no_config")(no_config)
    message = str(err.value)
    assert "\n" not in message and "'test_no_config'" in message and "cannot take the actor's call" in message
    with pytest.raises(UnknownNameError):
        get_policy_loss_fn("test_no_config")


def test_algorithms_layer_does_not_import_ray():
    import subprocess
    import sys

    code = "import sys, hybridflow.algorithms; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
