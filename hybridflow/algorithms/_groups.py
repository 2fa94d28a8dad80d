"""Private helpers of the outcome estimators that compare responses within a group or place one value per sequence
on its tokens: GRPO (:mod:`~hybridflow.algorithms.advantage`), RLOO, REINFORCE++-baseline and ReMax
(:mod:`~hybridflow.algorithms.advantage_reinforce`).

Shapes: ``(B, T)`` = batch, response tokens; ``(B,)`` one value per response. A *group* is the set of rows whose
``index`` value (the uid of the prompt instance) is equal.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hybridflow.algorithms.utils import masked_sum

__all__ = ["broadcast_over_valid", "check_batch", "group_ids", "group_total", "outcome_scores"]


def check_batch(**tensors: torch.Tensor) -> None:
    """Check that every tensor has one 2-D ``(B, T)`` shape.

    Raises:
        ValueError: the shapes differ or are not 2-D (the message lists them).
    """
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 2:
        raise ValueError(f"expected tensors of one (batch, response_len) shape, got "
                         f"{', '.join(f'{k}={v}' for k, v in shapes.items())}")


def group_ids(index: Any, batch: int, device: torch.device) -> torch.Tensor:
    """``(B,)`` long tensor numbering the distinct values of ``index`` 0..G-1 (rows with equal ids share one).

    Raises:
        ValueError: ``index`` does not have one entry per row.
    """
    index = np.asarray(index)
    if index.shape != (batch,):
        raise ValueError(f"index must have shape ({batch},) (one group id per response), got {index.shape}")
    _, group = np.unique(index, return_inverse=True)
    return torch.as_tensor(group.reshape(-1), dtype=torch.long, device=device)


def group_total(values: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """For each row, the sum of ``values`` (``(B,)``) over the rows of its group (``(B,)``, dtype of ``values``)."""
    n_groups = int(group.max()) + 1 if group.numel() else 0
    return torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add(0, group, values)[group]


def outcome_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``(B,)`` float64 sequence scores: the sum of each row's rewards over its valid tokens."""
    return masked_sum(token_level_rewards.double(), response_mask, axis=-1)


def broadcast_over_valid(seq_values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` float32: the per-sequence ``(B,)`` value on every valid token, 0 on padding."""
    valid = response_mask != 0
    return torch.where(valid, seq_values.float()[:, None].expand(valid.shape),
                       torch.zeros(valid.shape, device=seq_values.device))
