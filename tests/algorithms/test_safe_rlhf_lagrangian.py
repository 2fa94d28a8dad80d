"""Safe-RLHF Lagrange multiplier (log-space ascent on a cost window) and the combined advantage."""

import math

import pytest
import torch

from hybridflow.algorithms import LagrangeMultiplier, compute_safe_rlhf_advantage


def test_update_rule_by_hand():
    # threshold 1, lr 0.5, window 4, lambda_0 = 1 (log 0)
    # step 1: costs [3, 1]        window [3, 1]        mean 2    log += 0.5 * (2 - 1) = 0.5
    # step 2: costs [0, 0]        window [3, 1, 0, 0]  mean 1    log += 0               = 0.5
    # step 3: costs [0]           window [1, 0, 0, 0]  mean 0.25 log += 0.5 * -0.75     = 0.125
    lag = LagrangeMultiplier(init_lambda=1.0, lambda_lr=0.5, threshold=1.0, window=4)
    assert lag.update([3.0, 1.0]) == pytest.approx(math.exp(0.5))
    assert lag.mean_cost == 2.0
    assert lag.update(torch.tensor([0.0, 0.0])) == pytest.approx(math.exp(0.5))
    assert lag.update([0.0]) == pytest.approx(math.exp(0.125))
    assert lag.mean_cost == 0.25 and lag.log_lambda == pytest.approx(0.125)


def test_paper_eq31_rule_scales_the_step_by_lambda():
    # lambda_0 = 2: log 2 + 0.1 * 2 * (3 - 1) = log 2 + 0.4
    lag = LagrangeMultiplier(init_lambda=2.0, lambda_lr=0.1, threshold=1.0, scale_by_lambda=True)
    assert lag.update([3.0]) == pytest.approx(2.0 * math.exp(0.4))


def test_lambda_rises_above_threshold_falls_below_and_respects_bounds():
    lag = LagrangeMultiplier(init_lambda=0.5, lambda_lr=0.2, threshold=0.3, max_lambda=4.0, window=8)
    history = [lag.value]
    # mean cost 0.85 > 0.3: log lambda grows by 0.2 * 0.55 = 0.11 a step and reaches log 4 after 19 steps
    high = [[0.9, 0.7, 0.8, 1.0]] * 30
    low = [[0.0, 0.1, 0.0, 0.0]] * 40  # mean cost 0.025 < 0.3 once the window holds only these
    for costs in high:
        history.append(lag.update(costs))
    rising = history[1:len(high) + 1]
    assert all(b > a for a, b in zip(history[:19], rising[:19]))  # strictly rising until the cap
    assert all(b >= a for a, b in zip(history, rising))  # then held at the cap
    assert max(history) == pytest.approx(4.0) and lag.value == pytest.approx(4.0)  # capped, not past
    for costs in low:
        history.append(lag.update(costs))
    falling = history[len(high) + 2:]  # after one step the window (8 episodes) holds only low costs
    assert all(b < a for a, b in zip(falling, falling[1:]))
    assert history[-1] < 0.5
    assert all(v >= 0 for v in history)
    # and it rises again from a small value as fast as it fell: the step in log space does not scale with lambda
    before = lag.log_lambda
    lag.update([0.85] * 8)
    assert lag.log_lambda - before == pytest.approx(0.2 * (0.85 - 0.3))


def test_state_dict_round_trip_resumes_exactly():
    a = LagrangeMultiplier(init_lambda=1.0, lambda_lr=0.3, threshold=0.5, window=3)
    a.update([1.0, 2.0])
    b = LagrangeMultiplier(init_lambda=1.0, lambda_lr=0.3, threshold=0.5, window=3)
    b.load_state_dict(a.state_dict())
    assert b.value == a.value and b.mean_cost == a.mean_cost
    assert b.update([0.0, 0.0]) == a.update([0.0, 0.0])


def test_validation():
    with pytest.raises(ValueError, match="init_lambda must be > 0"):
        LagrangeMultiplier(init_lambda=0.0, lambda_lr=0.1, threshold=0.0)
    with pytest.raises(ValueError, match="max_lambda"):
        LagrangeMultiplier(init_lambda=2.0, lambda_lr=0.1, threshold=0.0, max_lambda=1.0)
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        LagrangeMultiplier(init_lambda=1.0, lambda_lr=0.1, threshold=0.0, window=0)
    with pytest.raises(ValueError, match="lambda_lr must be >= 0"):
        LagrangeMultiplier(init_lambda=1.0, lambda_lr=-1.0, threshold=0.0)
    lag = LagrangeMultiplier(init_lambda=1.0, lambda_lr=0.1, threshold=0.0)
    with pytest.raises(ValueError, match="no episode cost given yet"):
        lag.update([])
    with pytest.raises(ValueError, match="must be finite"):
        lag.update([1.0, float("nan")])
    assert lag.mean_cost is None


def test_combined_advantage_by_hand():
    # lambda = 3: (A_r - 3 A_c) / 4
    #   (2 - 3*1) / 4 = -0.25;  (1 - 3*(-1)) / 4 = 1;  padding (0 - 0) / 4 = 0
    a_r = torch.tensor([[2.0, 1.0, 0.0]])
    a_c = torch.tensor([[1.0, -1.0, 0.0]])
    assert compute_safe_rlhf_advantage(a_r, a_c, 3.0).tolist() == [[-0.25, 1.0, 0.0]]
    assert compute_safe_rlhf_advantage(a_r, a_c, torch.tensor(0.0)).tolist() == a_r.tolist()  # lambda 0: reward only
    with pytest.raises(ValueError, match="lagrange_lambda must be finite and >= 0"):
        compute_safe_rlhf_advantage(a_r, a_c, -1.0)
    with pytest.raises(ValueError, match="same shape"):
        compute_safe_rlhf_advantage(a_r, a_c[:, :2], 1.0)


def _steps_to_reach(lag, target, costs):
    steps = 0
    while lag.value < target:
        lag.update(costs)
        steps += 1
    return steps


def test_floor_bounds_how_low_lambda_goes_and_how_long_it_takes_to_recover():
    # threshold 0.5, lr 1, window 1: a zero-cost step moves log lambda by -0.5, a cost-1.5 step by +1
    floored = LagrangeMultiplier(init_lambda=1.0, lambda_lr=1.0, threshold=0.5, window=1, min_lambda=0.01)
    unfloored = LagrangeMultiplier(init_lambda=1.0, lambda_lr=1.0, threshold=0.5, window=1, min_lambda=0.0)
    for _ in range(9):  # log lambda = -4.5 > log 0.01 = -4.605: not yet at the floor
        floored.update([0.0])
    assert floored.log_lambda == pytest.approx(-4.5)
    for _ in range(991):  # 1000 zero-cost steps in all
        floored.update([0.0])
    for _ in range(1000):
        unfloored.update([0.0])
    assert floored.value == pytest.approx(0.01)
    assert unfloored.log_lambda == pytest.approx(-500.0)  # lambda = exp(-500) ~ 7e-218
    # back to lambda >= 1: from the floor ceil(log(100) / 1) = ceil(4.605) = 5 steps; without it 500
    assert _steps_to_reach(floored, 1.0, [1.5]) == 5
    assert floored.value == pytest.approx(0.01 * math.exp(5))
    assert _steps_to_reach(unfloored, 1.0, [1.5]) == 500


def test_floor_also_holds_for_the_paper_eq31_rule():
    # eq. 31 steps by lr * lambda * violation: 0.5 * 1 * (0 - 2) = -1 -> log lambda = -1 < log 0.5: floored
    lag = LagrangeMultiplier(init_lambda=1.0, lambda_lr=0.5, threshold=2.0, scale_by_lambda=True, min_lambda=0.5)
    assert lag.update([0.0]) == pytest.approx(0.5)


def test_floor_validation():
    with pytest.raises(ValueError, match=r"min_lambda must be in \[0, init_lambda=1.0\]"):
        LagrangeMultiplier(init_lambda=1.0, lambda_lr=0.1, threshold=0.0, min_lambda=2.0)
    with pytest.raises(ValueError, match="min_lambda"):
        LagrangeMultiplier(init_lambda=1.0, lambda_lr=0.1, threshold=0.0, min_lambda=-0.1)
