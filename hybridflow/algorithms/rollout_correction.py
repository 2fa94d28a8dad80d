"""Corrections of the rollout/trainer mismatch shared by the policy losses: truncated importance sampling (TIS,
token or sequence level) and masked importance sampling (MIS: rejection of the tokens or sequences whose
ratio leaves a band), and the masked-fraction metrics the actor logs.

The mismatch ratio of a valid token is ``rho_t = pi_old(y_t) / mu(y_t) = exp(old_log_prob - rollout_log_probs)``:
the trainer's behaviour probability over the probability the rollout engine actually sampled with (they differ
by kernels, precision, a quantized or stale generator). Everything here works on the detached log-ratio, which
is 0 on padded positions whatever they hold (NaN included), so any finite or infinite log-ratio of a valid token
(+-1000) gives finite weights and masks. Levels (Liu, Li et al. 2025, "When Speed Kills Stability: Demystifying RL
Collapse from the Training-Inference Mismatch", https://richardli.xyz/rl-collapse, section "IS/MIS at token and
sequence level"):

- ``token``: ``rho_t`` itself;
- ``sequence``: ``rho(y) = prod_t rho_t = exp(sum_t log rho_t)`` over the valid tokens of the sequence, broadcast
  to its tokens;
- ``geometric``: ``rho_geo(y) = exp(mean_t log rho_t)``, the per-token geometric mean, broadcast likewise.

TIS (``actor.tis_imp_ratio_cap`` = C > 0, ``actor.tis_level``): each token's loss is multiplied by the constant
``min(rho, C)`` at the chosen level (token: Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL training", the truncated weight ``min(pi_fsdp / pi_vllm, C)`` of its corrected gradient; sequence:
the Seq-TIS weight ``min(rho(y), C)`` of Liu, Li et al.).

MIS (``actor.rollout_rs`` = token | sequence | geometric, verl's ``rollout_correction.rollout_rs``): a token whose
ratio at the chosen level lies outside ``[lower, upper]`` (``actor.rollout_rs_threshold_lower``,
``actor.rollout_rs_threshold``) gets weight 0 -- it leaves the loss, with zero gradient, instead of being clipped
(Liu, Li et al.: Token-MIS ``rho_t 1[rho_t <= C]``, Seq-MIS ``rho(y) 1[rho(y) <= C]``, Geo-Mask
``1[C_low <= rho_geo(y) <= C_high]``). With TIS on as well the weights multiply: Seq-MIS is ``tis_level=sequence``
with ``rollout_rs=sequence`` and one threshold (``min(rho(y), C) 1[rho(y) in band] = rho(y) 1[rho(y) in band]``
when ``C >= upper``). The normaliser of the aggregation is unchanged (a masked token still counts in ``|y|`` and in
the token total), as in the objectives cited.

Shapes: ``(B, T)`` = batch, response tokens; masks are 0/1 of any dtype (0 = padding).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from hybridflow.algorithms.aggregation import check_same_shape
from hybridflow.algorithms.policy_loss_registry import LOG_RATIO_CLAMP, policy_loss_meta

__all__ = ["MIS_LEVELS", "MIS_METRIC", "TIS_LEVELS", "correction_weights", "in_band", "level_log_ratio",
           "masked_token_fractions", "mismatch_log_ratio", "rejection_keep", "tis_weights"]

TIS_LEVELS = ("token", "sequence")
MIS_LEVELS = ("token", "sequence", "geometric")
MIS_METRIC = "actor/mis_masked_frac"  # share of the valid tokens rollout_rs masked out
DEFAULT_RS_THRESHOLD = 2.0  # verl: rollout_rs_threshold falls back to rollout_is_threshold, default 2.0


def mismatch_log_ratio(old_log_prob: torch.Tensor, rollout_log_probs: torch.Tensor,
                       response_mask: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` float: the detached ``log rho_t = old_log_prob - rollout_log_probs`` on valid tokens, 0 on padding
    (whatever the inputs hold there, NaN included). Not clamped.

    Raises:
        ValueError: the shapes differ.
    """
    check_same_shape(old_log_prob=old_log_prob, rollout_log_probs=rollout_log_probs, response_mask=response_mask)
    valid = response_mask != 0
    diff = old_log_prob.detach().float() - rollout_log_probs.detach().float()
    return torch.where(valid, diff, torch.zeros_like(diff))


def level_log_ratio(log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str) -> torch.Tensor:
    """``(B, T)``: the log of the ratio at ``level`` broadcast to every token of its sequence: ``token``: unchanged;
    ``sequence``: ``sum_t log rho_t``; ``geometric``: ``mean_t log rho_t`` (over the valid tokens; a row without one
    gets 0). ``log_ratio`` must be 0 on padding (:func:`mismatch_log_ratio`).

    Raises:
        ValueError: unknown ``level``.
    """
    if level == "token":
        return log_ratio
    if level not in MIS_LEVELS:
        raise ValueError(f"unknown importance-ratio level {level!r}; known: {', '.join(MIS_LEVELS)}")
    total = log_ratio.sum(-1, keepdim=True)
    if level == "geometric":
        total = total / (response_mask != 0).sum(-1, keepdim=True).clamp(min=1)
    return total.expand_as(log_ratio)


def in_band(log_ratio: torch.Tensor, lower: float, upper: float) -> torch.Tensor:
    """``(B, T)`` bool: ``lower <= exp(log_ratio) <= upper``, compared in log space (no overflow; ``lower = 0``
    keeps every ratio above, ``-inf`` included). NaN is outside every band."""
    low = math.log(lower) if lower > 0 else -math.inf
    return (log_ratio >= low) & (log_ratio <= math.log(upper))


def _rs_band(config: Any) -> tuple[float, float]:
    """``(lower, upper)`` of MIS: ``rollout_rs_threshold`` (null: 2.0) and ``rollout_rs_threshold_lower`` (null:
    ``1 / upper``), as verl reads them.

    Raises:
        ValueError: ``upper <= 0``, ``lower < 0`` or ``lower > upper``.
    """
    upper = getattr(config, "rollout_rs_threshold", None)
    upper = DEFAULT_RS_THRESHOLD if upper is None else float(upper)
    lower = getattr(config, "rollout_rs_threshold_lower", None)
    lower = 1.0 / upper if lower is None and upper > 0 else lower
    if not upper > 0 or lower is None or not 0 <= lower <= upper:
        raise ValueError(f"actor.rollout_rs needs 0 <= rollout_rs_threshold_lower <= rollout_rs_threshold and "
                         f"rollout_rs_threshold > 0, got lower={lower}, upper={upper}")
    return float(lower), upper


def _need_rollout(rollout_log_probs: Optional[torch.Tensor], what: str, loss: str) -> torch.Tensor:
    if rollout_log_probs is None:
        raise ValueError(f"{what} turns on a rollout/trainer mismatch correction in policy loss {loss!r}, which "
                         "needs rollout_log_probs (the rollout's sampling log-probs); got None. Turn it off, or "
                         "keep rollout_log_probs in the batch")
    return rollout_log_probs


def rejection_keep(old_log_prob: torch.Tensor, rollout_log_probs: Optional[torch.Tensor],
                   response_mask: torch.Tensor, config: Any, loss: str = "?") -> Optional[torch.Tensor]:
    """``(B, T)`` bool: the tokens MIS keeps (``actor.rollout_rs`` at its level, band :func:`_rs_band`; True on
    padding), or None when ``rollout_rs`` is off (missing or null).

    Raises:
        ValueError: ``rollout_rs`` on without ``rollout_log_probs``, an unknown level, a bad band, shapes differ.
    """
    level = getattr(config, "rollout_rs", None)
    if level is None:
        return None
    rollout_log_probs = _need_rollout(rollout_log_probs, f"actor.rollout_rs={level}", loss)
    lower, upper = _rs_band(config)
    log_ratio = level_log_ratio(mismatch_log_ratio(old_log_prob, rollout_log_probs, response_mask),
                                response_mask, level)
    return in_band(log_ratio, lower, upper) | (response_mask == 0)


def tis_weights(old_log_prob: torch.Tensor, rollout_log_probs: Optional[torch.Tensor], response_mask: torch.Tensor,
                config: Any, loss: str) -> Optional[torch.Tensor]:
    """Truncated importance-sampling weights ``min(rho, C)`` of the rollout/trainer mismatch, or None when TIS is off.

    ``C = config.tis_imp_ratio_cap`` (off when missing or ``<= 0``); ``rho`` at ``config.tis_level`` (``token``,
    default, or ``sequence``; see the module docstring for the sources). Computed as ``exp(min(log rho, log C))``
    with the token log-ratio clamped to ``[-20, 20]`` first, so any log-ratio gives a finite weight; the weights
    carry no gradient.

    Args:
        old_log_prob: ``(B, T)`` behaviour log-probs recomputed by the trainer.
        rollout_log_probs: ``(B, T)`` float32 log-probs recorded by the rollout, or None.
        response_mask: ``(B, T)`` 0/1; padded entries get ``min(1, C)`` at token level (their loss is 0 anyway).
        config: the actor config, read by attribute.
        loss: the policy-loss name, for the error message.

    Returns:
        ``(B, T)`` detached float32 weights in ``[0, C]``, or None.

    Raises:
        ValueError: TIS is on but ``rollout_log_probs`` is None, its shape differs, or ``tis_level`` is unknown.
    """
    cap = getattr(config, "tis_imp_ratio_cap", None)
    if cap is None or cap <= 0:
        return None
    rollout_log_probs = _need_rollout(rollout_log_probs, f"actor.tis_imp_ratio_cap={cap}", loss)
    level = getattr(config, "tis_level", None) or "token"
    if level not in TIS_LEVELS:
        raise ValueError(f"actor.tis_level must be one of {', '.join(TIS_LEVELS)}, got {level!r}")
    log_ratio = mismatch_log_ratio(old_log_prob, rollout_log_probs, response_mask)
    log_ratio = level_log_ratio(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), response_mask, level)
    return torch.exp(log_ratio.clamp(max=math.log(float(cap))))


def correction_weights(old_log_prob: torch.Tensor, rollout_log_probs: Optional[torch.Tensor],
                       response_mask: torch.Tensor, config: Any, loss: str, tis: bool = True) -> Optional[torch.Tensor]:
    """``(B, T)`` detached float32 weights the policy loss multiplies its per-token losses by before aggregation:
    :func:`tis_weights` (when ``tis`` and TIS is on) times the MIS keep mask :func:`rejection_keep` (when
    ``rollout_rs`` is on); None when neither is on.

    Raises:
        ValueError: see :func:`tis_weights` and :func:`rejection_keep`.
    """
    weights = tis_weights(old_log_prob, rollout_log_probs, response_mask, config, loss) if tis else None
    keep = rejection_keep(old_log_prob, rollout_log_probs, response_mask, config, loss)
    if keep is None:
        return weights
    keep = keep.float()
    return keep if weights is None else weights * keep


def masked_token_fractions(old_log_prob: torch.Tensor, rollout_log_probs: Optional[torch.Tensor],
                           response_mask: torch.Tensor, config: Any) -> dict[str, float]:
    """The share of the valid tokens of ``response_mask`` each mismatch mask removes from the loss, by metric name:
    :data:`MIS_METRIC` (``actor/mis_masked_frac``) with ``rollout_rs`` on, and the policy loss's own when it declares
    ``masked_tokens=(metric, fn)`` (``fn(old_log_prob, rollout_log_probs, response_mask, config)`` -> ``(B, T)``
    bool of the masked tokens; IcePop: ``actor/icepop_masked_frac``). Empty without ``rollout_log_probs`` or a
    valid token. Counted, never weighted: 2 masked of 8 valid tokens is 0.25."""
    valid = response_mask != 0
    count = int(valid.sum())
    if rollout_log_probs is None or count == 0:
        return {}
    out: dict[str, float] = {}
    keep = rejection_keep(old_log_prob, rollout_log_probs, response_mask, config)
    if keep is not None:
        out[MIS_METRIC] = int((~keep & valid).sum()) / count
    own = policy_loss_meta(getattr(config, "policy_loss", "vanilla"), "masked_tokens")
    if own is not None:
        metric, fn = own
        out[metric] = int((fn(old_log_prob, rollout_log_probs, response_mask, config) & valid).sum()) / count
    return out
