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

__all__ = ["LOG_RATIO_CLAMP", "LOSS_CALL_KEYWORDS", "LOSS_CALL_POSITIONAL", "POLICY_LOSSES", "get_policy_loss_fn",
           "importance_weight_cap", "loss_signature_problem", "policy_loss_meta", "register_policy_loss"]

LOG_RATIO_CLAMP = 20.0  # |log pi/pi_old| is clamped to this before exp() so the ratio stays finite

POLICY_LOSSES: Registry = Registry("policy loss", config_section="actor_rollout_ref.actor")


#: how the actor calls a policy loss: these positionally, then ``rollout_log_probs=`` and the normalisers of
#: :func:`~hybridflow.algorithms.aggregation.agg_loss` (``hybridflow.training.micro.global_agg_kwargs``) by keyword
LOSS_CALL_POSITIONAL = ("old_log_prob", "log_prob", "advantages", "response_mask", "loss_agg_mode", "config")
LOSS_CALL_KEYWORDS = ("rollout_log_probs", "num_tokens", "num_seqs", "loss_scale_factor")


def loss_signature_problem(fn: Callable) -> Optional[str]:
    """Why the actor's call of ``fn`` would fail (None: it would not), found from the signature alone.

    ``fn`` must take :data:`LOSS_CALL_POSITIONAL` positionally and :data:`LOSS_CALL_KEYWORDS` by keyword, by name or
    through ``*args`` / ``**kwargs`` (``def my_loss(*args, **kwargs)`` is fine). One exception: a loss that spells
    the positional parameters out by name but not ``rollout_log_probs`` (the signature before that keyword existed)
    would hand it on to ``agg_loss`` inside its ``**agg_kwargs`` and fail in the middle of training.
    """
    try:
        signature = inspect.signature(fn)
        signature.bind(*LOSS_CALL_POSITIONAL, **dict.fromkeys(LOSS_CALL_KEYWORDS))
    except (TypeError, ValueError) as err:
        return f"cannot take the actor's call fn({', '.join(LOSS_CALL_POSITIONAL)}, " \
               f"{'=..., '.join(LOSS_CALL_KEYWORDS)}=...): {err}"
    positional = [p for p in signature.parameters.values()
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if "rollout_log_probs" not in signature.parameters and len(positional) >= len(LOSS_CALL_POSITIONAL):
        return "must accept the keyword rollout_log_probs=None (its **kwargs would pass it on to agg_loss)"
    return None


def register_policy_loss(name: str, **meta: Any) -> Callable[[Callable], Callable]:
    """Decorator registering a policy loss under ``name`` with metadata ``meta`` (see the module docstring; the
    signature: :mod:`hybridflow.algorithms.losses`; :func:`loss_signature_problem` checks it takes the actor's call).

    Raises:
        TypeError: the function cannot take the actor's call (one line saying why).
        ValueError: ``name`` is taken by a different function, or empty.
    """
    register = POLICY_LOSSES.register(name, **meta)

    def decorator(fn: Callable) -> Callable:
        problem = loss_signature_problem(fn)
        if problem is not None:
            raise TypeError(f"policy loss {name!r} ({fn.__module__}.{fn.__qualname__}) {problem} (see "
                            "hybridflow.algorithms.losses for the common signature)")
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
