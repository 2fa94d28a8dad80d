"""Rollout/trainer mismatch corrections: masked IS (actor.rollout_rs at token / sequence / geometric level),
sequence-level TIS and its masking variant (Seq-MIS), IcePop (policy_loss=icepop), and the masked-fraction metrics.
Every expected loss, gradient and fraction below is worked out by hand from the ratios in the comments."""

import math

import pytest
import torch

from hybridflow.algorithms import get_policy_loss_fn, masked_token_fractions
from hybridflow.config.assemble import section_class

ActorConfig = section_class("actor_rollout_ref.actor")  # with every registered policy loss's keys

NAN = float("nan")


def tensors(rho, adv=None, ppo_ratio=None, pad=0):
    """(old, new, adv, mask, rollout) for rows of mismatch ratios ``rho = pi_old / mu`` (one list per row, equal
    lengths); ``pad`` NaN-filled padded slots are appended to every row."""
    rho = torch.tensor(rho, dtype=torch.float64).float()
    old = torch.full(rho.shape, -1.0)
    rollout = old - torch.log(rho)
    new = old if ppo_ratio is None else old + torch.log(torch.tensor(ppo_ratio))
    adv = torch.ones(rho.shape) if adv is None else torch.tensor(adv)
    mask = torch.ones(rho.shape)
    if pad:
        fill = torch.full((rho.shape[0], pad), NAN)
        old, rollout, new, adv = (torch.cat([x, fill], 1) for x in (old, rollout, new, adv))
        mask = torch.cat([mask, torch.zeros(rho.shape[0], pad)], 1)
    return old, new.clone().requires_grad_(), adv, mask, rollout


def run(name, cfg, old, new, adv, mask, rollout, mode="token-mean"):
    loss, *_ = get_policy_loss_fn(name)(old, new, adv, mask, mode, cfg, rollout_log_probs=rollout)
    (grad,) = torch.autograd.grad(loss, new)
    return loss.item(), grad


def test_token_mis_masks_outside_the_band_by_hand():
    # rho = [0.4, 1.0, 1.9, 2.5], default band [1/2, 2]: tokens 0 and 3 leave it. pi = pi_old (r = 1), A = [1, 2, 3, 4]:
    # loss = -(2 + 3) / 4 (the masked tokens still count in the token-mean), d loss / d log pi_t = -A_t / 4 if kept
    old, new, adv, mask, rollout = tensors([[0.4, 1.0, 1.9, 2.5]], adv=[[1.0, 2.0, 3.0, 4.0]], pad=1)
    cfg = ActorConfig(rollout_rs="token")
    loss, grad = run("vanilla", cfg, old, new, adv, mask, rollout)
    assert loss == pytest.approx(-5.0 / 4, abs=1e-6)
    assert grad[0].tolist() == pytest.approx([0.0, -0.5, -0.75, 0.0, 0.0], abs=1e-7)
    assert masked_token_fractions(old, rollout, mask, cfg) == {"actor/mis_masked_frac": pytest.approx(0.5)}
    # an explicit band [0.3, 3] keeps all four
    wide = ActorConfig(rollout_rs="token", rollout_rs_threshold=3.0, rollout_rs_threshold_lower=0.3)
    assert run("vanilla", wide, old, new, adv, mask, rollout)[0] == pytest.approx(-10.0 / 4, abs=1e-6)
    assert masked_token_fractions(old, rollout, mask, wide)["actor/mis_masked_frac"] == 0.0


def test_sequence_and_geometric_mis_mask_whole_responses():
    # row 0: rho = [1.5, 1.2] -> prod 1.8, geometric mean sqrt(1.8) = 1.342; row 1: [1.5, 1.5] -> 2.25, 1.5.
    # Every token is inside [1/2, 2] on its own, so token-level MIS keeps all; sequence level (band [1/2, 2]) rejects
    # row 1 (2.25); geometric with threshold 1.4 (band [1/1.4, 1.4]) also rejects only row 1 (1.5 > 1.4 > 1.342).
    old, new, adv, mask, rollout = tensors([[1.5, 1.2], [1.5, 1.5]], pad=2)
    for cfg in (ActorConfig(rollout_rs="sequence"), ActorConfig(rollout_rs="geometric", rollout_rs_threshold=1.4)):
        loss, grad = run("vanilla", cfg, old, new, adv, mask, rollout)
        assert loss == pytest.approx(-2.0 / 4, abs=1e-6)  # A = 1, r = 1: -1 on each kept token, over 4 tokens
        assert grad[:, :2].flatten().tolist() == pytest.approx([-0.25, -0.25, 0.0, 0.0], abs=1e-7)
        assert masked_token_fractions(old, rollout, mask, cfg)["actor/mis_masked_frac"] == pytest.approx(0.5)
    token = ActorConfig(rollout_rs="token")
    assert run("vanilla", token, old, new, adv, mask, rollout)[0] == pytest.approx(-1.0, abs=1e-6)
    # geometric 1.3 rejects row 0 too (1.342 > 1.3)
    assert masked_token_fractions(old, rollout, mask, ActorConfig(rollout_rs="geometric", rollout_rs_threshold=1.3)
                                  )["actor/mis_masked_frac"] == 1.0


def test_sequence_tis_and_its_masking_variant_seq_mis():
    # rho per row: [1.5, 1.2] -> 1.8; [1.5, 1.5] -> 2.25; [0.5, 0.5] -> 0.25. A = 1, r = 1, token-mean over 6.
    old, new, adv, mask, rollout = tensors([[1.5, 1.2], [1.5, 1.5], [0.5, 0.5]], pad=1)
    # Seq-TIS, cap 2: weights 1.8, 2 (2.25 truncated), 0.25 on every token of the row
    seq_tis = ActorConfig(tis_imp_ratio_cap=2.0, tis_level="sequence")
    loss, grad = run("vanilla", seq_tis, old, new, adv, mask, rollout)
    assert loss == pytest.approx(-2 * (1.8 + 2.0 + 0.25) / 6, abs=1e-5)
    assert grad[:, 0].tolist() == pytest.approx([-1.8 / 6, -2.0 / 6, -0.25 / 6], abs=1e-6)
    # Seq-MIS: the same weight, but a row above the threshold is masked instead of truncated: rho(y) 1[rho(y) <= 2]
    seq_mis = ActorConfig(tis_imp_ratio_cap=2.0, tis_level="sequence", rollout_rs="sequence",
                          rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.0)
    loss, grad = run("vanilla", seq_mis, old, new, adv, mask, rollout)
    assert loss == pytest.approx(-2 * (1.8 + 0.25) / 6, abs=1e-5)
    assert grad[:, 1].tolist() == pytest.approx([-1.8 / 6, 0.0, -0.25 / 6], abs=1e-6)
    assert masked_token_fractions(old, rollout, mask, seq_mis)["actor/mis_masked_frac"] == pytest.approx(2 / 6)
    # the default lower bound 1/2 rejects the 0.25 row as well
    both = ActorConfig(tis_imp_ratio_cap=2.0, tis_level="sequence", rollout_rs="sequence")
    assert run("vanilla", both, old, new, adv, mask, rollout)[0] == pytest.approx(-2 * 1.8 / 6, abs=1e-5)


def test_icepop_by_hand():
    # k = pi_old / mu = [0.4, 1.0, 3.0, 6.0], band [0.5, 5]: M(k) = [0, 1, 3, 0]. A = 1; r = pi / pi_old =
    # [1, 1, 1, 1.5]: the last token is clipped (1.5 > 1.2) but masked anyway. loss = -(1 + 3) / 4;
    # d loss / d log pi_t = -M(k_t) r_t A_t / 4 = [0, -0.25, -0.75, 0]
    old, new, adv, mask, rollout = tensors([[0.4, 1.0, 3.0, 6.0]], ppo_ratio=[[1.0, 1.0, 1.0, 1.5]], pad=1)
    cfg = ActorConfig(policy_loss="icepop")
    loss, grad = run("icepop", cfg, old, new, adv, mask, rollout)
    assert loss == pytest.approx(-1.0, abs=1e-6)
    assert grad[0].tolist() == pytest.approx([0.0, -0.25, -0.75, 0.0, 0.0], abs=1e-7)
    assert masked_token_fractions(old, rollout, mask, cfg) == {"actor/icepop_masked_frac": pytest.approx(0.5)}
    # a wider band [0.3, 10] keeps all: M = k, loss = -(0.4 + 1 + 3 + 6 * 1.2 (clipped r)) / 4
    wide = ActorConfig(policy_loss="icepop", icepop_alpha=0.3, icepop_beta=10.0)
    assert run("icepop", wide, old, new, adv, mask, rollout)[0] == pytest.approx(-(4.4 + 7.2) / 4, abs=1e-5)
    with pytest.raises(ValueError, match="icepop.*rollout_log_probs"):
        get_policy_loss_fn("icepop")(old, new, adv, mask, "token-mean", cfg, rollout_log_probs=None)


def test_aipo_and_gspo_apply_the_mis_mask():
    # rho = [0.4, 1.0, 1.9, 2.5], band [1/2, 2] keeps tokens 1 and 2. AIPO with pi = mu... here pi = pi_old, so
    # pi / mu = rho (capped at rho_AIPO = 4): l_t = -rho_t A log pi_t; d/d log pi_t = -rho_t / 4 for kept tokens
    old, new, adv, mask, rollout = tensors([[0.4, 1.0, 1.9, 2.5]])
    cfg = ActorConfig(rollout_rs="token", policy_loss="aipo")
    _, grad = run("aipo", cfg, old, new, adv, mask, rollout)
    assert grad[0].tolist() == pytest.approx([0.0, -1.0 / 4, -1.9 / 4, 0.0], abs=1e-6)
    # GSPO (s = 1, unclipped): -A s on each token, seq-mean-token-mean over the 4 tokens of the one row
    gspo = ActorConfig(rollout_rs="token", clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    loss, grad = run("gspo", gspo, old, new, adv, mask, rollout, mode="seq-mean-token-mean")
    assert loss == pytest.approx(-2.0 / 4, abs=1e-6)
    assert grad[0].tolist() == pytest.approx([0.0, -0.25, -0.25, 0.0], abs=1e-6)


CONFIGS = [
    ("vanilla", ActorConfig(rollout_rs="token")),
    ("vanilla", ActorConfig(rollout_rs="sequence")),
    ("vanilla", ActorConfig(rollout_rs="geometric", rollout_rs_threshold=1.001)),
    ("vanilla", ActorConfig(tis_imp_ratio_cap=2.0, tis_level="sequence", rollout_rs="sequence")),
    ("vanilla", ActorConfig(tis_imp_ratio_cap=2.0, tis_level="sequence")),
    ("gspo", ActorConfig(rollout_rs="token", tis_imp_ratio_cap=2.0)),
    ("aipo", ActorConfig(rollout_rs="sequence", policy_loss="aipo")),
    ("icepop", ActorConfig(policy_loss="icepop")),
    ("icepop", ActorConfig(policy_loss="icepop", icepop_alpha=0.0, rollout_rs="token")),
]


@pytest.mark.parametrize("name,cfg", CONFIGS)
def test_extreme_log_ratios_stay_finite(name, cfg):
    # log(pi_old / mu) = +1000 and -1000 on valid tokens, 0 on one, NaN everywhere on the padded slot
    old = torch.tensor([[0.0, 0.0, -1.0, NAN], [-2.0, 0.0, -0.5, NAN]])
    rollout = old - torch.tensor([[1000.0, -1000.0, 0.0, NAN], [0.0, 0.0, 1000.0, NAN]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    new = torch.where(mask.bool(), old, torch.full_like(old, NAN)).requires_grad_()
    adv = torch.where(mask.bool(), torch.tensor([[1.0, -1.0, 2.0, NAN], [1.0, 1.0, -3.0, NAN]]), old)
    mode = "seq-mean-token-mean" if name == "gspo" else "token-mean"
    loss, grad = run(name, cfg, old, new, adv, mask, rollout, mode)
    assert math.isfinite(loss) and torch.isfinite(grad).all()
    assert grad[:, 3].tolist() == [0.0, 0.0]
    fractions = masked_token_fractions(old, rollout, mask, cfg)
    assert all(0.0 <= v <= 1.0 for v in fractions.values())
    assert bool(fractions) == (cfg.rollout_rs is not None or name == "icepop")
    if cfg.rollout_rs == "token":  # the three +-1000 tokens leave any band: 3 of the 6 valid tokens
        assert fractions["actor/mis_masked_frac"] == pytest.approx(3 / 6)
    if cfg.rollout_rs == "sequence":  # row 0: 1000 - 1000 + 0 = 0, rho(y) = 1, kept; row 1: 1000, masked: 3 of 6
        assert fractions["actor/mis_masked_frac"] == pytest.approx(3 / 6)
    if name == "icepop" and cfg.icepop_alpha > 0:
        assert fractions["actor/icepop_masked_frac"] == pytest.approx(3 / 6)
    if name == "icepop" and cfg.icepop_alpha == 0:  # only the two +1000 tokens are above beta
        assert fractions["actor/icepop_masked_frac"] == pytest.approx(2 / 6)


def test_masked_fraction_counts_tokens_of_uneven_rows():
    # row 0 (3 valid): rho = [3, 1, 1]; row 1 (2 valid): [1, 0.1]; band [1/2, 2] masks 3.0 and 0.1: 2 of 5
    old = torch.zeros(2, 3)
    rollout = -torch.log(torch.tensor([[3.0, 1.0, 1.0], [1.0, 0.1, 7.0]]))  # 7.0 sits on a padded slot
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert masked_token_fractions(old, rollout, mask, ActorConfig(rollout_rs="token")) == {
        "actor/mis_masked_frac": pytest.approx(2 / 5)}
    assert masked_token_fractions(old, None, mask, ActorConfig(rollout_rs="token")) == {}
    assert masked_token_fractions(old, rollout, mask, ActorConfig()) == {}  # nothing on: no metric


def test_mis_needs_rollout_log_probs_and_an_ordered_band():
    old, new, adv, mask, rollout = tensors([[1.0, 1.0]])
    with pytest.raises(ValueError, match="rollout_rs=token.*'vanilla'.*rollout_log_probs"):
        get_policy_loss_fn("vanilla")(old, new, adv, mask, "token-mean", ActorConfig(rollout_rs="token"),
                                      rollout_log_probs=None)
    bad = ActorConfig(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=3.0)
    with pytest.raises(ValueError, match="rollout_rs_threshold_lower"):
        get_policy_loss_fn("vanilla")(old, new, adv, mask, "token-mean", bad, rollout_log_probs=rollout)


def test_the_config_refuses_contradictions():
    from hybridflow.config.loader import ConfigError, load_config

    a = "actor_rollout_ref.actor."
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{a}rollout_rs=token", f"{a}rollout_rs_threshold=2", f"{a}rollout_rs_threshold_lower=3"])
    assert "rollout_rs_threshold_lower (3.0) must be <=" in str(err.value)
    with pytest.raises(ConfigError, match="icepop already weights each token"):
        load_config(None, [f"{a}policy_loss=icepop", f"{a}tis_imp_ratio_cap=2"])
    with pytest.raises(ConfigError, match="rollout_rs=sequence would see pi_old/mu = 1"):
        load_config(None, [f"{a}rollout_rs=sequence", "algorithm.bypass_old_log_prob=true"])
    with pytest.raises(ConfigError, match="must be token or sequence"):
        load_config(None, [f"{a}tis_level=geometric"])
    cfg = load_config(None, [f"{a}policy_loss=icepop", f"{a}rollout_rs=geometric"])
    assert (cfg.actor_rollout_ref.actor.icepop_alpha, cfg.actor_rollout_ref.actor.icepop_beta) == (0.5, 5.0)
