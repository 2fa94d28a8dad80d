"""DAPO's batch-level pieces: overlong reward shaping, overlong filtering of the loss, dynamic-sampling groups.

DAPO: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", arXiv 2503.14476.
Shapes: ``(B, T)`` = batch, response tokens; ``(B,)`` one value per response. Pure tensor math (no Ray, no
torch.distributed); the driver and the actor worker call these.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def overlong_reward_penalty(response_length: torch.Tensor, max_response_length: int, buffer_len: int,
                            penalty_factor: float = 1.0) -> torch.Tensor:
    """Soft overlong punishment of DAPO (sec. 3.4, eq. 13), scaled by ``penalty_factor``.

    With ``L = response_length`` (generated tokens only: the window never depends on the prompt's length),
    ``L_max = max_response_length`` and ``L_cache = buffer_len``::

        R(L) = 0                                   if L <= L_max - L_cache
             = ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max
             = -1                                  if L > L_max

    and the returned penalty is ``penalty_factor * R(L)``: 0 up to the buffer, then linear down to
    ``-penalty_factor`` at ``L_max``.

    Args:
        response_length: ``(B,)`` number of valid response tokens of each response (any numeric dtype).
        max_response_length: ``L_max`` (``data.max_response_length``).
        buffer_len: ``L_cache`` (``reward_model.overlong_buffer.len``), ``1 <= L_cache <= L_max``.
        penalty_factor: scale of the penalty (``reward_model.overlong_buffer.penalty_factor``), ``>= 0``.

    Returns:
        ``(B,)`` float32 penalties in ``[-penalty_factor, 0]``, to be added to the sequence scores.

    Raises:
        ValueError: ``buffer_len`` outside ``[1, max_response_length]`` or ``penalty_factor < 0``.
    """
    if not 1 <= buffer_len <= max_response_length:
        raise ValueError(f"overlong buffer length must be in [1, max_response_length={max_response_length}], "
                         f"got {buffer_len}")
    if penalty_factor < 0:
        raise ValueError(f"overlong penalty_factor must be >= 0, got {penalty_factor}")
    length = response_length.double()
    expected = max_response_length - buffer_len
    ramp = (expected - length) / buffer_len  # 0 at the start of the buffer, -1 at L_max
    penalty = torch.where(length > max_response_length, torch.full_like(length, -1.0), ramp.clamp(max=0.0))
    return (penalty * penalty_factor).float()


def overlong_filter_mask(response_mask: torch.Tensor, truncated: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Overlong filtering of DAPO (sec. 3.4): truncated responses are left out of the loss.

    A response is truncated when it filled ``max_response_length`` tokens without an end-of-sequence token
    (the rollout's ``truncated`` flag). Its tokens leave the loss mask, so they leave the numerator *and* the
    token count of ``token-mean``; the row also leaves the sequence count of the ``seq-mean-*`` modes (pass
    ``kept.sum()`` as ``num_seqs``). When every response is truncated the mask is all zero and
    :func:`~hybridflow.algorithms.agg_loss` gives 0 with zero gradients.

    Args:
        response_mask: ``(B, T)`` 0/1 mask of valid response tokens.
        truncated: ``(B,)`` bool, True for a truncated response.

    Returns:
        ``(loss_mask, kept)``: ``(B, T)`` the mask with truncated rows zeroed (dtype of ``response_mask``), and
        ``(B,)`` bool, the rows that stay in the loss.

    Raises:
        ValueError: ``truncated`` is not ``(B,)``.
    """
    if tuple(truncated.shape) != (response_mask.shape[0],):
        raise ValueError(f"truncated must have shape ({response_mask.shape[0]},), got {tuple(truncated.shape)}")
    kept = ~truncated.bool().to(response_mask.device)
    return response_mask * kept[:, None].to(response_mask.dtype), kept


def informative_groups(index: Any, metric: Any) -> np.ndarray:
    """Dynamic sampling of DAPO (sec. 3.2, the constraint of eq. 11): which responses belong to a group whose
    metric values are not all equal.

    A group (the responses sharing one ``index`` value, i.e. one prompt instance) whose responses all got the
    same reward (all right or all wrong) has advantage 0 under any group baseline and gives no gradient; DAPO
    drops such groups and samples more prompts instead. Values are compared exactly (in float64).

    Args:
        index: ``(B,)`` array-like of group ids (e.g. uid strings).
        metric: ``(B,)`` array-like or tensor of per-response values (e.g. accuracy or score).

    Returns:
        ``(B,)`` bool numpy array: True for every response of an informative group (a group of size 1 is
        never informative).

    Raises:
        ValueError: ``index`` and ``metric`` differ in length or are not 1-D.
    """
    index = np.asarray(index)
    values = metric.detach().double().cpu().numpy() if isinstance(metric, torch.Tensor) else np.asarray(metric, float)
    if index.ndim != 1 or index.shape != values.shape:
        raise ValueError(f"index and metric must both be (B,), got {index.shape} and {values.shape}")
    _, group = np.unique(index, return_inverse=True)
    group = group.reshape(-1)
    low = np.full(group.max() + 1 if group.size else 0, np.inf)
    high = np.full_like(low, -np.inf)
    np.minimum.at(low, group, values)
    np.maximum.at(high, group, values)
    return high[group] > low[group]
