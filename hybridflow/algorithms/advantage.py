"""Advantage estimators and their registry.

Shapes: ``(B, T)`` = batch, response tokens. ``response_mask`` is 0/1 of any dtype (0 = padding or
a token the policy did not generate); padded entries of per-token inputs are ignored, whatever
they hold. Estimators run under ``torch.no_grad()`` and return float32 ``(advantages, returns)``,
both 0 at padded positions.

Calling convention
------------------
Registered estimators keep their natural (verl) signatures and can be called directly. The
registry stores an adapter, so the driver calls every estimator the same way, with keywords only::

    advantages, returns = get_adv_estimator_fn(config.algorithm.adv_estimator)(
        token_level_rewards=batch["token_level_rewards"],  # (B, T)
        response_mask=batch["response_mask"],              # (B, T)
        values=batch.get("values"),                         # (B, T) or None
        index=non_tensor["uid"],                            # (B,) np.ndarray or None
        config=config.algorithm,
    )

The adapter fills each parameter of the estimator from, in order: a keyword given and not None;
else the attribute of the same name on ``config`` (so ``gamma``/``lam`` and
``norm_adv_by_std_in_grpo`` come from ``algorithm``); else the parameter's default. An estimator
with a parameter named ``config`` receives ``config`` itself. Keywords the estimator does not take
are ignored (the driver can pass everything it has), unless it takes ``**kwargs``, which then gets
them. A required parameter found nowhere raises ``TypeError`` naming the estimator and parameter.
Users add estimators with ``@register_adv_est("name")`` and select them by name.

Registered here: ``gae``, ``grpo``; in :mod:`hybridflow.algorithms.advantage_reinforce`: ``rloo``,
``reinforce_plus_plus``, ``reinforce_plus_plus_baseline`` and ``remax`` (which also needs
``reward_baselines=batch["reward_baselines"]``, ``(B,)``, passed by keyword like the inputs above).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch

from hybridflow.algorithms._groups import broadcast_over_valid, check_batch, group_ids, group_total, outcome_scores
from hybridflow.algorithms.utils import masked_whiten
from hybridflow.registry import Registry

_MISSING = object()
_SKIPPED_KINDS = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _uniform_call_adapter(name: str, fn: Callable) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """Wrap ``fn`` so it can be called as ``adapter(config=..., **named_inputs)`` (see module docstring)."""
    params = inspect.signature(fn).parameters
    takes_var_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    @functools.wraps(fn)
    def adapter(config: Any = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        call: dict[str, Any] = {}
        for pname, param in params.items():
            if param.kind in _SKIPPED_KINDS:
                continue
            if pname == "config":
                call[pname] = config
                continue
            value = kwargs.get(pname)
            if value is None and config is not None:
                value = getattr(config, pname, None)
            if value is not None:
                call[pname] = value
            elif param.default is inspect.Parameter.empty:
                raise TypeError(f"advantage estimator {name!r} needs {pname!r}: pass it as a keyword "
                                f"or set it on the algorithm config")
        if takes_var_kwargs:
            call.update({k: v for k, v in kwargs.items() if k not in params})
        return fn(**call)

    return adapter


ADV_ESTIMATORS: Registry = Registry("advantage estimator", adapter=_uniform_call_adapter, config_section="algorithm")


def register_adv_est(name: str, **meta: Any) -> Callable[[Callable], Callable]:
    """Decorator registering an advantage estimator under ``name``, with metadata ``meta``.

    The decorated function is returned unchanged; the registry stores the uniform-call adapter.
    The function must return ``(advantages, returns)``, each ``(B, T)``. Metadata the package reads:
    ``needs_values=True`` (the estimator reads critic values ``V(s_t)``, so a critic is trained unless
    ``critic.enable`` says otherwise; GAE) and ``needs_reward_baselines=True`` (it reads
    ``batch["reward_baselines"]``, which only the ``remax`` driver supplies; ReMax) and ``needs_groups=True`` (its
    baseline is the other samples of the same prompt, so ``rollout.n == 1`` gives every advantage 0; the driver
    warns). ``config=SomeDataclass``: the estimator's own keys, joining the ``algorithm`` section and read by the
    adapter like the others (GRPO's ``norm_adv_by_std_in_grpo``); ``config_checks=fn`` validates them at load.

    Raises:
        ValueError: another function is already registered under ``name``.
    """
    return ADV_ESTIMATORS.register(name, **meta)


def get_adv_estimator_fn(name: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The uniform-call adapter of the estimator registered as ``name`` (see module docstring).

    Raises:
        UnknownNameError: (a ``KeyError`` and ``ValueError``) listing the registered names.
    """
    return ADV_ESTIMATORS.get(name)


def needs_critic(estimator: str) -> bool:
    """Whether the estimator ``estimator`` reads critic values (its ``needs_values`` metadata): the default of
    ``critic.enable``.

    Raises:
        UnknownNameError: ``estimator`` is not registered.
    """
    return bool(ADV_ESTIMATORS.meta(estimator, "needs_values", False))


def need_critic_for(enable: Optional[bool], estimator: Any) -> bool:
    """Whether a run trains a critic: ``critic.enable`` (``enable``) when set, else :func:`needs_critic` of its
    ``algorithm.adv_estimator`` (False for an estimator no entry is registered under: the config's name check
    reports that). Raises nothing."""
    return bool(enable) if enable is not None else bool(ADV_ESTIMATORS.declared(estimator, "needs_values", False))


def needs_reward_baselines(estimator: str) -> bool:
    """Whether the estimator ``estimator`` reads ``reward_baselines`` (its ``needs_reward_baselines`` metadata).

    Raises:
        UnknownNameError: ``estimator`` is not registered.
    """
    return bool(ADV_ESTIMATORS.meta(estimator, "needs_reward_baselines", False))


@register_adv_est("gae", needs_values=True)
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016, arXiv 1506.02438, eq. 16).

    Right to left over the *valid* tokens of each row, with ``t'`` the next valid token after ``t``:
    ``delta_t = r_t + gamma * V_t' - V_t`` and ``A_t = delta_t + gamma * lam * A_t'``, where
    ``V_t' = A_t' = 0`` after the last valid token. Values and rewards at masked positions never
    enter: a hole in the mask is skipped, the next valid token's value carried across it. In a multi-turn
    response the holes are observation spans (tool output, mask 0), so a span is transparent: the step from
    the last token of a model turn goes straight to the first token of the next turn, discounted once
    (``gamma * V_t'``, not ``gamma ** (span + 1)``), and no value is read inside the span.
    ``returns = A + V`` (the critic's regression target) is taken before whitening; then the
    advantages are whitened over all valid tokens of the batch (:func:`masked_whiten`). Computed without a loop
    over tokens: each row's valid tokens are moved to its front, and ``A_t = sum_k (gamma * lam) ** (k - t) *
    delta_k`` is a blockwise matrix product (:func:`discounted_reverse_cumsum`).

    Args:
        token_level_rewards: ``(B, T)`` rewards (e.g. the score on the last token, minus a KL term).
        values: ``(B, T)`` critic values ``V(s_t)``.
        response_mask: ``(B, T)`` 0/1 mask of valid tokens.
        gamma: discount.
        lam: GAE lambda.

    Returns:
        ``(advantages, returns)``, each ``(B, T)`` float32, 0 at masked positions; advantages have
        mean 0 and unbiased variance ~1 over the valid tokens.

    Raises:
        ValueError: shapes differ or are not 2-D; fewer than 2 valid tokens in the batch (whitening).
    """
    check_batch(token_level_rewards=token_level_rewards, values=values, response_mask=response_mask)
    with torch.no_grad():
        valid = response_mask != 0
        zeros = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
        # each row's valid tokens moved to its front, in order (holes and padding after them, zeroed), so the
        # next valid token is the next position
        order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
        rewards = torch.where(valid, token_level_rewards.float(), zeros).gather(1, order)
        values = torch.where(valid, values.float(), zeros).gather(1, order)
        next_values = torch.cat([values[:, 1:], zeros[:, :1]], dim=1)
        compact = discounted_reverse_cumsum(rewards + gamma * next_values - values, gamma * lam)
        advantages = zeros.scatter(1, order, compact)
        returns = torch.where(valid, advantages + zeros.scatter(1, order, values), zeros)
        advantages = masked_whiten(advantages, valid)
    return advantages, returns


def discounted_reverse_cumsum(x: torch.Tensor, discount: float, block: int = 256) -> torch.Tensor:
    """``y_t = sum_{k >= t} discount ** (k - t) * x_k`` along the last dimension of ``x`` (B, T) fp32, as
    matrix products over blocks of ``block`` positions (right to left, each carrying ``discount ** n * y`` of the
    block after it) instead of T sequential steps; ``discount == 1`` is a reversed cumulative sum."""
    if discount == 1.0:
        return x.flip(-1).cumsum(-1).flip(-1)
    length = x.shape[-1]
    span = torch.arange(min(block, length), device=x.device, dtype=x.dtype)
    lag = span[None, :] - span[:, None]  # (k - t) for column k, row t
    powers = torch.where(lag >= 0, torch.tensor(discount, dtype=x.dtype, device=x.device) ** lag.clamp(min=0),
                         torch.zeros((), dtype=x.dtype, device=x.device))  # [t, k]: discount ** (k - t), k >= t
    out = torch.empty_like(x)
    carry = x.new_zeros(x.shape[0])  # y at the first position after the block
    for end in range(length, 0, -block):
        start = max(0, end - block)
        n = end - start
        out[:, start:end] = x[:, start:end] @ powers[:n, :n].T + carry[:, None] * discount ** (n - span[:n])
        carry = out[:, start]
    return out


@dataclass
class GRPOConfig:
    norm_adv_by_std_in_grpo: bool = True  # GRPO: divide by the group std (false: Dr. GRPO)


@register_adv_est("grpo", needs_groups=True, config=GRPOConfig)
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (Shao et al. 2024, arXiv 2402.03300, sec. 4.1.2).

    Each response's score is the sum of its token rewards over valid tokens. Responses are grouped
    by their ``index`` value (the uid of the prompt *instance*, so two copies of the same prompt
    text with different uids are separate groups). Within a group of size ``n >= 2``:
    ``A_i = (s_i - mean) / (std + epsilon)`` with the unbiased std (or ``s_i - mean`` when
    ``norm_adv_by_std_in_grpo`` is False, as Dr. GRPO recommends, arXiv 2503.20783). A group of
    size 1 has no baseline and gets advantage 0 (verl instead returns the raw score there).
    Group statistics are computed in float64, so a group of equal scores gets exactly ~0.

    Args:
        token_level_rewards: ``(B, T)`` rewards (usually only the last valid token is non-zero).
        response_mask: ``(B, T)`` 0/1 mask of valid tokens.
        index: ``(B,)`` array-like of group ids (any hashable, sortable values, e.g. uid strings).
        epsilon: added to the std.
        norm_adv_by_std_in_grpo: divide by the group std.

    Returns:
        ``(advantages, returns)``: the same ``(B, T)`` float32 tensor twice, the sequence advantage
        broadcast over its valid tokens and 0 elsewhere.

    Raises:
        ValueError: shapes differ, or ``index`` does not have one entry per row.
    """
    check_batch(token_level_rewards=token_level_rewards, response_mask=response_mask)
    group = group_ids(index, token_level_rewards.shape[0], token_level_rewards.device)
    with torch.no_grad():
        scores = outcome_scores(token_level_rewards, response_mask)  # (B,)
        size = group_total(torch.ones_like(scores), group)
        centered = scores - group_total(scores, group) / size
        seq_adv = centered
        if norm_adv_by_std_in_grpo:
            std = torch.sqrt(group_total(centered**2, group) / torch.clamp(size - 1, min=1))
            seq_adv = centered / (std + epsilon)
        seq_adv = torch.where(size > 1, seq_adv, torch.zeros_like(seq_adv))
        advantages = broadcast_over_valid(seq_adv, response_mask)
    return advantages, advantages
