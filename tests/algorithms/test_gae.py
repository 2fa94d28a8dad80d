"""GAE: a hand-worked example, a slow pure-Python reference, and padding invariants."""

import math
import random
import statistics

import pytest
import torch

from hybridflow.algorithms import compute_gae_advantage_return, get_adv_estimator_fn
from hybridflow.config.schema import AlgorithmConfig


def whiten_reference(xs):
    mean, var = statistics.mean(xs), statistics.variance(xs)  # unbiased variance
    return [(x - mean) / math.sqrt(var + 1e-8) for x in xs]


def test_gae_1x3_by_hand():
    # gamma = lam = 0.5, so gamma * lam = 0.25; r = [1, 0, 2], V = [1, 2, 4]
    # t=2 (last): delta = 2 + 0.5*0 - 4 = -2          A2 = -2
    # t=1:        delta = 0 + 0.5*4 - 2 =  0          A1 = 0 + 0.25*(-2)   = -0.5
    # t=0:        delta = 1 + 0.5*2 - 1 =  1          A0 = 1 + 0.25*(-0.5) = 0.875
    # returns = A + V = [1.875, 1.5, 2]
    rewards = torch.tensor([[1.0, 0.0, 2.0]])
    values = torch.tensor([[1.0, 2.0, 4.0]])
    adv, ret = compute_gae_advantage_return(rewards, values, torch.ones(1, 3), gamma=0.5, lam=0.5)
    assert ret.dtype == adv.dtype == torch.float32
    assert ret.tolist() == [[1.875, 1.5, 2.0]]
    assert adv[0].tolist() == pytest.approx(whiten_reference([0.875, -0.5, -2.0]), abs=1e-6)


def test_gae_right_padding_by_hand():
    # same row as above plus one padded token holding garbage reward 7 and value 100: unchanged
    rewards = torch.tensor([[1.0, 0.0, 2.0, 7.0]])
    values = torch.tensor([[1.0, 2.0, 4.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=0.5, lam=0.5)
    assert ret.tolist() == [[1.875, 1.5, 2.0, 0.0]]
    assert adv[0, 3].item() == 0.0


def test_gae_hole_in_mask_carries_next_valid_value():
    # mask [1, 0, 1]: the middle token is skipped; gamma = lam = 0.5
    # t=2: delta = 2 - 4 = -2, A2 = -2
    # t=0: next valid is t=2: delta = 1 + 0.5*4 - 1 = 2, A0 = 2 + 0.25*(-2) = 1.5
    # returns = [1.5 + 1, 0 (masked), -2 + 4] = [2.5, 0, 2]
    rewards = torch.tensor([[1.0, 9.0, 2.0]])
    values = torch.tensor([[1.0, 50.0, 4.0]])
    adv, ret = compute_gae_advantage_return(rewards, values, torch.tensor([[1.0, 0.0, 1.0]]), 0.5, 0.5)
    assert ret.tolist() == [[2.5, 0.0, 2.0]]
    assert adv[0].tolist() == pytest.approx([1 / math.sqrt(2 + 1e-8), 0.0, -1 / math.sqrt(2 + 1e-8)], abs=1e-6)


def reference_gae(rewards, values, mask, gamma, lam):
    """Slow reference: compress each row to its valid tokens, run textbook GAE, scatter back."""
    batch, length = len(rewards), len(rewards[0])
    adv = [[0.0] * length for _ in range(batch)]
    ret = [[0.0] * length for _ in range(batch)]
    for i in range(batch):
        idx = [t for t in range(length) if mask[i][t]]
        next_value, next_adv = 0.0, 0.0
        for t in reversed(idx):
            delta = rewards[i][t] + gamma * next_value - values[i][t]
            next_adv = delta + gamma * lam * next_adv
            next_value = values[i][t]
            adv[i][t] = next_adv
            ret[i][t] = next_adv + values[i][t]
    flat = [adv[i][t] for i in range(batch) for t in range(length) if mask[i][t]]
    white = iter(whiten_reference(flat))
    adv = [[next(white) if mask[i][t] else 0.0 for t in range(length)] for i in range(batch)]
    return adv, ret


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("holes", [False, True])
def test_gae_matches_slow_reference(seed, holes):
    rng = random.Random(seed)
    batch, length = 5, 11
    gamma, lam = rng.uniform(0.8, 1.0), rng.uniform(0.5, 1.0)
    rewards = [[rng.gauss(0, 1) for _ in range(length)] for _ in range(batch)]
    values = [[rng.gauss(0, 1) for _ in range(length)] for _ in range(batch)]
    mask = []
    for _ in range(batch):
        n = rng.randint(1, length)  # random right padding
        row = [1 if t < n else 0 for t in range(length)]
        if holes:
            row = [m if rng.random() > 0.3 else 0 for m in row]
            row[0] = 1
        mask.append(row)
    adv, ret = compute_gae_advantage_return(torch.tensor(rewards), torch.tensor(values), torch.tensor(mask),
                                            gamma, lam)
    exp_adv, exp_ret = reference_gae(rewards, values, mask, gamma, lam)
    assert torch.allclose(ret, torch.tensor(exp_ret), atol=1e-5)
    assert torch.allclose(adv, torch.tensor(exp_adv), atol=1e-5)


def test_values_and_rewards_at_padding_do_not_matter():
    gen = torch.Generator().manual_seed(3)
    rewards, values = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
    mask = (torch.arange(8)[None] < torch.tensor([[8], [3], [1], [6]])).float()
    base = compute_gae_advantage_return(rewards, values, mask, 0.99, 0.95)
    pad = mask == 0
    for garbage in (1e6, -1e6, float("nan"), float("inf")):
        garbage_values = values.masked_fill(pad, garbage)
        garbage_rewards = rewards.masked_fill(pad, garbage)
        out = compute_gae_advantage_return(garbage_rewards, garbage_values, mask, 0.99, 0.95)
        assert torch.equal(out[0], base[0]) and torch.equal(out[1], base[1])


def test_gamma_lam_one_terminal_reward_gives_returns_equal_final_reward():
    gen = torch.Generator().manual_seed(4)
    lengths = [5, 2, 7]
    values = torch.randn(3, 7, generator=gen)
    rewards = torch.zeros(3, 7)
    final = [1.5, -2.0, 0.25]
    for i, (n, r) in enumerate(zip(lengths, final)):
        rewards[i, n - 1] = r
    mask = (torch.arange(7)[None] < torch.tensor(lengths)[:, None]).int()
    _, ret = compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=1.0)
    for i, (n, r) in enumerate(zip(lengths, final)):
        assert ret[i, :n].tolist() == pytest.approx([r] * n, abs=1e-5)
        assert (ret[i, n:] == 0).all()


def test_gae_through_registry_reads_gamma_lam_from_config():
    rewards = torch.tensor([[1.0, 0.0, 2.0]])
    values = torch.tensor([[1.0, 2.0, 4.0]])
    fn = get_adv_estimator_fn("gae")
    _, ret = fn(token_level_rewards=rewards, values=values, response_mask=torch.ones(1, 3), index=None,
                config=AlgorithmConfig(gamma=0.5, lam=0.5))
    assert ret.tolist() == [[1.875, 1.5, 2.0]]  # hand-worked in test_gae_1x3_by_hand
    # explicit keywords win over the config
    _, ret = fn(token_level_rewards=rewards, values=values, response_mask=torch.ones(1, 3), gamma=1.0, lam=1.0,
                config=AlgorithmConfig(gamma=0.5, lam=0.5))
    assert ret.tolist() == [[3.0, 2.0, 2.0]]  # gamma=lam=1: returns are reward-to-go


def test_gae_errors():
    with pytest.raises(ValueError, match="shape"):
        compute_gae_advantage_return(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), 1.0, 1.0)
    with pytest.raises(TypeError, match="'gae' needs 'values'"):
        get_adv_estimator_fn("gae")(token_level_rewards=torch.zeros(2, 3), response_mask=torch.ones(2, 3),
                                    values=None, config=AlgorithmConfig())


@pytest.mark.parametrize("discount", [0.0, 0.5, 0.97, 1.0])
def test_discounted_reverse_cumsum_across_blocks_equals_the_loop(discount):
    from hybridflow.algorithms.advantage import discounted_reverse_cumsum

    x = torch.randn(3, 21, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    expected = torch.zeros_like(x)
    running = torch.zeros(3, dtype=torch.float64)
    for t in reversed(range(21)):  # y_t = x_t + discount * y_{t+1}
        running = x[:, t] + discount * running
        expected[:, t] = running
    for block in (4, 7, 21, 64):  # several blocks (with a short first one), one exact block, one larger block
        torch.testing.assert_close(discounted_reverse_cumsum(x, discount, block=block), expected)


def test_gae_matches_slow_reference_on_a_response_longer_than_a_block():
    rng = random.Random(7)
    batch, length, gamma, lam = 3, 300, 0.99, 0.95
    rewards = [[rng.gauss(0, 1) for _ in range(length)] for _ in range(batch)]
    values = [[rng.gauss(0, 1) for _ in range(length)] for _ in range(batch)]
    mask = [[1 if t < n and rng.random() > 0.1 else 0 for t in range(length)] for n in (300, 280, 3)]
    adv, ret = compute_gae_advantage_return(torch.tensor(rewards), torch.tensor(values), torch.tensor(mask),
                                            gamma, lam)
    exp_adv, exp_ret = reference_gae(rewards, values, mask, gamma, lam)
    assert torch.allclose(ret, torch.tensor(exp_ret), atol=1e-4)
    assert torch.allclose(adv, torch.tensor(exp_adv), atol=1e-4)
