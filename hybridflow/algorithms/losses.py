"""Token log-probabilities, entropy, loss aggregation, and the PPO policy and value losses.

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
metrics. Add a loss with ``@register_policy_loss("name")`` (it must have a ``rollout_log_probs``
parameter, even if it ignores it) and select it with ``actor.policy_loss=name``.
``compute_policy_loss`` keeps verl's direct signature (explicit clip ranges) and is what
``"vanilla"`` computes.

Truncated importance sampling (TIS) of the rollout/trainer mismatch: with
``actor.tis_imp_ratio_cap > 0``, ``"vanilla"`` and ``"gspo"`` multiply their per-token loss by
the constant ``min(exp(old_log_prob - rollout_log_probs), cap)`` before aggregation (see
:func:`_tis_weights`). ``"aipo"`` corrects the same gap with its own cap ``actor.aipo_rho``.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable, Optional, Union

import torch

from hybridflow.algorithms.registry import Registry, unknown_name_error
from hybridflow.algorithms.utils import masked_mean, masked_sum

logger = logging.getLogger(__name__)

LOG_RATIO_CLAMP = 20.0  # |log pi/pi_old| is clamped to this before exp() so the ratio stays finite

Number = Union[int, float, torch.Tensor]


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shape mismatch: {', '.join(f'{k}={v}' for k, v in shapes.items())}")


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


# --------------------------------------------------------------------------------------------------
# Loss aggregation
# --------------------------------------------------------------------------------------------------


def _total(given: Optional[Number], default: Number, name: str) -> Number:
    """``given`` (checked > 0 when it is a plain number) or ``default``."""
    if given is None:
        return default
    if not isinstance(given, torch.Tensor) and not given > 0:
        raise ValueError(f"{name} must be > 0, got {given!r}")
    return given


def _token_mean(loss, mask, num_tokens, num_seqs, scale):
    count = mask.to(loss.dtype).sum()
    count = torch.where(count != 0, count, torch.ones_like(count))  # empty mask: loss 0, not NaN
    return masked_sum(loss, mask) / _total(num_tokens, count, "num_tokens")


def _seq_mean_token_sum(loss, mask, num_tokens, num_seqs, scale):
    return masked_sum(loss, mask) / _total(num_seqs, loss.shape[0], "num_seqs")


def _seq_mean_token_mean(loss, mask, num_tokens, num_seqs, scale):
    per_seq = masked_mean(loss, mask, axis=-1)  # 0 for a sequence without valid tokens
    return per_seq.sum() / _total(num_seqs, loss.shape[0], "num_seqs")


def _seq_mean_token_sum_norm(loss, mask, num_tokens, num_seqs, scale):
    length = _total(scale, loss.shape[-1], "loss_scale_factor")
    return masked_sum(loss, mask) / length / _total(num_seqs, loss.shape[0], "num_seqs")


_AGG_MODES: dict[str, Callable[..., torch.Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}
LOSS_AGG_MODES = tuple(_AGG_MODES)  # the names agg_loss accepts


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    num_tokens: Optional[Number] = None,
    num_seqs: Optional[Number] = None,
    loss_scale_factor: Optional[Number] = None,
) -> torch.Tensor:
    """Reduce a per-token loss matrix to a scalar.

    With ``m`` the mask, ``N_tok = num_tokens or sum(m)``, ``N_seq = num_seqs or B``:

    - ``"token-mean"``: ``sum_{i,t} loss*m / N_tok`` -- every token weighs the same.
    - ``"seq-mean-token-sum"``: ``sum_i (sum_t loss*m) / N_seq``.
    - ``"seq-mean-token-mean"``: ``sum_i mean_t(loss over sequence i's valid tokens) / N_seq``
      (a sequence without valid tokens contributes 0) -- every sequence weighs the same.
    - ``"seq-mean-token-sum-norm"``: ``sum_i (sum_t loss*m) / L / N_seq`` with the constant
      ``L = loss_scale_factor or T`` (Dr. GRPO, Liu et al. 2025, arXiv 2503.20783, which removes
      GRPO's per-length normalization so long and short responses are not weighed differently).

    **Micro-batches.** When a mini-batch (one optimizer step) is split into micro-batches whose
    gradients are accumulated, pass the *mini-batch* totals as ``num_tokens`` (valid tokens) and
    ``num_seqs`` (sequences) to every micro-batch call. Then each mode is a sum of per-micro-batch
    terms over a fixed denominator, the micro-batch losses add up exactly to the mini-batch loss,
    and the gradient does not depend on how the mini-batch was split. Without them each
    micro-batch is normalized by its own counts and the split changes the weighting. For
    ``"seq-mean-token-sum-norm"`` also pass ``loss_scale_factor`` when micro-batches may be padded
    to different lengths ``T``. If a data-parallel all-reduce *averages* gradients over D ranks,
    pass totals over all ranks and multiply the loss by D (or pass the totals divided by D).

    Args:
        loss_mat: ``(B, T)`` per-token loss.
        loss_mask: ``(B, T)`` 0/1 mask; padded entries of ``loss_mat`` are ignored (even NaN).
        loss_agg_mode: one of :data:`LOSS_AGG_MODES`.
        num_tokens: valid-token total used by ``"token-mean"``; default ``loss_mask.sum()``
            (an all-zero mask then gives a loss of 0).
        num_seqs: sequence total used by the ``seq-mean-*`` modes; default ``B``.
        loss_scale_factor: the constant ``L`` of ``"seq-mean-token-sum-norm"``; default ``T``.

    Returns:
        0-dim tensor (differentiable w.r.t. ``loss_mat``).

    Raises:
        ValueError: unknown mode (the message lists the known modes), ``loss_mat`` not 2-D or of a
            different shape than ``loss_mask``, or a non-positive plain-number total.
    """
    try:
        mode_fn = _AGG_MODES[loss_agg_mode]
    except (KeyError, TypeError):
        raise unknown_name_error("loss_agg_mode", loss_agg_mode, list(_AGG_MODES)) from None
    if loss_mat.dim() != 2:
        raise ValueError(f"loss_mat must be (batch, response_len), got shape {tuple(loss_mat.shape)}")
    _check_same_shape(loss_mat=loss_mat, loss_mask=loss_mask)
    return mode_fn(loss_mat, loss_mask, num_tokens, num_seqs, loss_scale_factor)


# --------------------------------------------------------------------------------------------------
# PPO losses
# --------------------------------------------------------------------------------------------------


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


def _ppo_clip_token_losses(old_log_prob, log_prob, advantages, response_mask, cliprange, cliprange_low,
                           cliprange_high, clip_ratio_c):
    """Per-token losses ``(B, T)`` of :func:`compute_policy_loss` (0 on padding) and its three metrics."""
    _check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
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
    _check_same_shape(vpreds=vpreds, returns=returns, values=values, response_mask=response_mask)
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


# --------------------------------------------------------------------------------------------------
# Policy-loss registry
# --------------------------------------------------------------------------------------------------

POLICY_LOSSES: Registry = Registry("policy loss")


def register_policy_loss(name: str):
    """Decorator registering a policy loss under ``name`` (signature: see the module docstring).

    The actor always passes ``rollout_log_probs=`` as a keyword; a loss that only has ``**agg_kwargs``
    would forward it to :func:`agg_loss` and fail in the middle of training, so it is refused here.

    Raises:
        TypeError: the function has no ``rollout_log_probs`` parameter.
        ValueError: ``name`` is taken by a different function, or empty.
    """
    register = POLICY_LOSSES.register(name)

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


def _tis_weights(
    old_log_prob: torch.Tensor,
    rollout_log_probs: Optional[torch.Tensor],
    response_mask: torch.Tensor,
    config: Any,
    loss: str,
) -> Optional[torch.Tensor]:
    """Truncated importance-sampling weights of the rollout/trainer mismatch, or None when TIS is off.

    With ``cap = config.tis_imp_ratio_cap`` (off when missing or ``<= 0``), per token
    ``w = min(exp(old_log_prob - rollout_log_probs), cap)``: the ratio of the trainer's behaviour
    log-probs to those the rollout engine actually sampled with (they differ by kernels, precision
    or a quantized/stale generator), truncated at ``cap`` -- truncated importance sampling
    (Ionides 2008; applied to the rollout/trainer gap by Yao et al. 2025, "Your efficient RL
    framework secretly brings you off-policy RL training", and verl's ``tis_imp_ratio_cap``). The
    log-ratio is clamped to ``[-20, 20]`` before ``exp``; the weights carry no gradient.

    Args:
        old_log_prob: ``(B, T)`` behaviour log-probs recomputed by the trainer.
        rollout_log_probs: ``(B, T)`` float32 log-probs recorded by the rollout, or None.
        response_mask: ``(B, T)`` 0/1; padded entries get ``min(1, cap)`` (their loss is 0 anyway).
        config: the actor config, read by attribute.
        loss: the policy-loss name, for the error message.

    Returns:
        ``(B, T)`` detached weights in ``(0, cap]``, or None.

    Raises:
        ValueError: TIS is on but ``rollout_log_probs`` is None, or its shape differs.
    """
    cap = getattr(config, "tis_imp_ratio_cap", None)
    if cap is None or cap <= 0:
        return None
    if rollout_log_probs is None:
        raise ValueError(f"actor.tis_imp_ratio_cap={cap} turns on truncated importance sampling in policy loss "
                         f"{loss!r}, which needs rollout_log_probs (the rollout's sampling log-probs); got None. "
                         "Set actor.tis_imp_ratio_cap=-1 to turn it off, or keep rollout_log_probs in the batch")
    _check_same_shape(old_log_prob=old_log_prob, rollout_log_probs=rollout_log_probs)
    valid = response_mask != 0
    log_ratio = torch.where(valid, old_log_prob.detach() - rollout_log_probs.detach(),
                            torch.zeros_like(old_log_prob))
    return torch.exp(torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).clamp(max=float(cap))


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
    """Registry form of :func:`compute_policy_loss`, with optional truncated importance sampling.

    Reads ``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high`` and ``clip_ratio_c`` (default 3.0)
    from ``config`` (the actor config) by attribute; see :func:`compute_policy_loss` for the rest.
    With ``config.tis_imp_ratio_cap > 0`` each token's clipped loss is multiplied by the constant
    :func:`_tis_weights` ``min(exp(old_log_prob - rollout_log_probs), cap)`` before aggregation;
    ``rollout_log_probs`` (``(B, T)`` float32) is otherwise unused. The three metrics are those of
    :func:`compute_policy_loss` (unweighted).

    Raises:
        ValueError: see :func:`compute_policy_loss`; TIS on without ``rollout_log_probs``.
    """
    pg_losses, pg_clipfrac, ppo_kl, pg_clipfrac_lower = _ppo_clip_token_losses(
        old_log_prob, log_prob, advantages, response_mask,
        cliprange=getattr(config, "clip_ratio", None),
        cliprange_low=getattr(config, "clip_ratio_low", None),
        cliprange_high=getattr(config, "clip_ratio_high", None),
        clip_ratio_c=getattr(config, "clip_ratio_c", 3.0),
    )
    tis = _tis_weights(old_log_prob, rollout_log_probs, response_mask, config, "vanilla")
    if tis is not None:
        pg_losses = pg_losses * tis
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def _clip_range(config: Any, loss: str) -> tuple[float, float]:
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


GSPO_LOSS_AGG_MODE = "seq-mean-token-mean"  # the aggregation the GSPO objective prescribes


@functools.lru_cache(maxsize=None)
def _warn_gspo_agg_mode(loss_agg_mode: str) -> None:
    logger.warning("policy loss 'gspo' aggregates with %r as its objective prescribes; actor.loss_agg_mode=%r "
                   "is ignored for the policy loss", GSPO_LOSS_AGG_MODE, loss_agg_mode)


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
    """GSPO: PPO-style clipping of a sequence-level importance ratio (Zheng et al. 2025, arXiv 2507.18071).

    With ``|y_i|`` the number of valid tokens of sequence ``i`` and ``sg`` the stop-gradient:

    - sequence ratio (the geometric mean of the token ratios, the ``s_i`` of the GSPO objective,
      eq. 5): ``s_i = exp(mean_t (log_prob - old_log_prob))`` over the valid tokens, the
      log-ratio clamped to [-20, 20];
    - GSPO-token form: ``s_{i,t} = sg[s_i] * pi(y_{i,t}) / sg[pi(y_{i,t})]``, computed as
      ``exp(sg[log s_i] + log_prob - sg[log_prob])``. Its value is ``s_i`` on every token and
      ``d s_{i,t} / d log_prob_{i,t} = s_i``, so the gradient flows per token;
    - per token ``l_{i,t} = max(-A_{i,t} s_{i,t}, -A_{i,t} clip(s_{i,t}, 1 - eps_low, 1 + eps_high))``
      (no dual-clip), aggregated with ``"seq-mean-token-mean"``: ``(1 / N_seq) sum_i mean_t l_{i,t}``.

    With the sequence advantage broadcast over its tokens (``A_{i,t} = A_i``, as every outcome
    estimator returns) the loss equals the GSPO objective ``-(1/G) sum_i min(s_i A_i,
    clip(s_i) A_i)`` in value and gradient: an unclipped token gets
    ``d loss / d log_prob_{i,t} = -A_i s_i / (|y_i| N_seq)``, a clipped sequence gets 0.

    ``loss_agg_mode``: GSPO's objective averages over sequences and then tokens, so the loss always
    uses ``"seq-mean-token-mean"``; any other value is ignored (a warning is logged once per
    value). With ``config.tis_imp_ratio_cap > 0`` each ``l_{i,t}`` is multiplied by the constant
    token weight ``min(exp(old_log_prob - rollout_log_probs), cap)`` (:func:`_tis_weights`) before
    aggregation, as for ``"vanilla"``. ``agg_kwargs`` are forwarded (``num_seqs`` is the one this mode uses; pass the
    mini-batch total when accumulating micro-batches). Only ``log_prob`` receives a gradient;
    ``old_log_prob`` and ``advantages`` are treated as constants.

    Reads ``clip_ratio_low`` / ``clip_ratio_high`` (each falling back to ``clip_ratio``) from
    ``config``, the actor config. GSPO needs far smaller ranges than token-level PPO (the paper
    uses 3e-4 and 4e-4); with the PPO default 0.2 the sequence ratio is practically never clipped.

    Args:
        old_log_prob: ``(B, T)`` log-probs of the behaviour (rollout-time) policy.
        log_prob: ``(B, T)`` log-probs of the current policy (differentiable).
        advantages: ``(B, T)`` advantages (normally constant along each sequence).
        response_mask: ``(B, T)`` 0/1 mask of valid response tokens.
        loss_agg_mode: ignored unless ``"seq-mean-token-mean"`` (see above).
        config: actor config read by attribute.
        rollout_log_probs: ``(B, T)`` float32 sampling log-probs of the rollout; used only by TIS.
        **agg_kwargs: ``num_seqs`` (and, unused here, ``num_tokens`` / ``loss_scale_factor``).

    Returns:
        ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``: the scalar loss; the fraction of valid
        tokens whose clipped branch is active; the masked mean of ``old_log_prob - log_prob`` (token
        level, clamped like the log-ratio); 0 (GSPO has no dual-clip). The last three are detached.

    Raises:
        ValueError: no clip range in ``config``, input shapes differ, or TIS is on without
            ``rollout_log_probs``.
    """
    _check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
                      response_mask=response_mask)
    low, high = _clip_range(config, "gspo")
    tis = _tis_weights(old_log_prob, rollout_log_probs, response_mask, config, "gspo")
    if loss_agg_mode != GSPO_LOSS_AGG_MODE:
        _warn_gspo_agg_mode(loss_agg_mode)

    valid = response_mask != 0
    zeros = torch.zeros_like(log_prob)
    advantages = torch.where(valid, advantages.detach(), zeros)
    log_ratio = torch.where(valid, log_prob.detach() - old_log_prob.detach(), zeros)
    log_ratio = torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    seq_log_ratio = masked_mean(log_ratio, valid, axis=-1)  # (B,), log s_i, detached
    # value 0, gradient 1 w.r.t. log_prob on valid tokens; the where keeps padded garbage out
    token_grad_path = torch.where(valid, log_prob - log_prob.detach(), zeros)
    ratio = torch.exp(seq_log_ratio[:, None] + token_grad_path)  # (B, T): s_{i,t}
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


@register_policy_loss("aipo")
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
    _check_same_shape(mu_log_prob=mu_log_prob, log_prob=log_prob, advantages=advantages,
                      response_mask=response_mask)

    valid = response_mask != 0
    zeros = torch.zeros_like(log_prob)
    advantages = torch.where(valid, advantages.detach(), zeros)
    log_ratio = torch.where(valid, log_prob.detach() - mu_log_prob.detach(), zeros)
    log_ratio = torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, max=float(rho))  # detached: log_ratio was built from detached inputs
    pg_losses = -weight * advantages * torch.where(valid, log_prob, zeros)

    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs)
    with torch.no_grad():
        pg_clipfrac = masked_mean((ratio > rho).float(), response_mask)
        ppo_kl = masked_mean(-log_ratio, response_mask)
    return pg_loss, pg_clipfrac, ppo_kl, torch.zeros_like(ppo_kl)
