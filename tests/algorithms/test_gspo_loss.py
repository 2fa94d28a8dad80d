"""GSPO policy loss: sequence ratio and clipping by hand, gradients, the sequence-level reference, config."""

import logging
import math

import pytest
import torch

from hybridflow.algorithms import compute_policy_loss_gspo, get_policy_loss_fn
from hybridflow.algorithms.losses import _warn_gspo_agg_mode
from hybridflow.config.schema import ActorConfig

NAN = float("nan")
CFG = ActorConfig(clip_ratio_low=0.1, clip_ratio_high=0.2)  # clip range [0.9, 1.2]


def two_sequences():
    """Seq 0: log-ratios [0.1, 0.3] (+ a padded NaN token), A = +1; seq 1: log-ratios [-0.2, 0.05, 0], A = -2."""
    old = torch.tensor([[-1.0, -2.0, NAN], [-0.5, -1.5, -3.0]])
    log_ratio = torch.tensor([[0.1, 0.3, NAN], [-0.2, 0.05, 0.0]])
    new = (old + log_ratio).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, NAN], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    return old, new, adv, mask


def test_gspo_by_hand():
    # seq 0: s = exp((0.1 + 0.3) / 2) = exp(0.2) = 1.22140 > 1.2 with A = +1 -> clipped:
    #        per token max(-1.22140, -1.2) = -1.2, gradient 0
    # seq 1: s = exp((-0.2 + 0.05 + 0) / 3) = exp(-0.05) = 0.951229, inside [0.9, 1.2], A = -2:
    #        per token 2 * 0.951229 = 1.902459; d/d log_prob_t = -A s / (|y| B) = 2 * 0.951229 / (3 * 2)
    # seq-mean-token-mean: (-1.2 + 1.902459) / 2
    # clipfrac: 2 of 5 valid tokens; ppo_kl = -(0.1 + 0.3 - 0.2 + 0.05 + 0) / 5 = -0.05
    old, new, adv, mask = two_sequences()
    loss, clipfrac, ppo_kl, lower = compute_policy_loss_gspo(old, new, adv, mask, "seq-mean-token-mean", CFG)
    s1 = math.exp(-0.05)
    assert loss.item() == pytest.approx((-1.2 + 2 * s1) / 2, abs=1e-6)
    assert clipfrac.item() == pytest.approx(0.4)
    assert ppo_kl.item() == pytest.approx(-0.05, abs=1e-6)
    assert lower.item() == 0.0
    loss.backward()
    g = 2 * s1 / 6
    assert new.grad.tolist()[0] == [0.0, 0.0, 0.0]  # clipped sequence and the NaN padding: exactly 0
    assert new.grad[1].tolist() == pytest.approx([g, g, g], abs=1e-6)


def test_gspo_other_branches_by_hand():
    # one token each, clip range [0.9, 1.2]:
    #  A = -1, s = exp(-0.5) = 0.60653 < 0.9: max(0.60653, 0.9) = 0.9           clipped, grad 0
    #  A = -1, s = exp(0.5)  = 1.64872 > 1.2: max(1.64872, 1.2) = 1.64872       not clipped (no dual-clip), grad s
    #  A = +2, s = exp(-0.5) = 0.60653 < 0.9: max(-1.21306, -1.8) = -1.21306    not clipped, grad -2 s
    # mean over the 3 sequences; gradient divided by |y| B = 3
    old = torch.zeros(3, 1)
    new = torch.tensor([[-0.5], [0.5], [-0.5]], requires_grad=True)
    adv = torch.tensor([[-1.0], [-1.0], [2.0]])
    loss, clipfrac, _, _ = compute_policy_loss_gspo(old, new, adv, torch.ones(3, 1), config=CFG)
    lo, hi = math.exp(-0.5), math.exp(0.5)
    assert loss.item() == pytest.approx((0.9 + hi - 2 * lo) / 3, abs=1e-6)
    assert clipfrac.item() == pytest.approx(1 / 3)
    loss.backward()
    assert new.grad[:, 0].tolist() == pytest.approx([0.0, hi / 3, -2 * lo / 3], abs=1e-6)


def test_gradient_flows_only_through_log_prob():
    old, new, adv, mask = two_sequences()
    old.requires_grad_()
    adv.requires_grad_()
    loss, *_ = compute_policy_loss_gspo(old, new, adv, mask, config=CFG)
    loss.backward()
    assert old.grad is None and adv.grad is None
    assert new.grad is not None and torch.isfinite(new.grad).all()


def sequence_level_reference(old, new, adv, lengths, low, high):
    """GSPO objective written per sequence: s_i = exp(mean log-ratio), differentiated through the mean."""
    terms = []
    for i, n in enumerate(lengths):
        s = torch.exp((new[i, :n] - old[i, :n]).mean())
        a = adv[i, 0]
        terms.append(torch.maximum(-a * s, -a * torch.clamp(s, 1 - low, 1 + high)))
    return torch.stack(terms).mean()


def test_token_form_equals_the_sequence_objective_in_value_and_gradient():
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 2, 7, 3, 1, 4]
    mask = (torch.arange(7)[None] < torch.tensor(lengths)[:, None]).float()
    old = torch.randn(6, 7, generator=gen) - 2
    # per-sequence log-ratio offsets and advantage signs chosen to hit every branch, range [0.97, 1.04]:
    # inside (0, +), above & A>0 clipped (0.1, +), below & A<0 clipped (-0.1, -), above & A<0 unclipped
    # (0.1, -), below & A>0 unclipped (-0.2, +), inside (0.01, -); plus small per-token noise
    offsets = torch.tensor([[0.0], [0.1], [-0.1], [0.1], [-0.2], [0.01]])
    new = (old + offsets + 0.005 * torch.randn(6, 7, generator=gen)).requires_grad_()
    signs = torch.tensor([[1.0], [1.0], [-1.0], [-1.0], [1.0], [-1.0]])
    adv = (signs * (0.5 + torch.rand(6, 1, generator=gen))).expand(6, 7).contiguous()
    cfg = ActorConfig(clip_ratio_low=3e-2, clip_ratio_high=4e-2)
    loss, clipfrac, _, _ = compute_policy_loss_gspo(old, new, adv, mask, config=cfg)
    (grad,) = torch.autograd.grad(loss, new)
    new_ref = new.detach().clone().requires_grad_()
    ref = sequence_level_reference(old, new_ref, adv, lengths, 3e-2, 4e-2)
    (grad_ref,) = torch.autograd.grad(ref, new_ref)
    assert loss.item() == pytest.approx(ref.item(), abs=1e-6)
    assert torch.allclose(grad, grad_ref, atol=1e-6)
    # sequences 1 and 2 are clipped: (2 + 7) of the 22 valid tokens
    assert clipfrac.item() == pytest.approx(9 / 22)
    assert (grad[1:3] == 0).all() and (grad[[0, 3, 4, 5]][mask[[0, 3, 4, 5]] != 0] != 0).all()


def test_micro_batch_split_with_num_seqs_gives_the_mini_batch_gradient():
    old, new, adv, mask = two_sequences()
    full, *_ = compute_policy_loss_gspo(old, new, adv, mask, config=CFG)
    (g_full,) = torch.autograd.grad(full, new)
    parts = [compute_policy_loss_gspo(old[i:i + 1], new[i:i + 1], adv[i:i + 1], mask[i:i + 1], config=CFG,
                                      num_seqs=2)[0] for i in range(2)]
    (g_split,) = torch.autograd.grad(sum(parts), new)
    assert sum(parts).item() == pytest.approx(full.item(), abs=1e-6)
    assert torch.allclose(g_split, g_full, atol=1e-7)


def test_paper_clip_range_from_the_actor_config():
    # GSPO's ranges 3e-4 / 4e-4 -> [0.9997, 1.0004]; A = +1 on both sequences (one token each)
    # s = exp(1e-4) = 1.0001 inside -> loss -1.0001; s = exp(1e-3) = 1.0010 above -> clipped to -1.0004
    cfg = ActorConfig(clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    old = torch.zeros(2, 1, dtype=torch.float64)
    new = torch.tensor([[1e-4], [1e-3]], dtype=torch.float64)
    loss, clipfrac, _, _ = get_policy_loss_fn("gspo")(old, new, torch.ones(2, 1, dtype=torch.float64),
                                                      torch.ones(2, 1), "seq-mean-token-mean", cfg)
    assert loss.item() == pytest.approx((-math.exp(1e-4) - 1.0004) / 2, abs=1e-12)
    assert clipfrac.item() == 0.5


def test_other_loss_agg_modes_are_ignored_with_a_warning(caplog):
    _warn_gspo_agg_mode.cache_clear()
    old, new, adv, mask = two_sequences()
    reference, *_ = compute_policy_loss_gspo(old, new, adv, mask, "seq-mean-token-mean", CFG)
    with caplog.at_level(logging.WARNING, logger="hybridflow.algorithms.losses"):
        loss, *_ = compute_policy_loss_gspo(old, new, adv, mask, "token-mean", CFG)
        compute_policy_loss_gspo(old, new, adv, mask, "token-mean", CFG)
    assert loss.item() == reference.item()
    warnings = [r for r in caplog.records if "'token-mean'" in r.getMessage()]
    assert len(warnings) == 1  # once per value


def test_registry_and_errors():
    assert get_policy_loss_fn("gspo") is compute_policy_loss_gspo
    old, new, adv, mask = two_sequences()
    with pytest.raises(ValueError, match="'gspo' needs actor.clip_ratio"):
        compute_policy_loss_gspo(old, new, adv, mask, config=None)
    with pytest.raises(ValueError, match="shape mismatch"):
        compute_policy_loss_gspo(old, new, adv[:, :2], mask, config=CFG)


def test_sequence_ratio_is_the_length_normalised_likelihood_ratio_of_the_paper():
    # GSPO (arXiv 2507.18071, eq. 7): s_i = (pi(y_i|x) / pi_old(y_i|x)) ** (1 / |y_i|), sequence likelihoods being
    # products of token probabilities. Seq 0: new token probs [0.6, 0.3], old [0.5, 0.4]: likelihoods 0.18 / 0.20,
    # s = 0.9 ** 0.5 = 0.9486833, inside [0.8, 1.2]. Seq 1: one token, 0.9 / 0.5 = 1.8 > 1.2, A = +1: clipped to 1.2.
    # Loss = -(1/G) sum_i min(s_i A_i, clip(s_i) A_i) = -(0.9486833 + 1.2) / 2; an unclipped sequence's tokens get
    # d loss / d log pi = -A s / (|y| G) = -0.9486833 / 4, the clipped one 0.
    new_p = torch.tensor([[0.6, 0.3], [0.9, 0.7]])
    old_p = torch.tensor([[0.5, 0.4], [0.5, 0.1]])  # seq 1's second slot is padding
    new = new_p.log().requires_grad_()
    mask = torch.tensor([[1, 1], [1, 0]])
    cfg = ActorConfig(clip_ratio_low=0.2, clip_ratio_high=0.2)
    loss, clipfrac, _, _ = compute_policy_loss_gspo(old_p.log(), new, torch.ones(2, 2), mask, config=cfg)
    s0 = 0.9 ** 0.5
    assert s0 == pytest.approx(0.9486833, abs=1e-7)
    assert loss.item() == pytest.approx(-(s0 + 1.2) / 2, abs=1e-6)
    assert clipfrac.item() == pytest.approx(1 / 3)  # seq 1's one valid token of the 3
    loss.backward()
    assert new.grad.tolist()[0] == pytest.approx([-s0 / 4, -s0 / 4], abs=1e-6)
    assert new.grad.tolist()[1] == [0.0, 0.0]
