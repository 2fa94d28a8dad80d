"""REINFORCE-family advantage estimators (no critic): RLOO, REINFORCE++ (plus its baseline variant), ReMax.

They are registered in the advantage-estimator registry of :mod:`hybridflow.algorithms.advantage`
(same conventions: shapes ``(B, T)`` = batch, response tokens; ``response_mask`` is 0/1 of any dtype
and padded entries of per-token inputs are ignored whatever they hold; computed under
``torch.no_grad()``; float32 ``(advantages, returns)``, 0 at padded positions). Importing
:mod:`hybridflow.algorithms` registers them.

Each response's *score* is the sum of its token rewards over its valid tokens (with an outcome
reward that is the reward on the last valid token, minus any in-reward KL terms). Estimators that
compare responses to the same prompt group them by ``index``, the uid of the prompt *instance*
(never by prompt text), exactly like GRPO.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridflow.algorithms._groups import broadcast_over_valid, check_batch, group_ids, group_total, outcome_scores
from hybridflow.algorithms.advantage import register_adv_est
from hybridflow.algorithms.utils import masked_whiten


def _returns_to_go(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_t'`` right to left over the valid tokens (``t'`` the next valid token).

    A hole in the mask is skipped (the running return is carried across it, not discounted);
    rewards at masked positions never enter. Returns ``(B, T)`` float32, 0 at masked positions.
    """
    valid = response_mask != 0
    zeros = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
    rewards = torch.where(valid, token_level_rewards.float(), zeros)
    returns = torch.zeros_like(zeros)
    running = zeros[:, 0].clone()
    for t in reversed(range(valid.shape[1])):
        running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid[:, t], running, zeros[:, t])
    return returns


@register_adv_est("rloo", needs_groups=True)
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: REINFORCE with a leave-one-out baseline (Ahmadian et al. 2024, arXiv 2402.14740, the RLOO estimator).

    For response ``i`` in a group of ``n >= 2`` responses with scores ``s_1..s_n`` (grouped by
    ``index``): ``A_i = s_i - (1 / (n - 1)) * sum_{j != i} s_j``, equivalently
    ``n / (n - 1) * (s_i - mean(s))``. The baseline does not depend on ``s_i``, so the estimator is
    unbiased. A group of size 1 has no other sample to form a baseline and gets advantage 0
    (verl instead returns the raw score there). No whitening; group sums are taken in float64,
    so a group of equal scores gets exactly 0.

    Args:
        token_level_rewards: ``(B, T)`` rewards.
        response_mask: ``(B, T)`` 0/1 mask of valid tokens.
        index: ``(B,)`` array-like of group ids (uids), any hashable, sortable values.
        epsilon: unused; kept for verl's signature.

    Returns:
        ``(advantages, returns)``: the same ``(B, T)`` float32 tensor twice, the sequence advantage
        on every valid token and 0 elsewhere.

    Raises:
        ValueError: shapes differ or are not 2-D, or ``index`` does not have one entry per row.
    """
    del epsilon  # verl's signature has it; the leave-one-out baseline needs no division guard
    check_batch(token_level_rewards=token_level_rewards, response_mask=response_mask)
    group = group_ids(index, token_level_rewards.shape[0], token_level_rewards.device)
    with torch.no_grad():
        scores = outcome_scores(token_level_rewards, response_mask)  # (B,) float64
        size = group_total(torch.ones_like(scores), group)
        others_mean = (group_total(scores, group) - scores) / torch.clamp(size - 1, min=1)
        seq_adv = torch.where(size > 1, scores - others_mean, torch.zeros_like(scores))
        advantages = broadcast_over_valid(seq_adv, response_mask)
    return advantages, advantages


@register_adv_est("reinforce_plus_plus")
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv 2501.03262): token-level return, then global batch normalization.

    Per token the discounted return-to-go ``G_t = sum_{k >= t} gamma^(k - t) r_k`` over the valid
    tokens of the row (a hole in the mask is skipped, not counted as a step; rewards at masked
    positions never enter). ``token_level_rewards`` usually already holds the per-token KL penalty
    ``-beta * KL_t`` plus the outcome score on the last token, so that with ``gamma = 1``
    ``G_t = r(o, q) - beta * sum_{i >= t} KL(i)``, the paper's token advantage. The advantages are
    ``G`` whitened over all valid tokens of the batch
    (:func:`~hybridflow.algorithms.utils.masked_whiten`: zero mean, unit unbiased variance), the
    paper's global normalization ``(A - mean_batch) / std_batch`` that replaces a critic or a
    per-prompt baseline. (These are eqs. 8 and 10 in early arXiv versions; the numbering changed
    between versions.)

    Args:
        token_level_rewards: ``(B, T)`` rewards.
        response_mask: ``(B, T)`` 0/1 mask of valid tokens.
        gamma: discount (``algorithm.gamma``; 1.0 gives the undiscounted return).

    Returns:
        ``(advantages, returns)``, each ``(B, T)`` float32 and 0 at masked positions; ``returns``
        is ``G`` before whitening.

    Raises:
        ValueError: shapes differ or are not 2-D; fewer than 2 valid tokens in the batch (whitening).
    """
    check_batch(token_level_rewards=token_level_rewards, response_mask=response_mask)
    with torch.no_grad():
        returns = _returns_to_go(token_level_rewards, response_mask, gamma)
        advantages = masked_whiten(returns, response_mask != 0)
    return advantages, returns


@register_adv_est("reinforce_plus_plus_baseline", needs_groups=True)
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with baseline (Hu 2025, arXiv 2501.03262, the group-sampling variant, ``n > 1``).

    Each response's score minus the mean score of its group (grouped by ``index``):
    ``A_i = s_i - mean_{j in group(i)} s_j``, placed on every valid token, then whitened over all
    valid tokens of the batch (:func:`~hybridflow.algorithms.utils.masked_whiten`; the mean and
    variance are token-weighted, so longer responses weigh more, as in verl). A group of size 1 is
    its own mean and gets 0 before whitening; so does a group of equal scores. Group sums are taken
    in float64.

    Args:
        token_level_rewards: ``(B, T)`` rewards.
        response_mask: ``(B, T)`` 0/1 mask of valid tokens.
        index: ``(B,)`` array-like of group ids (uids), any hashable, sortable values.
        epsilon: unused; kept for verl's signature (the whitening adds its own 1e-8 to the variance).

    Returns:
        ``(advantages, returns)``: the same ``(B, T)`` float32 tensor twice, 0 at masked positions.

    Raises:
        ValueError: shapes differ or are not 2-D; ``index`` does not have one entry per row; fewer
            than 2 valid tokens in the batch (whitening).
    """
    del epsilon
    check_batch(token_level_rewards=token_level_rewards, response_mask=response_mask)
    group = group_ids(index, token_level_rewards.shape[0], token_level_rewards.device)
    with torch.no_grad():
        scores = outcome_scores(token_level_rewards, response_mask)  # (B,) float64
        size = group_total(torch.ones_like(scores), group)
        centered = scores - group_total(scores, group) / size  # exactly 0 for a group of size 1
        advantages = masked_whiten(broadcast_over_valid(centered, response_mask), response_mask != 0)
    return advantages, advantages


@register_adv_est("remax", needs_reward_baselines=True)
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023, arXiv 2310.10505, Algorithm 1): REINFORCE with a greedy-response baseline.

    ``returns_t = sum_{k >= t} r_k`` (undiscounted return-to-go over the valid tokens; with an
    outcome reward this is the score on every valid token) and
    ``A_t = returns_t - b`` on valid tokens, where ``b`` is the reward of the greedy (argmax)
    response to the same prompt, computed by the driver and passed per sample. No whitening.

    Args:
        token_level_rewards: ``(B, T)`` rewards of the sampled responses.
        reward_baselines: ``(B,)`` reward of the greedy response to each sample's prompt (the driver
            passes ``batch["reward_baselines"]``).
        response_mask: ``(B, T)`` 0/1 mask of valid tokens.

    Returns:
        ``(advantages, returns)``, each ``(B, T)`` float32 and 0 at masked positions.

    Raises:
        ValueError: shapes differ or are not 2-D, or ``reward_baselines`` is not ``(B,)``.
    """
    check_batch(token_level_rewards=token_level_rewards, response_mask=response_mask)
    batch = token_level_rewards.shape[0]
    if tuple(reward_baselines.shape) != (batch,):
        raise ValueError(f"reward_baselines must have shape ({batch},) (one greedy-response reward per "
                         f"sample), got {tuple(reward_baselines.shape)}")
    with torch.no_grad():
        returns = _returns_to_go(token_level_rewards, response_mask, gamma=1.0)
        advantages = returns - broadcast_over_valid(reward_baselines.to(returns.device), response_mask)
    return advantages, returns
