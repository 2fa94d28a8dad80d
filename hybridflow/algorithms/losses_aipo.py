"""AIPO: policy gradient with truncated importance weights on the generator's policy (LlamaRL, Meta 2025,
arXiv 2505.24034), the policy loss of the asynchronous driver. Registered as ``"aipo"``, declaring that it reads
``rollout_log_probs``, that its cap is ``actor.aipo_rho`` and that it corrects off-policy samples itself
(:mod:`hybridflow.algorithms.policy_loss_registry`).

Shapes: ``(B, T)`` = batch, response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from hybridflow.algorithms.aggregation import agg_loss, check_same_shape
from hybridflow.algorithms.policy_loss_registry import LOG_RATIO_CLAMP, register_policy_loss
from hybridflow.algorithms.rollout_correction import rejection_keep
from hybridflow.algorithms.utils import masked_mean

__all__ = ["AIPOConfig", "compute_policy_loss_aipo"]


@dataclass
class AIPOConfig:
    aipo_rho: float = 4.0  # AIPO cap rho on the importance weight pi/mu (policy_loss=aipo; LlamaRL suggests 2-10)


def aipo_config_problems(get: Callable[[str], Any]) -> list[str]:
    """``actor_rollout_ref.actor.aipo_rho`` > 0 (``get(dotted_key)`` returns a key's value)."""
    rho = get("actor_rollout_ref.actor.aipo_rho")
    return [] if rho > 0 else [f"actor_rollout_ref.actor.aipo_rho: must be > 0 (AIPO importance-weight cap), got {rho}"]


@register_policy_loss("aipo", needs_rollout_log_probs=True, importance_cap="aipo_rho", corrects_off_policy=True,
                      config=AIPOConfig, config_checks=aipo_config_problems)
def compute_policy_loss_aipo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_log_probs: Optional[torch.Tensor] = None,
    **agg_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """AIPO: policy gradient with truncated importance weights on the generator's policy.

    Asynchronous Importance-weighted Policy Optimization of LlamaRL (Meta 2025, arXiv 2505.24034):
    a token sampled by a stale generator policy ``mu`` is trained on by the current policy
    ``pi_theta`` with the weight ``w = min(pi_theta / mu, rho)``, which is held constant (``sg``:
    stop-gradient)::

        l_t = -sg(w_t) * A_t * log pi_theta(y_t),   w_t = min(exp(log pi_theta(y_t) - log mu(y_t)), rho)

    so ``grad l_t = -(pi/mu) A_t grad log pi`` (the importance-weighted policy gradient) while
    ``pi/mu <= rho`` and ``-rho A_t grad log pi`` above it; the cap bounds the variance a very stale
    token can add. There is no PPO clipping. The log-ratio is clamped to ``[-20, 20]`` before
    ``exp``. The ``l_t`` are reduced by :func:`agg_loss` with ``loss_agg_mode`` and ``agg_kwargs``
    (with ``"token-mean"``: ``d pg_loss / d log_prob_t = -w_t A_t / N_tok``). The value of
    ``pg_loss`` is a surrogate (it scales with ``log pi``); only its gradient is meaningful.

    ``mu`` is ``rollout_log_probs`` when given (the log-probs the generator recorded while
    sampling), else ``old_log_prob`` (then ``mu`` is whatever policy the caller recomputed them
    with). ``actor.tis_imp_ratio_cap`` is ignored: ``rho`` already truncates the same ratio. Only
    ``log_prob`` receives a gradient; ``old_log_prob``, ``rollout_log_probs`` and ``advantages`` are
    constants.

    Args:
        old_log_prob: ``(B, T)`` behaviour log-probs; ``mu`` when ``rollout_log_probs`` is None.
        log_prob: ``(B, T)`` log-probs of the current policy (differentiable).
        advantages: ``(B, T)`` advantages.
        response_mask: ``(B, T)`` 0/1 mask of valid response tokens.
        loss_agg_mode: see :func:`agg_loss`.
        config: actor config read by attribute; ``aipo_rho`` is the cap ``rho > 0``.
        rollout_log_probs: ``(B, T)`` float32 log-probs of the generator that sampled each token.
        **agg_kwargs: ``num_tokens`` / ``num_seqs`` / ``loss_scale_factor`` for :func:`agg_loss`.

    Returns:
        ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``: the scalar loss; the fraction of valid
        tokens whose ratio ``pi/mu`` exceeds ``rho`` (capped); the masked mean of
        ``log mu - log pi`` (clamped like the log-ratio; an estimate of KL(mu || pi)); 0. The last
        three are detached.

    Raises:
        ValueError: ``config.aipo_rho`` missing or not > 0, or input shapes differ.
    """
    rho = getattr(config, "aipo_rho", None)
    if rho is None or not rho > 0:
        raise ValueError(f"policy loss 'aipo' needs actor.aipo_rho > 0 (the importance-weight cap rho), got {rho!r}")
    mu_log_prob = old_log_prob if rollout_log_probs is None else rollout_log_probs
    check_same_shape(mu_log_prob=mu_log_prob, log_prob=log_prob, advantages=advantages,
                      response_mask=response_mask)

    valid = response_mask != 0
    zeros = torch.zeros_like(log_prob)
    advantages = torch.where(valid, advantages.detach(), zeros)
    log_ratio = torch.where(valid, log_prob.detach() - mu_log_prob.detach(), zeros)
    log_ratio = torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, max=float(rho))  # detached: log_ratio was built from detached inputs
    pg_losses = -weight * advantages * torch.where(valid, log_prob, zeros)
    keep = rejection_keep(old_log_prob, rollout_log_probs, response_mask, config, "aipo")
    if keep is not None:
        pg_losses = pg_losses * keep.float()

    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs)
    with torch.no_grad():
        pg_clipfrac = masked_mean((ratio > rho).float(), response_mask)
        ppo_kl = masked_mean(-log_ratio, response_mask)
    return pg_loss, pg_clipfrac, ppo_kl, torch.zeros_like(ppo_kl)
