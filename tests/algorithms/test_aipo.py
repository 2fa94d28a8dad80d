"""AIPO policy loss (LlamaRL): capped importance weights by hand, gradients only through log pi, config."""

import math

import pytest
import torch

from hybridflow.algorithms import compute_policy_loss_aipo, get_policy_loss_fn
from hybridflow.config import ConfigError, load_config
from hybridflow.config.assemble import section_class

ActorConfig = section_class("actor_rollout_ref.actor")  # with every registered policy loss's keys

RHO = 2.0
CFG = ActorConfig(aipo_rho=RHO)
# One sequence of 4 tokens, mu = the generator's log-probs, r = pi / mu, rho = 2:
#  1. r = 0.5, A = +1: below rho, w = 0.5
#  2. r = 1.5, A = -2: below rho, w = 1.5
#  3. r = 3,   A = +1: capped,    w = 2
#  4. r = 10,  A = -1: capped,    w = 2
MU = [-1.0, -0.5, -2.0, -3.0]
RATIOS = [0.5, 1.5, 3.0, 10.0]
ADV = [1.0, -2.0, 1.0, -1.0]
W = [0.5, 1.5, 2.0, 2.0]
# token-mean: d loss / d log pi_t = -w_t A_t / 4
GRAD = [-0.5 / 4, 3.0 / 4, -2.0 / 4, 2.0 / 4]


def case(pad=None):
    """(old, new, adv, mask, rollout); ``pad`` appends one padded token holding that garbage everywhere."""
    mu = torch.tensor([MU])
    new = mu + torch.log(torch.tensor([RATIOS]))
    adv = torch.tensor([ADV])
    mask = torch.ones(1, 4)
    old = torch.full((1, 4), -7.0)  # not mu: rollout_log_probs must win when given
    if pad is not None:
        mu, new, adv, old = (torch.cat([x, torch.tensor([[pad]])], 1) for x in (mu, new, adv, old))
        mask = torch.cat([mask, torch.zeros(1, 1)], 1)
    return old, new.requires_grad_(), adv, mask, mu


def hand_loss():
    log_pi = [m + math.log(r) for m, r in zip(MU, RATIOS)]
    return sum(-w * a * lp for w, a, lp in zip(W, ADV, log_pi)) / 4


def test_aipo_by_hand():
    old, new, adv, mask, mu = case()
    loss, clipfrac, ppo_kl, lower = compute_policy_loss_aipo(old, new, adv, mask, "token-mean", CFG,
                                                             rollout_log_probs=mu)
    assert loss.item() == pytest.approx(hand_loss(), abs=1e-6)
    assert clipfrac.item() == pytest.approx(0.5)  # tokens 3 and 4 capped
    assert ppo_kl.item() == pytest.approx(-sum(math.log(r) for r in RATIOS) / 4, abs=1e-6)
    assert lower.item() == 0.0
    loss.backward()
    assert new.grad[0].tolist() == pytest.approx(GRAD, abs=1e-6)


def test_below_rho_is_the_importance_weighted_policy_gradient():
    # below rho the gradient equals that of the plain importance-sampling surrogate -A pi/mu, whose
    # derivative w.r.t. log pi is -A pi/mu; here every ratio is < rho = 20
    old, new, adv, mask, mu = case()
    cfg = ActorConfig(aipo_rho=20.0)
    loss, clipfrac, *_ = compute_policy_loss_aipo(old, new, adv, mask, config=cfg, rollout_log_probs=mu)
    loss.backward()
    reference_new = new.detach().clone().requires_grad_()
    (-(adv * torch.exp(reference_new - mu)).mean()).backward()
    assert clipfrac.item() == 0.0
    assert torch.allclose(new.grad, reference_new.grad, atol=1e-6)


def test_on_policy_is_reinforce():
    # pi == mu: every weight is 1, so the gradient is REINFORCE's -A / N
    mu = torch.tensor([[-0.3, -1.2, -2.5]])
    new = mu.clone().requires_grad_()
    adv = torch.tensor([[2.0, -1.0, 0.5]])
    loss, clipfrac, ppo_kl, _ = compute_policy_loss_aipo(mu, new, adv, torch.ones(1, 3), config=CFG)
    loss.backward()
    assert new.grad[0].tolist() == pytest.approx([-2.0 / 3, 1.0 / 3, -0.5 / 3], abs=1e-7)
    assert clipfrac.item() == 0.0 and ppo_kl.item() == 0.0


def test_mu_falls_back_to_old_log_prob():
    _, new, adv, mask, mu = case()
    loss, clipfrac, *_ = compute_policy_loss_aipo(mu, new, adv, mask, config=CFG)  # old_log_prob = mu
    assert loss.item() == pytest.approx(hand_loss(), abs=1e-6) and clipfrac.item() == 0.5
    loss.backward()
    assert new.grad[0].tolist() == pytest.approx(GRAD, abs=1e-6)


def test_gradient_flows_only_through_log_prob():
    old, new, adv, mask, mu = case()
    for x in (old, adv, mu):
        x.requires_grad_()
    loss, *_ = compute_policy_loss_aipo(old, new, adv, mask, config=CFG, rollout_log_probs=mu)
    loss.backward()
    assert old.grad is None and adv.grad is None and mu.grad is None
    # and through old_log_prob when it stands in for mu
    old2, new2, adv2, mask2, mu2 = case()
    mu2.requires_grad_()
    loss, *_ = compute_policy_loss_aipo(mu2, new2, adv2, mask2, config=CFG)
    loss.backward()
    assert mu2.grad is None and new2.grad is not None


@pytest.mark.parametrize("garbage", [float("nan"), 1e6, -1e6])
def test_padding_garbage_changes_nothing(garbage):
    old, new, adv, mask, mu = case(pad=garbage)
    loss, clipfrac, ppo_kl, _ = compute_policy_loss_aipo(old, new, adv, mask, config=CFG, rollout_log_probs=mu)
    assert loss.item() == pytest.approx(hand_loss(), abs=1e-6)
    assert clipfrac.item() == pytest.approx(0.5)
    assert ppo_kl.item() == pytest.approx(-sum(math.log(r) for r in RATIOS) / 4, abs=1e-6)
    loss.backward()
    assert new.grad[0, :4].tolist() == pytest.approx(GRAD, abs=1e-6)
    assert new.grad[0, 4].item() == 0.0


def test_huge_log_ratio_is_clamped_and_capped():
    # log pi - log mu = 1000 would overflow exp(); the weight is the cap rho and stays finite
    mu, new = torch.tensor([[-1000.0]]), torch.tensor([[0.0]], requires_grad=True)
    loss, clipfrac, ppo_kl, _ = compute_policy_loss_aipo(mu, new, torch.ones(1, 1), torch.ones(1, 1), config=CFG)
    loss.backward()
    assert new.grad.item() == pytest.approx(-RHO) and clipfrac.item() == 1.0
    assert ppo_kl.item() == -20.0  # LOG_RATIO_CLAMP


def test_aggregation_arguments_are_forwarded():
    old, new, adv, mask, mu = case()
    # seq-mean-token-sum with num_seqs=2: (4 * hand token-mean) / 2
    loss, *_ = compute_policy_loss_aipo(old, new, adv, mask, "seq-mean-token-sum", CFG, rollout_log_probs=mu,
                                        num_seqs=2)
    assert loss.item() == pytest.approx(hand_loss() * 4 / 2, abs=1e-6)
    loss.backward()
    assert new.grad[0].tolist() == pytest.approx([g * 4 / 2 for g in GRAD], abs=1e-6)


def test_registry_and_tis_cap_ignored():
    assert get_policy_loss_fn("aipo") is compute_policy_loss_aipo
    old, new, adv, mask, mu = case()
    # TIS on in the config: aipo ignores it (even without rollout_log_probs)
    cfg = ActorConfig(aipo_rho=RHO, tis_imp_ratio_cap=1.5)
    loss, *_ = get_policy_loss_fn("aipo")(mu, new, adv, mask, "token-mean", cfg, rollout_log_probs=None)
    assert loss.item() == pytest.approx(hand_loss(), abs=1e-6)


def test_errors():
    old, new, adv, mask, mu = case()
    for bad in (0.0, -1.0, None):
        with pytest.raises(ValueError, match="aipo_rho"):
            compute_policy_loss_aipo(old, new, adv, mask, config=ActorConfig(aipo_rho=bad))
    with pytest.raises(ValueError, match="aipo_rho"):
        compute_policy_loss_aipo(old, new, adv, mask, config=None)
    with pytest.raises(ValueError, match="shape mismatch"):
        compute_policy_loss_aipo(old, new, adv, mask, config=CFG, rollout_log_probs=mu[:, :3])


def test_config_accepts_aipo_and_rejects_typos():
    cfg = load_config(None, ["actor_rollout_ref.actor.policy_loss=aipo", "actor_rollout_ref.actor.aipo_rho=8"])
    assert cfg.actor_rollout_ref.actor.policy_loss == "aipo" and cfg.actor_rollout_ref.actor.aipo_rho == 8.0
    assert load_config().actor_rollout_ref.actor.aipo_rho == 4.0
    with pytest.raises(ConfigError, match="unknown policy loss 'aipoo'; known: aipo"):
        load_config(None, ["actor_rollout_ref.actor.policy_loss=aipoo"])
    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.aipo_rho: must be > 0"):
        load_config(None, ["actor_rollout_ref.actor.aipo_rho=0"])
    with pytest.raises(ConfigError, match="did you mean actor_rollout_ref.actor.aipo_rho"):
        load_config(None, ["actor_rollout_ref.actor.aipo_roh=2"])
