"""GRPO outcome advantages: grouping by uid, degenerate groups, hand-computed values."""

import math

import numpy as np
import pytest
import torch

from hybridflow.algorithms import compute_grpo_outcome_advantage, get_adv_estimator_fn
from hybridflow.config.assemble import section_class

AlgorithmConfig = section_class("algorithm")  # with every registered estimator's and driver's keys


def outcome_rewards(scores, lengths, length):
    """Token rewards with each score on the last valid token, and the matching right-padded mask."""
    rewards = torch.zeros(len(scores), length)
    mask = torch.zeros(len(scores), length)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        rewards[i, n - 1] = s
        mask[i, :n] = 1
    return rewards, mask


def test_group_of_three_by_hand():
    # scores [1, 2, 3]: mean 2, unbiased std sqrt((1 + 0 + 1) / 2) = 1 -> A = [-1, 0, 1] / (1 + 1e-6)
    rewards, mask = outcome_rewards([1.0, 2.0, 3.0], [2, 3, 1], 3)
    adv, ret = compute_grpo_outcome_advantage(rewards, mask, np.array(["u", "u", "u"]))
    expected = [[-1 / (1 + 1e-6)] * 2 + [0.0], [0.0] * 3, [1 / (1 + 1e-6), 0.0, 0.0]]
    assert torch.allclose(adv, torch.tensor(expected))
    assert adv.dtype == torch.float32
    assert torch.equal(ret, adv)


def test_same_prompt_text_different_uid_are_separate_groups():
    prompts = np.array(["What is 2+2?"] * 4, dtype=object)  # identical text ...
    uids = np.array(["a", "a", "b", "b"], dtype=object)  # ... two prompt instances
    rewards, mask = outcome_rewards([1.0, 0.0, 0.0, 0.0], [1, 1, 1, 1], 1)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, uids)
    # group a: mean 0.5, unbiased std sqrt(2 * 0.25 / 1) = sqrt(0.5) -> +-0.5 / sqrt(0.5) = +-sqrt(0.5)
    # group b: all 0 -> 0. (Grouping by the text would give mean 0.25 and different values.)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert adv[:, 0].tolist() == pytest.approx([a, -a, 0.0, 0.0])
    by_text, _ = compute_grpo_outcome_advantage(rewards, mask, prompts)
    assert not torch.allclose(by_text, adv)


def test_group_of_size_one_gets_zero():
    rewards, mask = outcome_rewards([5.0, 1.0, 3.0], [2, 2, 2], 2)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, np.array([7, 8, 8]))
    assert adv[0].tolist() == [0.0, 0.0]
    assert adv[1, 0].item() == pytest.approx(-1 / (math.sqrt(2) + 1e-6))  # scores 1, 3: mean 2, std sqrt(2)


@pytest.mark.parametrize("norm", [True, False])
def test_all_equal_rewards_give_zero_and_finite(norm):
    rewards, mask = outcome_rewards([0.1, 0.1, 0.1, 0.7, 0.7], [3, 1, 2, 3, 3], 3)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, np.array(["x", "x", "x", "y", "y"]),
                                            norm_adv_by_std_in_grpo=norm)
    assert torch.isfinite(adv).all()
    assert adv.abs().max().item() < 1e-6


def test_without_std_normalization_is_score_minus_mean():
    rewards, mask = outcome_rewards([1.0, 0.0, 4.0, 2.0], [1, 2, 1, 2], 2)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, np.array([0, 0, 1, 1]), norm_adv_by_std_in_grpo=False)
    assert adv.tolist() == [[0.5, 0.0], [-0.5, -0.5], [1.0, 0.0], [-1.0, -1.0]]


def test_score_is_sum_of_valid_token_rewards_and_padding_ignored():
    # row 0: rewards 1 + 2 over valid tokens = 3 (garbage 100 on the padded token is ignored); row 1: 1
    rewards = torch.tensor([[1.0, 2.0, 100.0], [0.0, 0.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, ["g", "g"], norm_adv_by_std_in_grpo=False)
    assert adv.tolist() == [[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]]


def test_registry_call_reads_norm_flag_from_config_and_ignores_unused_inputs():
    rewards, mask = outcome_rewards([1.0, 0.0], [1, 1], 1)
    adv, _ = get_adv_estimator_fn("grpo")(token_level_rewards=rewards, response_mask=mask, values=None,
                                          index=np.array(["p", "p"]),
                                          config=AlgorithmConfig(norm_adv_by_std_in_grpo=False))
    assert adv.tolist() == [[0.5], [-0.5]]


def test_index_length_mismatch():
    rewards, mask = outcome_rewards([1.0, 0.0], [1, 1], 1)
    with pytest.raises(ValueError, match=r"index must have shape \(2,\)"):
        compute_grpo_outcome_advantage(rewards, mask, np.array(["a", "a", "b"]))
