"""GSPO: PPO-style clipping of a sequence-level importance ratio (Zheng et al. 2025, arXiv 2507.18071).

With ``|y_i|`` the number of valid tokens of sequence ``i`` and ``sg`` the stop-gradient:

- sequence ratio (the geometric mean of the token ratios, the ``s_i`` of the GSPO objective, eq. 5):
  ``s_i = exp(mean_t (log_prob - old_log_prob))`` over the valid tokens, the log-ratio clamped to [-20, 20];
- GSPO-token form: ``s_{i,t} = sg[s_i] * pi(y_{i,t}) / sg[pi(y_{i,t})]``, computed as
  ``exp(sg[log s_i] + log_prob - sg[log_prob])``. Its value is ``s_i`` on every token and
  ``d s_{i,t} / d log_prob_{i,t} = s_i``, so the gradient flows per token;
- per token ``l_{i,t} = max(-A_{i,t} s_{i,t}, -A_{i,t} clip(s_{i,t}, 1 - eps_low, 1 + eps_high))`` (no dual-clip),
  aggregated with ``"seq-mean-token-mean"``: ``(1 / N_seq) sum_i mean_t l_{i,t}``.

With the sequence advantage broadcast over its tokens (``A_{i,t} = A_i``, as every outcome estimator returns) the
loss equals the GSPO objective ``-(1/G) sum_i min(s_i A_i, clip(s_i) A_i)`` in value and gradient: an unclipped
token gets ``d loss / d log_prob_{i,t} = -A_i s_i / (|y_i| N_seq)``, a clipped sequence gets 0.

GSPO needs far smaller clip ranges than token-level PPO (the paper uses 3e-4 and 4e-4); with the PPO default 0.2
the sequence ratio is practically never clipped.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional

import torch

from hybridflow.algorithms.aggregation import agg_loss, check_same_shape
from hybridflow.algorithms.policy_loss_registry import LOG_RATIO_CLAMP, clip_range, register_policy_loss
from hybridflow.algorithms.rollout_correction import correction_weights
from hybridflow.algorithms.utils import masked_mean

logger = logging.getLogger(__name__)

__all__ = ["GSPO_LOSS_AGG_MODE", "compute_policy_loss_gspo"]

GSPO_LOSS_AGG_MODE = "seq-mean-token-mean"  # the aggregation the GSPO objective prescribes


@functools.lru_cache(maxsize=None)
def _warn_gspo_agg_mode(loss_agg_mode: str) -> None:
    logger.warning("policy loss 'gspo' aggregates with %r as its objective prescribes; actor.loss_agg_mode=%r "
                   "is ignored for the policy loss", GSPO_LOSS_AGG_MODE, loss_agg_mode)


def _gspo_token_ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor,
                      valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s_{i,t}, log_ratio)``, each ``(B, T)``: the GSPO-token ratio (value ``s_i`` on every token, gradient
    ``s_i`` w.r.t. ``log_prob``; see the module docstring) and the detached, clamped token log-ratio (0 on
    padding)."""
    zeros = torch.zeros_like(log_prob)
    log_ratio = torch.where(valid, log_prob.detach() - old_log_prob.detach(), zeros)
    log_ratio = torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    seq_log_ratio = masked_mean(log_ratio, valid, axis=-1)  # (B,), log s_i, detached
    # value 0, gradient 1 w.r.t. log_prob on valid tokens; the where keeps padded garbage out
    token_grad_path = torch.where(valid, log_prob - log_prob.detach(), zeros)
    return torch.exp(seq_log_ratio[:, None] + token_grad_path), log_ratio


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = GSPO_LOSS_AGG_MODE,
    config: Any = None,
    rollout_log_probs: Optional[torch.Tensor] = None,
    **agg_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO policy loss (Zheng et al. 2025, arXiv 2507.18071, eq. 5 in its GSPO-token form; see the module
    docstring for the ratio, the per-token loss and its gradient).

    ``loss_agg_mode``: GSPO's objective averages over sequences and then tokens, so the loss always uses
    ``"seq-mean-token-mean"``; any other value is ignored (a warning is logged once per value). With
    ``config.tis_imp_ratio_cap > 0`` each ``l_{i,t}`` is multiplied by the constant token weight
    ``min(exp(old_log_prob - rollout_log_probs), cap)`` (:func:`~hybridflow.algorithms.rollout_correction.tis_weights`) before aggregation, as for
    ``"vanilla"`` (``tis_level=sequence``: ``min(rho(y), cap)``); with ``config.rollout_rs`` the tokens MIS rejects
    get weight 0 (:func:`~hybridflow.algorithms.rollout_correction.correction_weights`). Only ``log_prob`` receives a
    gradient; ``old_log_prob`` and ``advantages`` are constants.

    Args:
        old_log_prob: ``(B, T)`` log-probs of the behaviour (rollout-time) policy.
        log_prob: ``(B, T)`` log-probs of the current policy (differentiable).
        advantages: ``(B, T)`` advantages (normally constant along each sequence).
        response_mask: ``(B, T)`` 0/1 mask of valid response tokens.
        loss_agg_mode: ignored unless ``"seq-mean-token-mean"`` (see above).
        config: actor config read by attribute: ``clip_ratio_low`` / ``clip_ratio_high`` (each falling back to
            ``clip_ratio``), ``tis_imp_ratio_cap``, ``tis_level``, ``rollout_rs*``.
        rollout_log_probs: ``(B, T)`` float32 sampling log-probs of the rollout; used only by TIS and MIS.
        **agg_kwargs: ``num_seqs`` (the mini-batch total when accumulating micro-batches; ``num_tokens`` /
            ``loss_scale_factor`` are unused by this mode).

    Returns:
        ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``: the scalar loss; the fraction of valid
        tokens whose clipped branch is active; the masked mean of ``old_log_prob - log_prob`` (token
        level, clamped like the log-ratio); 0 (GSPO has no dual-clip). The last three are detached.

    Raises:
        ValueError: no clip range in ``config``, input shapes differ, or TIS / MIS is on without
            ``rollout_log_probs``.
    """
    check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
                     response_mask=response_mask)
    low, high = clip_range(config, "gspo")
    tis = correction_weights(old_log_prob, rollout_log_probs, response_mask, config, "gspo")
    if loss_agg_mode != GSPO_LOSS_AGG_MODE:
        _warn_gspo_agg_mode(loss_agg_mode)
    valid = response_mask != 0
    advantages = torch.where(valid, advantages.detach(), torch.zeros_like(log_prob))
    ratio, log_ratio = _gspo_token_ratio(old_log_prob, log_prob, valid)  # (B, T): s_{i,t}
    surrogate = -advantages * ratio
    surrogate_clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    pg_losses = torch.maximum(surrogate, surrogate_clipped)
    if tis is not None:
        pg_losses = pg_losses * tis
    pg_loss = agg_loss(pg_losses, response_mask, GSPO_LOSS_AGG_MODE, **agg_kwargs)
    with torch.no_grad():
        pg_clipfrac = masked_mean((surrogate_clipped > surrogate).float(), response_mask)
        ppo_kl = masked_mean(-log_ratio, response_mask)
    return pg_loss, pg_clipfrac, ppo_kl, torch.zeros_like(ppo_kl)
