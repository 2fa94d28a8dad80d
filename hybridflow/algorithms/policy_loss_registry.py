"""The policy-loss registry and what the registered losses share (the log-ratio clamp, the clip range read from the
actor config; the rollout/trainer mismatch corrections are in :mod:`hybridflow.algorithms.rollout_correction`).

The common signature of a registered loss and the meaning of its arguments are documented in
:mod:`hybridflow.algorithms.losses`. Metadata a loss may declare (read with :func:`policy_loss_meta`, so no code
decides on a loss's name):

- ``needs_rollout_log_probs=True``: the loss reads ``rollout_log_probs`` (the behaviour policy ``mu`` the
  rollout sampled with) as its importance-weight denominator (AIPO);
- ``importance_cap="<actor config key>"``: the key of the actor config holding the cap the loss applies to the
  importance weight ``pi / mu`` (AIPO: ``aipo_rho``); a loss without one is capped by truncated IS
  (``tis_imp_ratio_cap``) when that is on;
- ``corrects_off_policy=True``: the loss weights stale samples by ``pi / mu`` itself, so the async driver may
  train on samples older than the policy without another correction (AIPO, IcePop);
- ``masked_tokens=(metric, fn)``: the loss masks tokens out by the mismatch ratio itself; ``fn(old_log_prob,
  rollout_log_probs, response_mask, config)`` gives the ``(B, T)`` bool of the masked ones and the actor logs their
  share of the valid tokens as ``metric`` (IcePop: ``actor/icepop_masked_frac``);
- ``own_mismatch_weight=True``: the loss weights tokens by the mismatch ratio itself, so truncated IS
  (``tis_imp_ratio_cap``) would weight them twice and is refused with it (IcePop);
- ``config=SomeDataclass``: the loss's own hyper-parameters, keys of ``actor_rollout_ref.actor`` (AIPO's
  ``aipo_rho``), handed to the loss in its ``config`` (the actor section) by their names; ``config_checks=fn``:
  ``fn(get) -> list[str]`` validating them at load (:mod:`hybridflow.registry`).

Shapes: ``(B, T)`` = batch, response tokens.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch

from hybridflow.registry import Registry

__all__ = ["LOG_RATIO_CLAMP", "POLICY_LOSSES", "get_policy_loss_fn", "importance_weight_cap", "policy_loss_meta",
           "register_policy_loss"]

LOG_RATIO_CLAMP = 20.0  # |log pi/pi_old| is clamped to this before exp() so the ratio stays finite

POLICY_LOSSES: Registry = Registry("policy loss", config_section="actor_rollout_ref.actor")


def register_policy_loss(name: str, **meta: Any) -> Callable[[Callable], Callable]:
    """Decorator registering a policy loss under ``name`` with metadata ``meta`` (see the module docstring; the
    signature: :mod:`hybridflow.algorithms.losses`).

    The actor always passes ``rollout_log_probs=`` as a keyword; a loss that only has ``**agg_kwargs``
    would forward it to :func:`agg_loss` and fail in the middle of training, so it is refused here.

    Raises:
        TypeError: the function has no ``rollout_log_probs`` parameter.
        ValueError: ``name`` is taken by a different function, or empty.
    """
    register = POLICY_LOSSES.register(name, **meta)

    def decorator(fn: Callable) -> Callable:
        if "rollout_log_probs" not in inspect.signature(fn).parameters:
            raise TypeError(f"policy loss {name!r} ({fn.__module__}.{fn.__qualname__}) must accept the keyword "
                            "rollout_log_probs=None (see hybridflow.algorithms.losses for the common signature)")
        return register(fn)

    return decorator


def get_policy_loss_fn(name: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The policy loss registered as ``name``.

    Raises:
        UnknownNameError: (a ``KeyError`` and ``ValueError``) listing the registered names.
    """
    return POLICY_LOSSES.get(name)


def policy_loss_meta(name: str, key: str, default: Any = None) -> Any:
    """One metadata value of the policy loss ``name`` (see the module docstring).

    Raises:
        UnknownNameError: ``name`` is not registered.
    """
    return POLICY_LOSSES.meta(name, key, default)


def importance_weight_cap(actor_config: Any) -> Optional[float]:
    """The cap the configured policy loss applies to the importance weight ``pi / mu``, or None when uncapped.

    The loss's own cap when it declares ``importance_cap`` (AIPO's ``aipo_rho``), else ``tis_imp_ratio_cap`` when
    truncated IS is on (> 0), else None. ``actor_config`` is ``actor_rollout_ref.actor``, read by attribute.

    Raises:
        UnknownNameError: ``actor_config.policy_loss`` is not registered.
    """
    key = policy_loss_meta(actor_config.policy_loss, "importance_cap")
    if key is not None:
        return getattr(actor_config, key)
    cap = getattr(actor_config, "tis_imp_ratio_cap", None)
    return cap if cap is not None and cap > 0 else None


def clip_range(config: Any, loss: str) -> tuple[float, float]:
    """``(eps_low, eps_high)`` from ``clip_ratio_low``/``clip_ratio_high``, each falling back to ``clip_ratio``."""
    fallback = getattr(config, "clip_ratio", None)
    low = getattr(config, "clip_ratio_low", None)
    high = getattr(config, "clip_ratio_high", None)
    low = fallback if low is None else low
    high = fallback if high is None else high
    if low is None or high is None:
        raise ValueError(f"policy loss {loss!r} needs actor.clip_ratio, or both actor.clip_ratio_low and "
                         f"actor.clip_ratio_high (got clip_ratio={fallback}, clip_ratio_low={low}, "
                         f"clip_ratio_high={high})")
    return float(low), float(high)
