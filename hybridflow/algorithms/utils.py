"""Masked statistics over the valid tokens of a padded batch.

Shapes: ``(B, T)`` = batch, response tokens; any shape works as long as ``values`` and ``mask``
broadcast. A mask is 0/1 of any dtype (bool, int, float) and is used as a float weight; a 0 entry
means "padding". Padded entries of ``values`` may hold arbitrary garbage, including NaN or inf:
every function here selects with ``torch.where`` instead of multiplying, so garbage can reach
neither the result nor its gradient.
"""

from __future__ import annotations

from typing import Optional

import torch

WHITEN_EPS = 1e-8  # added to the variance before the square root in masked_whiten


def _prepare(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not values.is_floating_point():
        values = values.float()
    return values, mask.to(device=values.device, dtype=values.dtype).expand_as(values)


def _sum(x: torch.Tensor, axis: Optional[int]) -> torch.Tensor:
    return x.sum() if axis is None else x.sum(dim=axis)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: Optional[int] = None) -> torch.Tensor:
    """Sum of ``values * mask`` over ``axis`` (all elements when None), ignoring padded garbage.

    Args:
        values: ``(B, T)`` (or any shape) floating tensor.
        mask: broadcastable to ``values``; 0 marks padding.
        axis: dimension to reduce, or None for all.

    Returns:
        Tensor with ``axis`` reduced, dtype of ``values`` (float32 if ``values`` is integral).
    """
    values, mask = _prepare(values, mask)
    return _sum(torch.where(mask != 0, values * mask, torch.zeros_like(values)), axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: Optional[int] = None) -> torch.Tensor:
    """Mean of ``values`` over the valid entries (``masked_sum / mask.sum``) along ``axis``.

    A slice with no valid entry has mean 0 (not NaN), with a zero gradient, so e.g. per-sequence
    means of an all-padding row are harmless.

    Args:
        values: ``(B, T)`` floating tensor; padded entries are ignored.
        mask: broadcastable to ``values``; 0 marks padding.
        axis: dimension to reduce, or None for all.

    Returns:
        Tensor with ``axis`` reduced (a scalar when ``axis`` is None).
    """
    values, mask = _prepare(values, mask)
    total = masked_sum(values, mask, axis)
    count = _sum(mask, axis)
    # divide by a safe denominator (not where(count > 0, total / count, 0)): 0/0 would put NaN in the gradient
    return total / torch.where(count != 0, count, torch.ones_like(count))


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over all valid entries (a scalar).

    Args:
        values: ``(B, T)`` floating tensor; padded entries are ignored.
        mask: broadcastable to ``values``; 0 marks padding.
        unbiased: divide by ``n - 1`` (Bessel's correction) instead of ``n``, n = number of valid entries.

    Returns:
        0-dim tensor.

    Raises:
        ValueError: no valid entry, or only one valid entry with ``unbiased=True``.
    """
    values, mask = _prepare(values, mask)
    n = float(mask.sum())
    if n == 0:
        raise ValueError("masked_var: the mask has no valid (non-zero) element; the variance is undefined")
    if unbiased and n < 2:
        raise ValueError(f"masked_var: unbiased variance needs at least 2 valid elements, the mask has {n:g}")
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    return var * (n / (n - 1)) if unbiased else var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalize ``values`` to zero mean and unit (unbiased) variance over the valid entries.

    ``out = (values - mean) / sqrt(var + 1e-8)``; with ``shift_mean=False`` the mean is added back
    (only the scale changes). Padded positions of the output are 0, whatever ``values`` held there.

    Args:
        values: ``(B, T)`` floating tensor.
        mask: broadcastable to ``values``; 0 marks padding.
        shift_mean: if False, keep the original mean.

    Returns:
        ``(B, T)`` tensor, dtype of ``values``.

    Raises:
        ValueError: fewer than 2 valid entries (see :func:`masked_var`).
    """
    values, mask = _prepare(values, mask)
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    whitened = (values - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask != 0, whitened, torch.zeros_like(whitened))
