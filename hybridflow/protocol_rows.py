"""Per-row variable-size tensors in a ``DataProto``: a non-tensor (object) column whose entry per row is a dict of
tensors with a row-dependent first dimension (e.g. a VLM prompt's ``pixel_values`` (patches_i, D) and
``image_grid_thw`` (images_i, 3)).

The column travels with its rows through ``chunk``/``split``/dispatch, ``concat``, ``repeat`` (rollout.n),
``reorder`` (balancing) and ``__getitem__``: those index the numpy object array, so a repeated row *shares* its
dict (and tensors) with the original (no copy per sample; pickling for a worker writes a shared dict once). Nothing
here mutates an entry: treat them as read-only. No Ray, no torch.distributed.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

__all__ = ["cat_row_tensors"]


def cat_row_tensors(column: np.ndarray, keys: Sequence[str]) -> dict[str, torch.Tensor]:
    """Concatenate ``keys`` of every row's dict in ``column`` (B,) along dim 0, in row order (a row that is None,
    lacks a key or has an empty one contributes nothing). Returns ``{key: (sum of the rows' dim 0, ...)}``; a key
    no row has is an empty ``(0,)`` float tensor.

    Raises:
        ValueError: the rows' tensors of one key differ in trailing shape or dtype (the message names the key).
    """
    out = {}
    for key in keys:
        parts = [row[key] for row in column if row is not None and key in row and row[key].shape[0]]
        if not parts:
            out[key] = torch.zeros(0)
            continue
        if len({(tuple(p.shape[1:]), p.dtype) for p in parts}) > 1:
            raise ValueError(f"cat_row_tensors: rows' {key!r} differ in trailing shape or dtype: "
                             f"{sorted({(tuple(p.shape[1:]), str(p.dtype)) for p in parts})}")
        out[key] = torch.cat(parts, dim=0)
    return out

