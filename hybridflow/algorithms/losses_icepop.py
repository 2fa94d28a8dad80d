"""IcePop: PPO-clip with two-sided masking of the rollout/trainer mismatch (Ling Team, "Every Step Evolves: Scaling
Reinforcement Learning for Trillion-Scale Thinking Model", arXiv 2510.18855, the IcePop objective; first in the blog
"Small Leak Can Sink a Great Ship -- Boost RL Training on MoE with IcePop!", 2025). Registered as ``"icepop"``.

With ``k_t = pi_train(y_t; theta_old) / pi_infer(y_t; theta_old) = exp(old_log_prob - rollout_log_probs)`` the ratio
of the trainer's behaviour probability to the rollout engine's, IcePop's objective is::

    J = E[ 1/G sum_i 1/|y_i| sum_t M(k_{i,t}; alpha, beta) * min(r_{i,t} A_{i,t}, clip(r_{i,t}, 1-eps, 1+eps) A_{i,t}) ]
    M(k; alpha, beta) = k if alpha <= k <= beta else 0

so a token whose mismatch leaves ``[alpha, beta]`` (both ways: the trainer far more or far less confident than the
sampler) contributes nothing -- no loss, no gradient -- instead of being clipped, and one inside is importance
weighted by ``k``. The paper uses ``alpha = 0.5``, ``beta = 5`` (``actor.icepop_alpha`` / ``actor.icepop_beta``).

Shapes: ``(B, T)`` = batch, response tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from hybridflow.algorithms.aggregation import agg_loss
from hybridflow.algorithms.losses import _ppo_clip_token_losses
from hybridflow.algorithms.policy_loss_registry import register_policy_loss
from hybridflow.algorithms.rollout_correction import in_band, mismatch_log_ratio, rejection_keep

__all__ = ["ICEPOP_METRIC", "IcePopConfig", "compute_policy_loss_icepop", "icepop_masked", "icepop_weights"]

ICEPOP_METRIC = "actor/icepop_masked_frac"  # share of the valid tokens IcePop's band masked out
ACTOR = "actor_rollout_ref.actor"
NAME = "icepop"  # this loss's registry name


@dataclass
class IcePopConfig:
    # policy_loss=icepop (IcePop, arXiv 2510.18855): tokens whose pi_old / mu is outside [icepop_alpha, icepop_beta] are
    # masked out of the loss, the rest weighted by pi_old / mu; the paper's band is [0.5, 5]
    icepop_alpha: float = 0.5  # IcePop lower bound alpha >= 0 on pi_old / mu
    icepop_beta: float = 5.0  # IcePop upper bound beta > alpha on pi_old / mu


def icepop_config_problems(get: Callable[[str], Any]) -> list[str]:
    """``icepop_alpha`` >= 0, and < ``icepop_beta`` when the actor's loss is this one (``get(dotted_key)`` returns a
    key's value)."""
    alpha, beta = get(f"{ACTOR}.icepop_alpha"), get(f"{ACTOR}.icepop_beta")
    if alpha < 0:
        return [f"{ACTOR}.icepop_alpha: must be >= 0, got {alpha}"]
    if get(f"{ACTOR}.policy_loss") == NAME and not alpha < beta:
        return [f"{ACTOR}.icepop_alpha ({alpha}) must be < {ACTOR}.icepop_beta ({beta})"]
    return []


def _band(config: Any) -> tuple[float, float]:
    alpha, beta = getattr(config, "icepop_alpha", None), getattr(config, "icepop_beta", None)
    if alpha is None or beta is None or not 0 <= alpha < beta:
        raise ValueError(f"policy loss 'icepop' needs 0 <= actor.icepop_alpha < actor.icepop_beta, got "
                         f"alpha={alpha!r}, beta={beta!r}")
    return float(alpha), float(beta)


def _log_k(old_log_prob: torch.Tensor, rollout_log_probs: Optional[torch.Tensor],
           response_mask: torch.Tensor) -> torch.Tensor:
    if rollout_log_probs is None:
        raise ValueError("policy loss 'icepop' needs rollout_log_probs (the rollout's sampling log-probs, the "
                         "denominator of its mismatch ratio); got None")
    return mismatch_log_ratio(old_log_prob, rollout_log_probs, response_mask)


def icepop_weights(old_log_prob: torch.Tensor, rollout_log_probs: Optional[torch.Tensor],
                   response_mask: torch.Tensor, config: Any) -> torch.Tensor:
    """``(B, T)`` detached float32 ``M(k_t; alpha, beta)``: ``k_t`` inside ``[alpha, beta]``, else 0 (0 on padding
    too). Finite for any log-ratio: ``k`` is exponentiated only after clamping to the band.

    Raises:
        ValueError: no ``rollout_log_probs``, shapes differ, or a bad band.
    """
    alpha, beta = _band(config)
    log_k = _log_k(old_log_prob, rollout_log_probs, response_mask)
    inside = in_band(log_k, alpha, beta) & (response_mask != 0)
    low = math.log(alpha) if alpha > 0 else -math.inf
    k = torch.exp(log_k.clamp(min=low, max=math.log(beta)))
    return torch.where(inside, k, torch.zeros_like(k))


def icepop_masked(old_log_prob: torch.Tensor, rollout_log_probs: Optional[torch.Tensor],
                  response_mask: torch.Tensor, config: Any) -> torch.Tensor:
    """``(B, T)`` bool: the valid tokens IcePop masks out (``k_t`` outside ``[alpha, beta]``, NaN included)."""
    alpha, beta = _band(config)
    log_k = _log_k(old_log_prob, rollout_log_probs, response_mask)
    return ~in_band(log_k, alpha, beta) & (response_mask != 0)


@register_policy_loss(NAME, needs_rollout_log_probs=True, corrects_off_policy=True, own_mismatch_weight=True,
                      masked_tokens=(ICEPOP_METRIC, icepop_masked), config=IcePopConfig,
                      config_checks=icepop_config_problems)
def compute_policy_loss_icepop(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_log_probs: Optional[torch.Tensor] = None,
    **agg_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """IcePop policy loss (the objective in the module docstring, as a loss to minimise).

    Per token ``l_t = M(k_t; alpha, beta) * l^PPO_t`` with ``l^PPO_t`` the clipped surrogate of ``"vanilla"``
    (:func:`~hybridflow.algorithms.losses.compute_policy_loss`: ``clip_ratio*``, and its dual-clip ``clip_ratio_c``,
    which IcePop's objective does not have and which only acts on ``A < 0`` with ``r > c``), ``M`` held constant
    (:func:`icepop_weights`), reduced by :func:`agg_loss` with ``loss_agg_mode`` (IcePop's ``1/G sum_i 1/|y_i|``
    is ``seq-mean-token-mean``); a masked token still counts in the normaliser. With ``"token-mean"`` and an
    unclipped token, ``d pg_loss / d log_prob_t = -M(k_t) r_t A_t / N_tok``; a masked one gets 0.
    ``actor.tis_imp_ratio_cap`` is ignored (``M`` already weights by ``k``; the config refuses both);
    ``actor.rollout_rs`` still masks by its own band.

    Args:
        old_log_prob: ``(B, T)`` behaviour log-probs ``log pi_train(theta_old)`` recomputed by the trainer.
        log_prob: ``(B, T)`` log-probs of the current policy (differentiable).
        advantages: ``(B, T)`` advantages.
        response_mask: ``(B, T)`` 0/1 mask of valid response tokens.
        loss_agg_mode: see :func:`agg_loss`.
        config: actor config read by attribute: ``icepop_alpha``, ``icepop_beta``, the clip keys of ``"vanilla"``.
        rollout_log_probs: ``(B, T)`` float32 log-probs ``log pi_infer(theta_old)`` the rollout sampled with.
        **agg_kwargs: ``num_tokens`` / ``num_seqs`` / ``loss_scale_factor`` for :func:`agg_loss`.

    Returns:
        ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)`` as ``"vanilla"`` computes them (unweighted); the
        masked share is the actor's ``actor/icepop_masked_frac``.

    Raises:
        ValueError: no ``rollout_log_probs``, a bad band or clip range, or input shapes differ.
    """
    weights = icepop_weights(old_log_prob, rollout_log_probs, response_mask, config)
    pg_losses, pg_clipfrac, ppo_kl, pg_clipfrac_lower = _ppo_clip_token_losses(
        old_log_prob, log_prob, advantages, response_mask,
        cliprange=getattr(config, "clip_ratio", None),
        cliprange_low=getattr(config, "clip_ratio_low", None),
        cliprange_high=getattr(config, "clip_ratio_high", None),
        clip_ratio_c=getattr(config, "clip_ratio_c", 3.0),
    )
    pg_losses = pg_losses * weights
    keep = rejection_keep(old_log_prob, rollout_log_probs, response_mask, config, "icepop")
    if keep is not None:
        pg_losses = pg_losses * keep.float()
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower
