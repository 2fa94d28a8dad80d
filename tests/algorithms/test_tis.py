"""Truncated importance sampling (actor.tis_imp_ratio_cap) in the vanilla and gspo policy losses."""

import math

import pytest
import torch

from hybridflow.algorithms import compute_policy_loss, get_policy_loss_fn
from hybridflow.config.schema import ActorConfig

NAN = float("nan")
# Three tokens of one sequence. TIS ratio old/rollout = [0.5, 1.5, 4] -> with cap 2 the weights are [0.5, 1.5, 2].
# PPO ratio pi/old = [1.0, 1.1, 0.9], inside the clip range [0.8, 1.2] (and below the dual-clip cap), so the
# per-token loss is -A r = [-1, 1.1, -1.8] with A = [1, -1, 2]; weighted: [-0.5, 1.65, -3.6]; token-mean / 3.
OLD = [-1.0, -2.0, -0.5]
TIS_RATIO = [0.5, 1.5, 4.0]
PPO_RATIO = [1.0, 1.1, 0.9]
ADV = [1.0, -1.0, 2.0]
CAP = 2.0
LOSS = (-0.5 + 1.65 - 3.6) / 3
GRAD = [-0.5 / 3, 1.65 / 3, -3.6 / 3]  # -A r w / 3


def case(pad=None):
    """(old, new, adv, mask, rollout); ``pad`` appends a padded token holding that garbage everywhere."""
    old = torch.tensor([OLD])
    rollout = old - torch.log(torch.tensor([TIS_RATIO]))
    new = old + torch.log(torch.tensor([PPO_RATIO]))
    adv = torch.tensor([ADV])
    mask = torch.ones(1, 3)
    if pad is not None:
        old, rollout, new, adv = (torch.cat([x, torch.tensor([[pad]])], 1) for x in (old, rollout, new, adv))
        mask = torch.cat([mask, torch.zeros(1, 1)], 1)
    return old, new.requires_grad_(), adv, mask, rollout


def vanilla(cap, rollout, *tensors, mode="token-mean"):
    return get_policy_loss_fn("vanilla")(*tensors, mode, ActorConfig(tis_imp_ratio_cap=cap), rollout_log_probs=rollout)


@pytest.mark.parametrize("garbage", [None, NAN, 1e6])
def test_vanilla_tis_by_hand(garbage):
    old, new, adv, mask, rollout = case(garbage)
    rollout.requires_grad_()
    loss, clipfrac, ppo_kl, lower = vanilla(CAP, rollout, old, new, adv, mask)
    assert loss.item() == pytest.approx(LOSS, abs=1e-6)
    # the metrics are the unweighted PPO ones
    assert clipfrac.item() == 0.0 and lower.item() == 0.0
    assert ppo_kl.item() == pytest.approx(-sum(math.log(r) for r in PPO_RATIO) / 3, abs=1e-6)
    loss.backward()
    assert new.grad[0, :3].tolist() == pytest.approx(GRAD, abs=1e-6)
    if garbage is not None:
        assert new.grad[0, 3].item() == 0.0
    assert rollout.grad is None  # the weight is a constant


@pytest.mark.parametrize("cap", [-1.0, 0.0])
def test_tis_off_is_vanilla_exactly(cap):
    old, new, adv, mask, rollout = case()
    reference, *ref_metrics = compute_policy_loss(old, new, adv, mask, cliprange=0.2)
    (ref_grad,) = torch.autograd.grad(reference, new)
    for given in (rollout, None):  # off: rollout_log_probs is neither needed nor used
        loss, *metrics = vanilla(cap, given, old, new, adv, mask)
        (grad,) = torch.autograd.grad(loss, new)
        assert torch.equal(loss, reference) and torch.equal(grad, ref_grad)
        assert all(torch.equal(a, b) for a, b in zip(metrics, ref_metrics))
    # the schema default is off
    assert ActorConfig().tis_imp_ratio_cap <= 0


def test_tis_weights_apply_before_aggregation():
    # seq-mean-token-sum with num_seqs = 2: the weighted sum (-0.5 + 1.65 - 3.6) / 2
    old, new, adv, mask, rollout = case()
    loss, *_ = get_policy_loss_fn("vanilla")(old, new, adv, mask, "seq-mean-token-sum",
                                             ActorConfig(tis_imp_ratio_cap=CAP), rollout_log_probs=rollout, num_seqs=2)
    assert loss.item() == pytest.approx((-0.5 + 1.65 - 3.6) / 2, abs=1e-6)


def test_gspo_tis_by_hand():
    # pi = old, so the sequence ratio is s = 1 (inside the clip range) and each token's loss is -A s = -1;
    # TIS weights [0.5, 1.5, 2 (4 capped)] -> seq-mean-token-mean = mean(-0.5, -1.5, -2) over one sequence;
    # d loss / d log pi_t = -A s w_t / (|y| N_seq) = -w_t / 3
    old, _, _, mask, rollout = case()
    new = old.clone().requires_grad_()
    adv = torch.ones(1, 3)
    cfg = ActorConfig(clip_ratio_low=0.1, clip_ratio_high=0.2, tis_imp_ratio_cap=CAP)
    loss, clipfrac, *_ = get_policy_loss_fn("gspo")(old, new, adv, mask, "seq-mean-token-mean", cfg,
                                                    rollout_log_probs=rollout)
    assert loss.item() == pytest.approx(-4.0 / 3, abs=1e-6) and clipfrac.item() == 0.0
    loss.backward()
    assert new.grad[0].tolist() == pytest.approx([-0.5 / 3, -1.5 / 3, -2.0 / 3], abs=1e-6)
    # off: the unweighted GSPO loss -1
    cfg_off = ActorConfig(clip_ratio_low=0.1, clip_ratio_high=0.2)
    loss_off, *_ = get_policy_loss_fn("gspo")(old, new, adv, mask, "seq-mean-token-mean", cfg_off,
                                              rollout_log_probs=rollout)
    assert loss_off.item() == pytest.approx(-1.0, abs=1e-6)


def test_huge_mismatch_stays_finite():
    # old - rollout = 1000 would overflow exp(); the log-ratio is clamped, then the weight capped
    old, new = torch.zeros(1, 1), torch.zeros(1, 1, requires_grad=True)
    loss, *_ = vanilla(CAP, torch.full((1, 1), -1000.0), old, new, torch.ones(1, 1), torch.ones(1, 1))
    assert loss.item() == pytest.approx(-CAP)


@pytest.mark.parametrize("name", ["vanilla", "gspo"])
def test_tis_without_rollout_log_probs_is_an_error(name):
    old, new, adv, mask, rollout = case()
    cfg = ActorConfig(tis_imp_ratio_cap=CAP)
    with pytest.raises(ValueError, match=f"tis_imp_ratio_cap=2.0 .*{name!r}.*rollout_log_probs"):
        get_policy_loss_fn(name)(old, new, adv, mask, "seq-mean-token-mean", cfg, rollout_log_probs=None)
    with pytest.raises(ValueError, match="shape mismatch"):
        get_policy_loss_fn(name)(old, new, adv, mask, "seq-mean-token-mean", cfg, rollout_log_probs=rollout[:, :2])
