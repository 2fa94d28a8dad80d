"""DAPO's tensor math by hand: the overlong penalty window (eq. 13), overlong filtering of the loss (numerator and
denominator), and the informative-group test of dynamic sampling (eq. 11)."""

import numpy as np
import pytest
import torch

from hybridflow.algorithms import (LOSS_AGG_MODES, agg_loss, informative_groups, overlong_filter_mask,
                                   overlong_reward_penalty)


@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_overlong_penalty_below_inside_and_at_the_end_of_the_buffer(factor):
    # L_max = 32, L_cache = 8: no penalty up to 24 tokens, then (24 - L) / 8, reaching -1 at 32
    lengths = torch.tensor([1, 15, 24, 25, 28, 31, 32])
    expected = [0.0, 0.0, 0.0, -1 / 8, -4 / 8, -7 / 8, -1.0]
    got = overlong_reward_penalty(lengths, max_response_length=32, buffer_len=8, penalty_factor=factor)
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx([factor * e for e in expected], abs=1e-7)


def test_overlong_penalty_past_the_limit_and_bad_arguments():
    # a length above L_max (not produced by our rollouts, but eq. 13 defines it) is punished with -1
    assert overlong_reward_penalty(torch.tensor([40]), 32, 8, 2.0).tolist() == [-2.0]
    # a buffer of the whole response: the ramp starts at 0 tokens
    assert overlong_reward_penalty(torch.tensor([0, 16]), 32, 32).tolist() == pytest.approx([0.0, -0.5])
    with pytest.raises(ValueError, match="buffer length must be in"):
        overlong_reward_penalty(torch.tensor([1]), 32, 0)
    with pytest.raises(ValueError, match="buffer length must be in"):
        overlong_reward_penalty(torch.tensor([1]), 32, 33)
    with pytest.raises(ValueError, match="penalty_factor must be >= 0"):
        overlong_reward_penalty(torch.tensor([1]), 32, 8, -1.0)


# three responses of lengths 2, 4 (truncated: it filled all 4 slots without an eos) and 3; per-token loss 1
MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]])
TRUNCATED = torch.tensor([False, True, False])


def test_filtered_token_mean_of_ones_is_exactly_one():
    loss_mask, kept = overlong_filter_mask(MASK, TRUNCATED)
    assert loss_mask.tolist() == [[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]]
    assert kept.tolist() == [True, False, True]
    ones = torch.ones(3, 4)
    assert agg_loss(ones, loss_mask, "token-mean").item() == 1.0
    # the bug this guards against: the truncated tokens dropped from the numerator only (5 / 9, not 1)
    assert agg_loss(ones, loss_mask, "token-mean", num_tokens=MASK.sum()).item() == pytest.approx(5 / 9)
    # the sequence modes count the 2 kept sequences: sums (2 + 3) / 2, means (1 + 1) / 2, norm (2/4 + 3/4) / 2
    n = kept.sum()
    assert agg_loss(ones, loss_mask, "seq-mean-token-sum", num_seqs=n).item() == 2.5
    assert agg_loss(ones, loss_mask, "seq-mean-token-mean", num_seqs=n).item() == 1.0
    assert agg_loss(ones, loss_mask, "seq-mean-token-sum-norm", num_seqs=n).item() == 0.625


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_all_truncated_gives_loss_zero_and_finite_zero_gradients(mode):
    loss_mask, kept = overlong_filter_mask(MASK, torch.ones(3, dtype=torch.bool))
    assert not kept.any() and loss_mask.sum() == 0
    w = torch.tensor(2.0, requires_grad=True)
    per_token = w * torch.ones(3, 4)
    # the totals of an empty mini-batch are 0; the worker passes 1 instead (hybridflow.training.micro)
    loss = agg_loss(per_token, loss_mask, mode, num_tokens=1.0, num_seqs=1.0)
    loss.backward()
    assert loss.item() == 0.0 and w.grad.item() == 0.0 and torch.isfinite(w.grad)


def test_filter_mask_shape_error():
    with pytest.raises(ValueError, match=r"truncated must have shape \(3,\)"):
        overlong_filter_mask(MASK, torch.zeros(2, dtype=torch.bool))


def test_informative_groups_by_hand():
    uid = np.array(["a", "a", "b", "b", "c", "c", "d"], dtype=object)
    acc = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0])
    # a: mixed -> kept; b: all right, c: all wrong -> dropped; d: a group of one has nothing to compare
    assert informative_groups(uid, acc).tolist() == [True, True, False, False, False, False, False]
    # groups need not be contiguous; values are compared exactly
    assert informative_groups([0, 1, 0, 1], [0.5, 0.5, 0.5, 0.5 + 1e-9]).tolist() == [False, True, False, True]
    with pytest.raises(ValueError, match="must both be"):
        informative_groups(["a", "a"], [1.0])
