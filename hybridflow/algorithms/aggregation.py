"""Loss aggregation: a per-token loss matrix reduced to the scalar an optimizer step minimizes.

Shapes: ``(B, T)`` = batch, response tokens. ``loss_mask`` is 0/1 of any dtype (0 = padding); padded entries of
the loss are ignored, whatever they hold. The modes are verl's ``loss_agg_mode`` names (see :func:`agg_loss`).
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from hybridflow.algorithms.utils import masked_mean, masked_sum
from hybridflow.registry import unknown_name_error

__all__ = ["LOSS_AGG_MODES", "Number", "agg_loss", "check_same_shape"]

Number = Union[int, float, torch.Tensor]


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raises ``ValueError`` naming each tensor's shape when they are not all one shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shape mismatch: {', '.join(f'{k}={v}' for k, v in shapes.items())}")

def _total(given: Optional[Number], default: Number, name: str) -> Number:
    """``given`` (checked > 0 when it is a plain number) or ``default``."""
    if given is None:
        return default
    if not isinstance(given, torch.Tensor) and not given > 0:
        raise ValueError(f"{name} must be > 0, got {given!r}")
    return given


def _token_mean(loss: torch.Tensor, mask: torch.Tensor, num_tokens: Optional[Number], num_seqs: Optional[Number],
                scale: Optional[Number]) -> torch.Tensor:
    count = mask.to(loss.dtype).sum()
    count = torch.where(count != 0, count, torch.ones_like(count))  # empty mask: loss 0, not NaN
    return masked_sum(loss, mask) / _total(num_tokens, count, "num_tokens")


def _seq_mean_token_sum(loss: torch.Tensor, mask: torch.Tensor, num_tokens: Optional[Number], num_seqs: Optional[Number],
                        scale: Optional[Number]) -> torch.Tensor:
    return masked_sum(loss, mask) / _total(num_seqs, loss.shape[0], "num_seqs")


def _seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor, num_tokens: Optional[Number], num_seqs: Optional[Number],
                         scale: Optional[Number]) -> torch.Tensor:
    per_seq = masked_mean(loss, mask, axis=-1)  # 0 for a sequence without valid tokens
    return per_seq.sum() / _total(num_seqs, loss.shape[0], "num_seqs")


def _seq_mean_token_sum_norm(loss: torch.Tensor, mask: torch.Tensor, num_tokens: Optional[Number], num_seqs: Optional[Number],
                             scale: Optional[Number]) -> torch.Tensor:
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
    check_same_shape(loss_mat=loss_mat, loss_mask=loss_mask)
    return mode_fn(loss_mat, loss_mask, num_tokens, num_seqs, loss_scale_factor)
