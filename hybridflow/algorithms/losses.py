"""Token log-probabilities, entropy, and the PPO policy and value losses; the home of every loss's public name.

The pieces live in their own modules and are re-exported here, so ``hybridflow.algorithms.losses.X`` keeps
working: loss aggregation in :mod:`~hybridflow.algorithms.aggregation`, the policy-loss registry, truncated IS
and the loss metadata in :mod:`~hybridflow.algorithms.policy_loss_registry`, GSPO in
:mod:`~hybridflow.algorithms.losses_gspo`, AIPO in :mod:`~hybridflow.algorithms.losses_aipo`.

Shapes: ``(B, T)`` = batch, response tokens; ``V`` = vocabulary. ``response_mask`` is 0/1 of any
dtype (0 = padding); padded entries of every per-token input are ignored, whatever they hold.

Policy-loss registry
--------------------
Every registered policy loss has one signature, so the actor calls any of them the same way::

    fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
       rollout_log_probs=None, **agg_kwargs) -> (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)

``config`` is the actor config (``actor_rollout_ref.actor``: a dataclass or an OmegaConf
DictConfig, read by attribute) from which the loss takes its hyper-parameters;
``rollout_log_probs`` (keyword, ``(B, T)`` float32 or None) are the log-probs the rollout recorded
when it sampled each token (the behaviour policy ``mu`` of an asynchronous or mismatched
generator); ``agg_kwargs`` (``num_tokens``, ``num_seqs``, ``loss_scale_factor``) go to
:func:`agg_loss`. ``pg_loss`` is a differentiable scalar; the other three are detached scalar
metrics. Add a loss with ``@register_policy_loss("name", **meta)`` (it must take this call: a
``rollout_log_probs`` parameter, even if it ignores it, or ``def loss(*args, **kwargs)``; ``meta`` declares what
it reads, see :mod:`~hybridflow.algorithms.policy_loss_registry`) and select it with ``actor.policy_loss=name``.
``compute_policy_loss`` keeps verl's direct signature (explicit clip ranges) and is what
``"vanilla"`` computes.

Rollout/trainer mismatch corrections (:mod:`~hybridflow.algorithms.rollout_correction`): with
``actor.tis_imp_ratio_cap > 0`` (truncated IS, token or sequence level per ``actor.tis_level``) ``"vanilla"`` and
``"gspo"`` multiply their per-token loss by the constant ``min(rho, cap)`` before aggregation (see
:func:`tis_weights`); with ``actor.rollout_rs`` (masked IS) every loss, ``"aipo"`` and ``"icepop"`` included,
multiplies it by 0 where the ratio leaves the band. ``"aipo"`` corrects the gap with its own cap
``actor.aipo_rho``, ``"icepop"`` (:mod:`~hybridflow.algorithms.losses_icepop`) with its own two-sided mask.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from hybridflow.algorithms.aggregation import LOSS_AGG_MODES, Number, agg_loss, check_same_shape
from hybridflow.algorithms.losses_aipo import compute_policy_loss_aipo
from hybridflow.algorithms.losses_gspo import GSPO_LOSS_AGG_MODE, _warn_gspo_agg_mode, compute_policy_loss_gspo
from hybridflow.algorithms.policy_loss_registry import (LOG_RATIO_CLAMP, POLICY_LOSSES, get_policy_loss_fn,
                                                        importance_weight_cap, policy_loss_meta, register_policy_loss)
from hybridflow.algorithms.rollout_correction import correction_weights, tis_weights
from hybridflow.algorithms.utils import masked_mean

__all__ = [
    "GSPO_LOSS_AGG_MODE", "LOG_RATIO_CLAMP", "LOSS_AGG_MODES", "Number", "POLICY_LOSSES", "agg_loss",
    "compute_policy_loss", "compute_policy_loss_aipo", "compute_policy_loss_gspo", "compute_policy_loss_vanilla",
    "compute_value_loss", "entropy_from_logits", "get_policy_loss_fn", "importance_weight_cap", "logprobs_from_logits",
    "policy_loss_meta", "register_policy_loss", "tis_weights", "_warn_gspo_agg_mode",
]


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label under ``softmax(logits)``.

    Computed in float32 as ``logits[label] - logsumexp(logits)`` (no log-softmax tensor of shape
    ``(B, T, V)`` is returned or kept), so bf16/fp16 logits lose no further precision.

    Args:
        logits: ``(B, T, V)`` (any leading dims ``(..., V)``), any floating dtype.
        labels: ``(B, T)`` (``(...)``) integer token ids in ``[0, V)``.

    Returns:
        ``(B, T)`` float32 log-probabilities (<= 0).

    Raises:
        ValueError: ``labels.shape != logits.shape[:-1]``.
    """
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal logits shape without the vocab dim "
                         f"{tuple(logits.shape[:-1])}")
    logits = logits.float()
    picked = torch.gather(logits, -1, labels.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy ``H = -sum_v p_v log p_v`` of ``p = softmax(logits)`` along the last dim, in nats.

    Computed in float32 as ``logsumexp(z) - sum_v p_v z_v``; ``-inf`` logits (masked vocabulary
    entries) contribute 0.

    Args:
        logits: ``(..., V)`` floating tensor, e.g. ``(B, T, V)``.

    Returns:
        ``(...)`` float32 entropy, e.g. ``(B, T)``.
    """
    z = logits.float().clamp(min=torch.finfo(torch.float32).min)  # -inf -> finite, so 0 * z is 0, not NaN
    p = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (p * z).sum(dim=-1)


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: Optional[float] = None,
    cliprange_low: Optional[float] = None,
    cliprange_high: Optional[float] = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    **agg_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate loss with asymmetric clipping and dual-clip.

    Per token, with ``r = exp(log_prob - old_log_prob)`` (the log-ratio clamped to [-20, 20]) and
    advantage ``A``:

    - clipped surrogate (Schulman et al. 2017, arXiv 1707.06347, eq. 7, as a loss to minimize):
      ``l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``;
    - dual-clip (Ye et al. 2020, arXiv 1912.09729, eq. 5): for ``A < 0`` the loss is further capped
      at ``-A c``: ``l = min(l, -A c)``, so a huge ratio on a bad action cannot blow up the update.

    Tokens on a clipped branch have zero gradient. The per-token losses are reduced by
    :func:`agg_loss` with ``loss_agg_mode`` and ``agg_kwargs``.

    Args:
        old_log_prob: ``(B, T)`` log-probs of the behaviour (rollout-time) policy.
        log_prob: ``(B, T)`` log-probs of the current policy (differentiable).
        advantages: ``(B, T)`` advantages.
        response_mask: ``(B, T)`` 0/1 mask of valid response tokens.
        cliprange: eps used for both sides when ``cliprange_low``/``cliprange_high`` are None.
        cliprange_low: eps of the lower bound ``1 - eps_low``.
        cliprange_high: eps of the upper bound ``1 + eps_high`` (DAPO's clip-higher uses a larger one).
        clip_ratio_c: dual-clip constant ``c > 1``.
        loss_agg_mode: see :func:`agg_loss`.
        **agg_kwargs: ``num_tokens`` / ``num_seqs`` / ``loss_scale_factor`` for :func:`agg_loss`.

    Returns:
        ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``: the scalar loss; the fraction of
        valid tokens where the ratio clip is active; the masked mean of ``old_log_prob - log_prob``
        (clamped like the log-ratio; an estimate of KL(old || new)); the fraction of valid tokens
        where the dual-clip is active. The last three are detached.

    Raises:
        ValueError: no clip range given, ``clip_ratio_c <= 1``, or input shapes differ.
    """
    pg_losses, pg_clipfrac, ppo_kl, pg_clipfrac_lower = _ppo_clip_token_losses(
        old_log_prob, log_prob, advantages, response_mask, cliprange, cliprange_low, cliprange_high, clip_ratio_c)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def _ppo_clip_token_losses(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                           response_mask: torch.Tensor, cliprange: Optional[float], cliprange_low: Optional[float],
                           cliprange_high: Optional[float], clip_ratio_c: float,
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token losses ``(B, T)`` of :func:`compute_policy_loss` (0 on padding) and its three metrics."""
    check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
                      response_mask=response_mask)
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    if low is None or high is None:
        raise ValueError("compute_policy_loss needs cliprange, or both cliprange_low and cliprange_high "
                         f"(got cliprange={cliprange}, cliprange_low={cliprange_low}, cliprange_high={cliprange_high})")
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}")

    # zero padded entries first so garbage there cannot reach the loss or its gradient
    valid = response_mask != 0
    advantages = torch.where(valid, advantages, torch.zeros_like(advantages))
    log_ratio = torch.where(valid, log_prob - old_log_prob, torch.zeros_like(log_prob))
    log_ratio = torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    surrogate = -advantages * ratio
    surrogate_clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    clipped = torch.maximum(surrogate, surrogate_clipped)
    dual_cap = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(clipped, dual_cap), clipped)

    with torch.no_grad():
        pg_clipfrac = masked_mean((surrogate_clipped > surrogate).float(), response_mask)
        pg_clipfrac_lower = masked_mean((negative & (clipped > dual_cap)).float(), response_mask)
        ppo_kl = masked_mean(-log_ratio, response_mask)
    return pg_losses, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    **agg_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss of PPO.

    Per token: ``0.5 * max((v - R)^2, (clip(v, v_old - eps, v_old + eps) - R)^2)`` with ``v`` the new
    prediction, ``v_old`` the rollout-time value and ``R`` the return, reduced by :func:`agg_loss`.

    Args:
        vpreds: ``(B, T)`` current value predictions (differentiable).
        returns: ``(B, T)`` regression targets (e.g. from GAE).
        values: ``(B, T)`` value predictions at rollout time.
        response_mask: ``(B, T)`` 0/1 mask.
        cliprange_value: eps of the value clip.
        loss_agg_mode: see :func:`agg_loss`.
        **agg_kwargs: ``num_tokens`` / ``num_seqs`` / ``loss_scale_factor`` for :func:`agg_loss`.

    Returns:
        ``(vf_loss, vf_clipfrac)``: the scalar loss and the (detached) fraction of valid tokens where
        the clipped branch is the larger one.

    Raises:
        ValueError: input shapes differ.
    """
    check_same_shape(vpreds=vpreds, returns=returns, values=values, response_mask=response_mask)
    valid = response_mask != 0
    vpreds, returns, values = (torch.where(valid, x, torch.zeros_like(x)) for x in (vpreds, returns, values))
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    loss_unclipped = (vpreds - returns) ** 2
    loss_clipped = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.maximum(loss_unclipped, loss_clipped), response_mask, loss_agg_mode,
                             **agg_kwargs)
    with torch.no_grad():
        vf_clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), response_mask)
    return vf_loss, vf_clipfrac


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_log_probs: Optional[torch.Tensor] = None,
    **agg_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Registry form of :func:`compute_policy_loss`, with optional truncated / masked importance sampling.

    Reads ``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high`` and ``clip_ratio_c`` (default 3.0)
    from ``config`` (the actor config) by attribute; see :func:`compute_policy_loss` for the rest.
    With ``config.tis_imp_ratio_cap > 0`` and/or ``config.rollout_rs`` each token's clipped loss is multiplied by
    the constant :func:`~hybridflow.algorithms.rollout_correction.correction_weights` (``min(rho, cap)`` times the
    MIS keep mask) before aggregation; ``rollout_log_probs`` (``(B, T)`` float32) is otherwise unused. The three
    metrics are those of :func:`compute_policy_loss` (unweighted).

    Raises:
        ValueError: see :func:`compute_policy_loss`; TIS or MIS on without ``rollout_log_probs``.
    """
    pg_losses, pg_clipfrac, ppo_kl, pg_clipfrac_lower = _ppo_clip_token_losses(
        old_log_prob, log_prob, advantages, response_mask,
        cliprange=getattr(config, "clip_ratio", None),
        cliprange_low=getattr(config, "clip_ratio_low", None),
        cliprange_high=getattr(config, "clip_ratio_high", None),
        clip_ratio_c=getattr(config, "clip_ratio_c", 3.0),
    )
    weights = correction_weights(old_log_prob, rollout_log_probs, response_mask, config, "vanilla")
    if weights is not None:
        pg_losses = pg_losses * weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower
