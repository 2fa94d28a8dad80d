"""RLOO, REINFORCE++ (and its baseline variant), ReMax: hand-computed values and invariants.

The invariants (padding, size-1 and all-equal groups, uid grouping) run over every registered
estimator through the registry's uniform call, the way the driver calls them.
"""

import math

import numpy as np
import pytest
import torch

from hybridflow.algorithms import (
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator_fn,
)
from hybridflow.config.assemble import section_class

AlgorithmConfig = section_class("algorithm")  # with every registered estimator's and driver's keys

NAN = float("nan")


def outcome_rewards(scores, lengths, length):
    """Token rewards with each score on the last valid token, and the matching right-padded mask."""
    rewards = torch.zeros(len(scores), length)
    mask = torch.zeros(len(scores), length)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        rewards[i, n - 1] = s
        mask[i, :n] = 1
    return rewards, mask


def per_row(adv, mask):
    """The value each row carries on its valid tokens (asserting it is the same on all of them)."""
    out = []
    for a, m in zip(adv, mask):
        vals = a[m != 0]
        assert torch.allclose(vals, vals[0].expand_as(vals)), "sequence advantage must be constant on the row"
        assert (a[m == 0] == 0).all(), "padded positions must be 0"
        out.append(vals[0].item())
    return out


def whiten(xs):
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
    return [(x - mean) / math.sqrt(var + 1e-8) for x in xs]


# --------------------------------------------------------------------------------------------------
# RLOO
# --------------------------------------------------------------------------------------------------


def test_rloo_by_hand():
    # group u: scores [1, 2, 6]  ->  1 - (2 + 6)/2 = -3;  2 - (1 + 6)/2 = -1.5;  6 - (1 + 2)/2 = 4.5
    # group v: scores [0, 4]     ->  0 - 4 = -4;  4 - 0 = 4
    # group w: one response      ->  0 (no other sample to form a baseline)
    rewards, mask = outcome_rewards([1.0, 2.0, 6.0, 0.0, 4.0, 5.0], [2, 3, 1, 3, 2, 3], 3)
    index = np.array(["u", "u", "u", "v", "v", "w"], dtype=object)
    adv, ret = compute_rloo_outcome_advantage(rewards, mask, index)
    assert per_row(adv, mask) == pytest.approx([-3.0, -1.5, 4.5, -4.0, 4.0, 0.0])
    assert adv.dtype == torch.float32 and torch.equal(ret, adv)


def test_rloo_sums_token_rewards_over_valid_tokens_only():
    # row 0: 0.5 + 0.5 = 1 (the 100 sits on a padded token); row 1: 3  ->  A = [1 - 3, 3 - 1] = [-2, 2]
    rewards = torch.tensor([[0.5, 0.5, 100.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv, _ = compute_rloo_outcome_advantage(rewards, mask, [7, 7])
    assert adv.tolist() == [[-2.0, -2.0, 0.0], [2.0, 2.0, 2.0]]


def test_rloo_registry_name_and_index_check():
    rewards, mask = outcome_rewards([1.0, 0.0], [1, 1], 1)
    adv, _ = get_adv_estimator_fn("rloo")(token_level_rewards=rewards, response_mask=mask, index=["p", "p"],
                                          config=AlgorithmConfig())
    assert adv.tolist() == [[1.0], [-1.0]]
    with pytest.raises(ValueError, match=r"index must have shape \(2,\)"):
        compute_rloo_outcome_advantage(rewards, mask, ["p"])


# --------------------------------------------------------------------------------------------------
# REINFORCE++
# --------------------------------------------------------------------------------------------------


def test_reinforce_plus_plus_by_hand():
    # gamma = 0.5
    # row 0: r = [1, 0, 2]          G2 = 2, G1 = 0 + 0.5*2 = 1, G0 = 1 + 0.5*1 = 1.5
    # row 1: r = [0, 3, garbage]    G1 = 3, G0 = 0 + 0.5*3 = 1.5 (third token padded)
    # valid G = [1.5, 1, 2, 1.5, 3]: mean 9/5 = 1.8, deviations [-0.3, -0.8, 0.2, -0.3, 1.2],
    # unbiased var = (0.09 + 0.64 + 0.04 + 0.09 + 1.44) / 4 = 0.575 -> A = deviation / sqrt(0.575)
    rewards = torch.tensor([[1.0, 0.0, 2.0], [0.0, 3.0, NAN]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    assert ret.tolist() == [[1.5, 1.0, 2.0], [1.5, 3.0, 0.0]]
    s = math.sqrt(0.575 + 1e-8)
    expected = [[-0.3 / s, -0.8 / s, 0.2 / s], [-0.3 / s, 1.2 / s, 0.0]]
    assert adv.flatten().tolist() == pytest.approx(sum(expected, []), abs=1e-6)
    assert adv[1, 2].item() == 0.0


def test_reinforce_plus_plus_skips_holes_in_the_mask():
    # mask [1, 0, 1], gamma 0.5, r = [1, 100, 2]: the hole is skipped, not a step:
    # G2 = 2, G0 = 1 + 0.5 * 2 = 2 (not 1 + 0.25 * 2); the 100 never enters
    rewards = torch.tensor([[1.0, 100.0, 2.0], [1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 0, 1], [1, 0, 0]])
    _, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    assert ret.tolist() == [[2.0, 0.0, 2.0], [1.0, 0.0, 0.0]]


def test_reinforce_plus_plus_gamma_one_is_score_minus_kl_to_go_and_reads_gamma_from_config():
    # per-token rewards -beta*KL_t = [-0.1, -0.2, -0.3] plus the score 1 on the last token, gamma = 1:
    # G = [1 - 0.6, 1 - 0.5, 1 - 0.3] = [0.4, 0.5, 0.7]
    rewards = torch.tensor([[-0.1, -0.2, 0.7]])
    adv, ret = get_adv_estimator_fn("reinforce_plus_plus")(
        token_level_rewards=rewards, response_mask=torch.ones(1, 3), config=AlgorithmConfig(gamma=1.0))
    assert ret[0].tolist() == pytest.approx([0.4, 0.5, 0.7], abs=1e-6)
    assert adv[0].tolist() == pytest.approx(whiten([0.4, 0.5, 0.7]), abs=1e-5)
    with pytest.raises(ValueError, match="at least 2 valid"):
        compute_reinforce_plus_plus_outcome_advantage(rewards, torch.tensor([[0, 0, 1]]), gamma=1.0)


def test_reinforce_plus_plus_baseline_by_hand():
    # group p: scores [1, 3] (lengths 2, 1) -> centered [-1, +1]; group q: one response -> 0
    # on tokens: row0 [-1, -1], row1 [1], row2 [0, 0]; valid values [-1, -1, 1, 0, 0]
    # mean -0.2, deviations [-0.8, -0.8, 1.2, 0.2, 0.2], unbiased var (0.64*2 + 1.44 + 0.04*2) / 4 = 0.7
    rewards, mask = outcome_rewards([1.0, 3.0, 4.0], [2, 1, 2], 2)
    adv, ret = compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, np.array(["p", "p", "q"]))
    s = math.sqrt(0.7 + 1e-8)
    expected = torch.tensor([[-0.8 / s, -0.8 / s], [1.2 / s, 0.0], [0.2 / s, 0.2 / s]])
    assert torch.allclose(adv, expected, atol=1e-6)
    assert adv[1, 1].item() == 0.0
    assert torch.equal(ret, adv)


# --------------------------------------------------------------------------------------------------
# ReMax
# --------------------------------------------------------------------------------------------------


def test_remax_by_hand_and_through_the_registry():
    # row 0: r = [0, 0, 1], greedy baseline 0.25   -> returns [1, 1, 1],   A = [0.75, 0.75, 0.75]
    # row 1: r = [0.5, 2, garbage], baseline 3     -> returns [2.5, 2, 0], A = [-0.5, -1, 0]
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.5, 2.0, 1e6]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    baselines = torch.tensor([0.25, 3.0])
    adv, ret = compute_remax_outcome_advantage(rewards, baselines, mask)
    assert ret.tolist() == [[1.0, 1.0, 1.0], [2.5, 2.0, 0.0]]
    assert adv.tolist() == [[0.75, 0.75, 0.75], [-0.5, -1.0, 0.0]]
    # the driver passes reward_baselines by keyword next to inputs ReMax does not take
    fn = get_adv_estimator_fn("remax")
    adv2, _ = fn(token_level_rewards=rewards, response_mask=mask, values=None, index=np.array(["a", "b"]),
                 reward_baselines=baselines, config=AlgorithmConfig(gamma=0.5))
    assert torch.equal(adv2, adv)  # gamma from the config is not used: ReMax is undiscounted
    with pytest.raises(TypeError, match="'remax' needs 'reward_baselines'"):
        fn(token_level_rewards=rewards, response_mask=mask, config=AlgorithmConfig())
    with pytest.raises(ValueError, match=r"reward_baselines must have shape \(2,\)"):
        compute_remax_outcome_advantage(rewards, baselines[:, None], mask)


# --------------------------------------------------------------------------------------------------
# Invariants over every registered estimator
# --------------------------------------------------------------------------------------------------

ALL_ESTIMATORS = ["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"]
GROUPED = ["grpo", "rloo", "reinforce_plus_plus_baseline"]
CONFIG = AlgorithmConfig(gamma=0.9, lam=0.95)


def random_batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = [4, 2, 3, 1, 4, 2]
    mask = (torch.arange(4)[None] < torch.tensor(lengths)[:, None]).float()
    rewards = torch.randn(6, 4, generator=gen)
    values = torch.randn(6, 4, generator=gen)
    index = np.array(["a", "a", "a", "b", "b", "c"], dtype=object)
    baselines = torch.randn(6, generator=gen)
    return rewards, values, mask, index, baselines


def call(name, rewards, values, mask, index, baselines, config=CONFIG):
    return get_adv_estimator_fn(name)(token_level_rewards=rewards, response_mask=mask, values=values, index=index,
                                      reward_baselines=baselines, config=config)


@pytest.mark.parametrize("name", ALL_ESTIMATORS)
@pytest.mark.parametrize("garbage", [1e6, NAN])
def test_padding_changes_no_advantage(name, garbage):
    rewards, values, mask, index, baselines = random_batch()
    clean = mask != 0
    base_adv, base_ret = call(name, torch.where(clean, rewards, 0.0), torch.where(clean, values, 0.0), mask, index,
                              baselines)
    # garbage on the already-padded positions, plus 3 extra padded columns holding garbage
    extra = torch.full((6, 3), garbage)
    padded_adv, padded_ret = call(
        name,
        torch.cat([torch.where(clean, rewards, garbage), extra], 1),
        torch.cat([torch.where(clean, values, -garbage), extra], 1),
        torch.cat([mask, torch.zeros(6, 3)], 1),
        index, baselines)
    assert torch.allclose(padded_adv[:, :4], base_adv, atol=1e-6)
    assert torch.allclose(padded_ret[:, :4], base_ret, atol=1e-6)
    assert (padded_adv[:, 4:] == 0).all() and (padded_ret[:, 4:] == 0).all()
    assert (base_adv[~clean] == 0).all()


@pytest.mark.parametrize("name", ALL_ESTIMATORS)
def test_singletons_and_equal_rewards_are_finite(name):
    # all six responses in groups of size 1, then all in one group with equal scores
    rewards, values, mask, _, baselines = random_batch(1)
    singletons = np.array([f"u{i}" for i in range(6)])
    adv, ret = call(name, rewards, values, mask, singletons, baselines)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    if name in GROUPED:
        assert (adv == 0).all()  # a group of one is its own baseline
    equal, _ = outcome_rewards([0.3] * 6, [4] * 6, 4)
    for config in (AlgorithmConfig(gamma=1.0, lam=0.95), AlgorithmConfig(norm_adv_by_std_in_grpo=False)):
        adv, ret = call(name, equal, torch.zeros(6, 4), torch.ones(6, 4), np.array(["g"] * 6), torch.zeros(6),
                        config)
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
        if name in GROUPED + ["reinforce_plus_plus"]:  # no signal to learn from (gamma = 1: equal returns)
            assert adv.abs().max().item() < 1e-5


@pytest.mark.parametrize("name", GROUPED)
def test_groups_follow_uid_not_prompt_text(name):
    text = np.array(["What is 2+2?"] * 4, dtype=object)  # one prompt text ...
    uids = np.array(["x", "x", "y", "y"], dtype=object)  # ... sampled as two prompt instances
    rewards, mask = outcome_rewards([1.0, 0.0, 3.0, 1.0], [1, 1, 1, 1], 1)
    by_uid = call(name, rewards, None, mask, uids, None)[0][:, 0]
    # each uid group is handled alone: the result for x equals a batch holding only x
    only_x = call(name, rewards[:2], None, mask[:2], uids[:2], None)[0][:, 0]
    if name != "reinforce_plus_plus_baseline":  # its batch whitening couples the groups
        assert by_uid[:2].tolist() == pytest.approx(only_x.tolist())
    by_text = call(name, rewards, None, mask, text, None)[0][:, 0]
    assert not torch.allclose(by_uid, by_text)
    if name == "rloo":
        # x: [1 - 0, 0 - 1] = [1, -1]; y: [3 - 1, 1 - 3] = [2, -2]; by text response 0 would get 1 - 4/3
        assert by_uid.tolist() == [1.0, -1.0, 2.0, -2.0]
        assert by_text[0].item() == pytest.approx(1 - 4 / 3)
