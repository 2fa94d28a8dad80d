"""Rollouts of vision-language prompts (:mod:`hybridflow.models.vlm`): the prompt columns a driver hands a rollout,
and the ``hf`` rollout's image path.

A VLM prompt batch carries ``mrope_position_ids`` (B, 3, P) and the per-row ``multi_modal_inputs``. The rollout
prefills with the rows' ``pixel_values`` / ``image_grid_thw`` at the carried (3, N, P) positions; at decode a
response token (text) is at ``mrope[:, :, -1] + step + 1`` on every axis (the last prompt token is text: its 3
positions are equal), i.e. its 1-D position plus the row's rope delta, the same value
:func:`hybridflow.models.vlm.extend_rope_positions` gives the trainer, so rollout and trainer logprobs agree.
The output gains ``mrope_position_ids`` (N, 3, P+R). Shapes: B prompts, N = B x n rows, P prompt, R response.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from hybridflow.models.vlm import INPUTS_KEY, MROPE_KEY, extend_rope_positions, vision_inputs
from hybridflow.protocol import DataProto

__all__ = ["vision_rows", "vision_chunk", "add_rollout_positions", "with_context_vision", "prompt_vision_keys",
           "share_vision_columns"]


def vision_rows(prompts: DataProto, n: int) -> Optional[DataProto]:
    """The prompts' mrope positions and vision inputs, each row repeated ``n`` times (adjacent, the rollout's row
    order; the per-row inputs shared, not copied), as a ``DataProto``; None for text prompts."""
    if MROPE_KEY not in prompts.batch.keys():
        return None
    if INPUTS_KEY not in prompts.non_tensor_batch:
        raise KeyError(f"a VLM prompt batch with {MROPE_KEY} needs the non-tensor column {INPUTS_KEY}")
    rows = DataProto.from_dict(tensors={MROPE_KEY: prompts.batch[MROPE_KEY],
                                        "attention_mask": prompts.batch["attention_mask"]},
                               non_tensors={INPUTS_KEY: prompts.non_tensor_batch[INPUTS_KEY]})
    return rows.repeat(n, interleave=True) if n > 1 else rows


def vision_chunk(rows: Optional[DataProto], start: int, end: int, device: torch.device) -> Optional[dict]:
    """One decoding micro-batch's vision: ``{"positions": (3, N', P) long, "inputs": {pixel_values, image_grid_thw}
    or {}}`` on ``device``; None for text prompts."""
    if rows is None:
        return None
    part = rows[start:end]
    return {"positions": part.batch[MROPE_KEY].to(device).transpose(0, 1), "inputs": vision_inputs(part, device)}


def add_rollout_positions(out: DataProto, rows: Optional[DataProto]) -> DataProto:
    """Add ``mrope_position_ids`` (N, 3, P+R) to a rollout output (its ``position_ids`` (N, P+R)); unchanged for
    text prompts."""
    if rows is not None:
        prompt = rows.batch[MROPE_KEY]
        positions = out.batch["position_ids"]
        out.batch[MROPE_KEY] = extend_rope_positions(prompt.to(positions.device),
                                                     positions[:, :prompt.shape[-1]], positions)
    return out


def with_context_vision(contexts: DataProto, rows: Optional[DataProto]) -> DataProto:
    """Multi-turn: give left-padded ``contexts`` (the prompt + the turns so far, (N', W)) their rows' images and
    mrope positions (N', 3, W): the prompt's carried positions, then, for every later token (sampled or an
    observation: text), the last one's + 1, + 2, ... ``rows``: the active trajectories' :func:`vision_rows`.
    Unchanged for text prompts."""
    if rows is None:
        return contexts
    mask = contexts.batch["attention_mask"].bool()
    out = torch.zeros(mask.shape[0], 3, mask.shape[1], dtype=torch.long)
    for r in range(mask.shape[0]):
        prompt = rows.batch[MROPE_KEY][r][:, rows.batch["attention_mask"][r].bool()]  # (3, p) real prompt tokens
        extra = int(mask[r].sum()) - prompt.shape[1]
        tail = prompt[:, -1:] + 1 + torch.arange(extra)
        out[r][:, mask[r]] = torch.cat([prompt, tail], dim=1)
    contexts.batch[MROPE_KEY] = out.to(mask.device)
    contexts.non_tensor_batch[INPUTS_KEY] = rows.non_tensor_batch[INPUTS_KEY]
    return contexts


def prompt_vision_keys(batch: DataProto) -> list[str]:
    """The prompt tensors a driver pops for the rollout besides ids/mask/positions: ``[mrope_position_ids]`` for a
    VLM batch, else ``[]``."""
    return [MROPE_KEY] if MROPE_KEY in batch.batch.keys() else []


def share_vision_columns(prompts: DataProto, batch: DataProto) -> DataProto:
    """Give the popped ``prompts`` the batch's per-row vision columns (shared, not copied: the batch keeps them for
    the trainer's forwards)."""
    for key in (INPUTS_KEY, "multi_modal_data"):
        if key in batch.non_tensor_batch:
            prompts.non_tensor_batch[key] = np.asarray(batch.non_tensor_batch[key])
    return prompts
