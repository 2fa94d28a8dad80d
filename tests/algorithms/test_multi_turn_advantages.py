"""Outcome rewards through observation spans: for every estimator, a multi-turn response (model turns with
observation spans of mask 0 between them) gets, on its model tokens, exactly the advantages and returns of the
compact response without the observations; the score is placed on the last model token (not at index
``mask.sum() - 1``, which falls inside or before an observation span)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from types import SimpleNamespace

from hybridflow.algorithms import get_adv_estimator_fn
from hybridflow.workers.reward_worker import place_scores

# per row: model-span lengths; observations of OBS_LEN tokens go between consecutive spans
MODEL_SPANS = [[3, 2], [4], [1, 1, 2], [2, 3], [5], [1, 4]]
OBS_LEN = [3, 0, 2, 4, 0, 1]
SCORES = torch.tensor([1.0, 0.0, 1.0, 0.5, -1.0, 2.0])
UIDS = np.array(["a", "a", "a", "b", "b", "b"], dtype=object)
ESTIMATORS = ["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"]


def layouts(seed: int = 0):
    """(compact, multi-turn) batches: ``mask``, ``model_pos`` (per row, the multi-turn positions of the model
    tokens in order), per-token rewards (a KL-like term on every model token + the score on the last one, placed
    by place_scores) and values; observation positions hold garbage rewards/values."""
    g = torch.Generator().manual_seed(seed)
    width_c = max(sum(s) for s in MODEL_SPANS) + 1
    width_m = max(sum(s) + o * (len(s) - 1) for s, o in zip(MODEL_SPANS, OBS_LEN)) + 2
    mask_c, mask_m = torch.zeros(6, width_c), torch.zeros(6, width_m)
    model_pos = []
    for row, (spans, obs) in enumerate(zip(MODEL_SPANS, OBS_LEN)):
        pos, at = [], 0
        for k, length in enumerate(spans):
            pos += list(range(at, at + length))
            at += length + (obs if k < len(spans) - 1 else 0)
        model_pos.append(pos)
        mask_m[row, pos] = 1
        mask_c[row, : len(pos)] = 1
    kl_c = torch.randn(6, width_c, generator=g) * 0.1 * mask_c
    values_c = torch.randn(6, width_c, generator=g) * mask_c
    rewards_c = kl_c + place_scores(SCORES, mask_c)
    garbage = torch.randn(6, width_m, generator=g) * 100
    rewards_m, values_m = garbage.clone(), garbage.clone()
    kl_m = torch.zeros(6, width_m)
    for row, pos in enumerate(model_pos):
        kl_m[row, pos] = kl_c[row, : len(pos)]
        values_m[row, pos] = values_c[row, : len(pos)]
    rewards_m = torch.where(mask_m.bool(), kl_m + place_scores(SCORES, mask_m), garbage)
    return (mask_c, rewards_c, values_c), (mask_m, rewards_m, values_m), model_pos


def test_place_scores_puts_the_score_on_the_last_model_token():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 0], [1, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]])
    out = place_scores(torch.tensor([2.0, 3.0, 4.0]), mask)
    expected = torch.zeros(3, 7)
    expected[0, 4], expected[1, 0] = 2.0, 3.0  # row 2 has no model token: no reward
    assert torch.equal(out, expected)


@pytest.mark.parametrize("name", ESTIMATORS)
def test_observation_spans_are_transparent_to_the_estimator(name):
    (mask_c, rewards_c, values_c), (mask_m, rewards_m, values_m), model_pos = layouts()
    config = SimpleNamespace(gamma=0.9, lam=0.8, norm_adv_by_std_in_grpo=True)
    fn = get_adv_estimator_fn(name)
    baselines = torch.tensor([0.3, 0.3, 0.3, -0.2, -0.2, -0.2])
    adv_c, ret_c = fn(token_level_rewards=rewards_c, response_mask=mask_c, values=values_c, index=UIDS,
                      reward_baselines=baselines, config=config)
    adv_m, ret_m = fn(token_level_rewards=rewards_m, response_mask=mask_m, values=values_m, index=UIDS,
                      reward_baselines=baselines, config=config)
    for row, pos in enumerate(model_pos):
        n = len(pos)
        torch.testing.assert_close(adv_m[row, pos], adv_c[row, :n], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ret_m[row, pos], ret_c[row, :n], rtol=1e-5, atol=1e-6)
        # the score reached the first model token of the first turn (an outcome estimator gives every token the
        # sequence's share; nothing stops at the first observation)
        assert adv_m[row, pos[0]] != 0 or adv_c[row, 0] == 0
    assert torch.all(adv_m[mask_m == 0] == 0) and torch.all(ret_m[mask_m == 0] == 0)


def test_outcome_score_before_the_fix_would_be_lost():
    """The old placement (index ``mask.sum() - 1``) lands inside an observation span for row 0, so every
    estimator would see a score of 0 there: the placement is what carries the reward through the spans."""
    (_, _, _), (mask_m, _, _), model_pos = layouts()
    old_index = int(mask_m[0].sum()) - 1
    assert mask_m[0, old_index] == 0 and place_scores(SCORES, mask_m)[0, model_pos[0][-1]] == SCORES[0]
