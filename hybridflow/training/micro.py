"""Shared pieces of the actor and critic steps: the mini/micro-batch plan and the response-slice forward.

Loss normalisation across micro-batches and data-parallel ranks (why gradients do not depend on the split):
each micro-batch loss is aggregated with the *mini-batch* totals (tokens, sequences) summed over all dp ranks
and divided by the dp size. FSDP2 averages gradients over dp ranks, so the dp factor cancels and the applied
gradient is exactly that of the mini-batch loss, for every ``loss_agg_mode``.
"""

from __future__ import annotations

from typing import Iterator

import math

import torch
import torch.distributed as dist

from hybridflow.distributed import all_reduce_sum, clip_grad_norm
from hybridflow.models.vlm import forward_kwargs as vision_kwargs
from hybridflow.protocol import DataProto
from hybridflow.training.packing import packed_response_forward, padded_columns


def response_forward(module: torch.nn.Module, micro: DataProto, response_length: int,
                     remove_padding: bool = False) -> torch.Tensor:
    """Run ``module`` over ``input_ids`` (B, P+R) and return the output rows that predict/score the response.

    Returns ``logits[:, -R-1:-1]``: (B, R, V) for a causal LM (position t predicts response token t), (B, R, 1)
    for a value model (the value of the state before response token t).

    Columns no row of the micro-batch attends to are cut before the forward: left padding common to every prompt
    and response slots after the longest response (responses are padded to R, most end early). Positions are
    explicit (``position_ids``) and the model is causal, so the kept outputs are unchanged; the cut response slots
    (every row's padding) are returned as 0.

    ``remove_padding`` (``model.use_remove_padding``): the same rows from one packed forward over the valid tokens
    only (:func:`hybridflow.training.packing.packed_response_forward`).
    """
    if remove_padding:
        return packed_response_forward(module, micro, response_length)
    batch = micro.batch
    mask = batch["attention_mask"]
    prompt_len = mask.shape[1] - response_length
    first, end = padded_columns(mask, response_length)
    kept = end - prompt_len
    extra = vision_kwargs(micro, first, end)  # a VLM batch: images and the carried (3, B, L) mrope positions
    out = module(
        input_ids=batch["input_ids"][:, first:end],
        attention_mask=mask[:, first:end],
        position_ids=extra.pop("position_ids", batch["position_ids"][:, first:end]),
        use_cache=False,
        **extra,
    )
    logits = out.logits[:, prompt_len - 1 - first : end - 1 - first]
    if kept < response_length:
        logits = torch.nn.functional.pad(logits, (0, 0, 0, response_length - kept))
    return logits


def mini_batches(data: DataProto, mini_size: int, epochs: int, shuffle: bool, seed: int) -> Iterator[DataProto]:
    """Yield the mini-batches of ``epochs`` passes over ``data`` (optionally shuffled with a seeded generator)."""
    for epoch in range(epochs):
        if shuffle:
            gen = torch.Generator().manual_seed(seed + epoch)
            data = data[torch.randperm(len(data), generator=gen)]
        yield from data.split(mini_size)


def global_agg_kwargs(mini: DataProto, loss_scale_factor: float, loss_mask: torch.Tensor | None = None,
                      loss_rows: torch.Tensor | None = None) -> dict:
    """``agg_loss`` normalisers for one mini-batch: totals over all dp ranks divided by the dp size.

    ``num_tokens`` counts the ones of ``loss_mask`` (B, R) (default ``response_mask``), ``num_seqs`` the True
    rows of ``loss_rows`` (B,) (default every row); ``loss_scale_factor`` is passed through (the constant L of
    ``seq-mean-token-sum-norm``). A total of 0 (every token masked out, e.g. all responses overlong-filtered)
    becomes 1: the numerators are then 0 too, so the loss is 0 with zero gradients instead of an error or NaN."""
    dp = dist.get_world_size() if dist.is_initialized() else 1
    mask = mini.batch["response_mask"] if loss_mask is None else loss_mask
    rows = float(len(mini)) if loss_rows is None else float(loss_rows.sum().item())
    total = all_reduce_sum(torch.tensor([float(mask.sum().item()), rows]))
    return {
        "num_tokens": max(float(total[0]), 1.0) / dp,
        "num_seqs": max(float(total[1]), 1.0) / dp,
        "loss_scale_factor": float(loss_scale_factor),
    }


def apply_gradients(module: torch.nn.Module, optimizer, grad_clip: float, nonfinite_grad: str, role: str) -> tuple[float, bool]:
    """Clip the accumulated gradients to ``grad_clip`` and take the optimizer step, unless the norm is NaN/inf:
    then the gradients are dropped and, with ``nonfinite_grad="error"``, ``FloatingPointError`` is raised
    (naming ``role``). Returns ``(grad_norm, skipped)``; the weights never see a non-finite gradient."""
    grad_norm = clip_grad_norm(module.parameters(), grad_clip)
    if math.isfinite(grad_norm):
        optimizer.step()
        return grad_norm, False
    optimizer.zero_grad(set_to_none=True)
    if nonfinite_grad == "error":
        raise FloatingPointError(f"{role} gradient norm is {grad_norm} (loss or gradient is NaN/inf); weights left "
                                 "unchanged (trainer.nonfinite_grad=error)")
    return grad_norm, True
