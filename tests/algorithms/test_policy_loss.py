"""PPO policy loss (clip, asymmetric clip, dual-clip) and value loss against hand-computed values."""

import math

import pytest
import torch

from hybridflow.algorithms import compute_policy_loss, compute_value_loss, get_policy_loss_fn
from hybridflow.config.schema import ActorConfig

# eps = 0.2, c = 3. One token per case; loss per token written out:
#  1. A=+1, r=1.1 inside the clip range:   max(-1.1, -1.1)              = -1.1   (grad -A r = -1.1)
#  2. A=+1, r=1.5 above 1+eps:             max(-1.5, -1.2)              = -1.2   (clipped, grad 0)
#  3. A=-1, r=0.5 below 1-eps:             max( 0.5,  0.8)              =  0.8   (clipped, grad 0)
#  4. A=-1, r=5   dual-clip:               min(max(5, 1.2), -A c = 3)   =  3     (dual-clipped, grad 0)
#  5. A=+2, r=0.5 below 1-eps but A>0:     max(-1.0, -1.6)              = -1.0   (not clipped, grad -1.0)
#  6. A=-1, r=1.5 above 1+eps but A<0:     max( 1.5,  1.2), below 3     =  1.5   (not clipped, grad 1.5)
# token-mean = (-1.1 - 1.2 + 0.8 + 3 - 1.0 + 1.5) / 6 = 2.0 / 6
RATIOS = [1.1, 1.5, 0.5, 5.0, 0.5, 1.5]
ADVANTAGES = [1.0, 1.0, -1.0, -1.0, 2.0, -1.0]
# d loss / d log_prob = d loss / d r * r = -A r on unclipped tokens, divided by 6 (token-mean)
GRAD = [-1.1 / 6, 0.0, 0.0, 0.0, -1.0 / 6, 1.5 / 6]


def case(pad_garbage=None):
    old = torch.tensor([[-1.0, -0.5, -2.0, -3.0, -1.5, -0.7]])
    new = old + torch.log(torch.tensor([RATIOS]))
    adv = torch.tensor([ADVANTAGES])
    mask = torch.ones(1, 6)
    if pad_garbage is not None:  # one extra padded token holding garbage
        old = torch.cat([old, torch.tensor([[pad_garbage]])], 1)
        new = torch.cat([new, torch.tensor([[-pad_garbage]])], 1)
        adv = torch.cat([adv, torch.tensor([[pad_garbage]])], 1)
        mask = torch.cat([mask, torch.zeros(1, 1)], 1)
    return old, new.requires_grad_(), adv, mask


def test_policy_loss_by_hand_with_gradients():
    old, new, adv, mask = case()
    loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(old, new, adv, mask, cliprange=0.2, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx(2.0 / 6, abs=1e-6)
    assert clipfrac.item() == pytest.approx(2 / 6)  # tokens 2 and 3
    assert clipfrac_lower.item() == pytest.approx(1 / 6)  # token 4
    assert ppo_kl.item() == pytest.approx(-sum(math.log(r) for r in RATIOS) / 6, abs=1e-6)
    loss.backward()
    assert new.grad[0].tolist() == pytest.approx(GRAD, abs=1e-6)
    assert (new.grad[0, 1:4] == 0).all()  # exactly zero on the clipped tokens


@pytest.mark.parametrize("garbage", [1e4, -1e4, float("nan")])
def test_padding_garbage_changes_neither_loss_nor_gradient(garbage):
    old, new, adv, mask = case(pad_garbage=garbage)
    loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(old, new, adv, mask, cliprange=0.2)
    assert loss.item() == pytest.approx(2.0 / 6, abs=1e-6)
    assert clipfrac.item() == pytest.approx(2 / 6) and clipfrac_lower.item() == pytest.approx(1 / 6)
    assert math.isfinite(ppo_kl.item())
    loss.backward()
    assert new.grad[0, :6].tolist() == pytest.approx(GRAD, abs=1e-6)
    assert new.grad[0, 6].item() == 0.0


def test_asymmetric_clip_by_hand():
    # eps_low = 0.2, eps_high = 0.28:
    #  A=+1, r=1.25: inside [0.8, 1.28] -> -1.25 (symmetric 0.2 would clip it to -1.2)
    #  A=+1, r=1.5:  max(-1.5, -1.28)   -> -1.28
    #  A=-1, r=0.7:  max(0.7, 0.8)      ->  0.8
    # token-mean = (-1.25 - 1.28 + 0.8) / 3 = -1.73 / 3
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[1.25, 1.5, 0.7]]))
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    loss, clipfrac, _, _ = compute_policy_loss(old, new, adv, torch.ones(1, 3), cliprange=0.2, cliprange_high=0.28)
    assert loss.item() == pytest.approx(-1.73 / 3, abs=1e-6)
    assert clipfrac.item() == pytest.approx(2 / 3)
    # same through the registry with an actor config
    cfg = ActorConfig(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28)
    loss2, *_ = get_policy_loss_fn("vanilla")(old, new, adv, torch.ones(1, 3), "token-mean", cfg)
    assert loss2.item() == pytest.approx(-1.73 / 3, abs=1e-6)


def test_dual_clip_constant_changes_the_cap():
    # A=-2, r=10, c=4: max(20, 2*1.2=2.4) = 20 -> min(20, -A c = 8) = 8
    old, new = torch.zeros(1, 1), torch.log(torch.tensor([[10.0]]))
    loss, _, _, lower = compute_policy_loss(old, new, torch.tensor([[-2.0]]), torch.ones(1, 1), cliprange=0.2,
                                            clip_ratio_c=4.0)
    assert loss.item() == pytest.approx(8.0) and lower.item() == 1.0


def test_policy_loss_forwards_aggregation_arguments():
    old, new, adv, mask = case()
    # seq-mean-token-sum with num_seqs=4: sum 2.0 / 4
    loss, *_ = compute_policy_loss(old, new, adv, mask, cliprange=0.2, loss_agg_mode="seq-mean-token-sum", num_seqs=4)
    assert loss.item() == pytest.approx(0.5, abs=1e-6)
    loss, *_ = compute_policy_loss(old, new, adv, mask, cliprange=0.2, num_tokens=10)
    assert loss.item() == pytest.approx(0.2, abs=1e-6)


def test_policy_loss_errors():
    old, new, adv, mask = case()
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        compute_policy_loss(old, new, adv, mask, cliprange=0.2, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="needs cliprange"):
        compute_policy_loss(old, new, adv, mask)
    with pytest.raises(ValueError, match="shape mismatch"):
        compute_policy_loss(old, new, adv[:, :3], mask, cliprange=0.2)


def test_value_loss_by_hand():
    # cliprange 0.5, old values [1, 1]:
    #  token 1: v=2 -> clipped to 1.5; (2-3)^2 = 1, (1.5-3)^2 = 2.25 -> 2.25 (clipped branch)
    #  token 2: v=1.2 inside; (1.2-0)^2 = 1.44 both
    #  token 3: padded (garbage)
    # vf_loss = 0.5 * (2.25 + 1.44) / 2 = 0.9225; clipfrac 1/2
    vpreds = torch.tensor([[2.0, 1.2, float("nan")]], requires_grad=True)
    returns = torch.tensor([[3.0, 0.0, 1e9]])
    values = torch.tensor([[1.0, 1.0, -5.0]])
    mask = torch.tensor([[1, 1, 0]])
    vf_loss, vf_clipfrac = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.5)
    assert vf_loss.item() == pytest.approx(0.9225, abs=1e-6)
    assert vf_clipfrac.item() == 0.5
    vf_loss.backward()
    # token 1 on the clipped branch (constant in v) -> 0; token 2: 0.5 * 2 * 1.2 / 2 = 0.6
    assert vpreds.grad[0].tolist() == pytest.approx([0.0, 0.6, 0.0], abs=1e-6)
