"""Micro-batch plumbing of the ``megatron`` engine: padding-free row layout, the forward-step function of
Megatron-core's pipeline schedule, and the results' broadcast from the last pipeline stage.

Megatron-core's RoPE uses positions ``0..S-1`` of the sequence it gets (no ``position_ids``), so each row's attended
tokens (``attention_mask`` 1) are moved to the front (:func:`align_rows`): with a causal mask and positions counted
over attended tokens (the trainer's ``position_ids``) the outputs at those tokens equal the padded HF forward's.
Outputs are gathered back to the response slots; slots whose token is not attended are 0.

Shapes: (B, L) prompt + response tokens, (B, R) response tokens, (B, S) aligned rows, S = most attended tokens of
a row; V vocabulary (V/tp per tensor-parallel rank).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from hybridflow.algorithms import entropy_from_logits, logprobs_from_logits
from hybridflow.algorithms.sampling import SamplingSpec, sampling_logits
from hybridflow.protocol import DataProto

__all__ = ["align_rows", "aligned_order", "broadcast_outputs", "make_forward_step", "response_rows"]


def aligned_order(micro: DataProto) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order (B, S) int64, attended (B, S) bool)``: the column of ``input_ids`` at each aligned position
    (attended columns first, stable) and whether it is an attended token."""
    mask = micro.batch["attention_mask"].bool()
    width = max(int(mask.sum(1).max()), 1)
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices[:, :width]
    return order, torch.gather(mask, 1, order)


def align_rows(micro: DataProto) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids (B, S) int64, position_ids (B, S) int64)``: each row's attended tokens first, then padding
    (token 0), positions ``0..S-1``."""
    ids = micro.batch["input_ids"]
    order, attended = aligned_order(micro)
    width = order.shape[1]
    aligned = torch.gather(ids, 1, order).masked_fill(~attended, 0)
    positions = torch.arange(width, device=ids.device).expand(ids.shape[0], width)
    return aligned.contiguous(), positions.contiguous()


def response_rows(out: torch.Tensor, micro: DataProto) -> torch.Tensor:
    """The rows of ``out`` (B, S, D) over aligned tokens that predict/score each response token: (B, R, D), 0
    where the response token is not attended."""
    mask = micro.batch["attention_mask"]
    resp = micro.batch["responses"].shape[1]
    prompt = mask.shape[1] - resp
    before = mask.long().cumsum(1)[:, prompt - 1:-1] - 1  # aligned index of the token before each response slot
    valid = mask[:, prompt:].bool() & (before >= 0)
    index = before.clamp(min=0).unsqueeze(-1).expand(-1, -1, out.shape[-1])
    rows = torch.gather(out, 1, index)
    return rows * valid.unsqueeze(-1).to(rows.dtype)


def _outputs(kind: str, out: torch.Tensor, micro: DataProto, sampling: Optional[SamplingSpec],
             entropy: bool) -> dict[str, torch.Tensor]:
    """The contract's outputs from the last stage's model output (B, S, V/tp) logits or (B, S, 1) values.

    Logits are gathered over tp (``gather_from_tensor_model_parallel_region``, its backward splits the gradient)
    so sampling transforms (temperature, top-k/p) see the whole vocabulary, as in the fsdp2 engine.
    """
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    rows = response_rows(out, micro)
    if kind == "value":
        return {"values": rows.squeeze(-1).float()}
    responses = micro.batch["responses"]
    logits = sampling_logits(gather_from_tensor_model_parallel_region(rows).float(), sampling or SamplingSpec(),
                             keep=responses)
    result = {"log_probs": logprobs_from_logits(logits, responses)}
    if entropy:
        result["entropy"] = entropy_from_logits(logits)
    return result


def make_forward_step(kind: str, losses: list[Optional[Callable]], n_micro: int, store: list,
                      sampling: Optional[SamplingSpec], entropy: bool,
                      before_forward: Optional[Callable[[DataProto], None]] = None) -> Callable:
    """The ``forward_step_func(data_iterator, model)`` of Megatron-core's schedules.

    The data iterator yields DataProto micro-batches in order; ``losses[i]`` maps micro-batch i's outputs to its
    scalar loss (None: inference, the loss is 0). The last stage appends each micro-batch's outputs (detached) to
    ``store``. The schedule divides each returned loss by ``n_micro``; it is multiplied by ``n_micro`` first so
    the gradient is that of the sum of the losses (the contract's accumulation). ``before_forward(micro)`` runs
    right before each micro-batch's model forward (routing replay sets the routers' indices there).
    """
    counter = iter(range(n_micro))

    def forward_step(data_iterator: Iterator[DataProto], model: torch.nn.Module) -> tuple[torch.Tensor, Callable]:
        micro, index = next(data_iterator), next(counter)
        ids, positions = align_rows(micro)
        if before_forward is not None:
            before_forward(micro)
        output = model(ids, positions, None)

        def loss_func(out: torch.Tensor) -> tuple[torch.Tensor, dict]:
            outputs = _outputs(kind, out, micro, sampling, entropy)
            store.append({k: v.detach() for k, v in outputs.items()})
            loss_fn = losses[index]
            loss = loss_fn(outputs) if loss_fn is not None else out.sum() * 0.0
            return loss * n_micro, {"loss": loss.detach()}

        return output, loss_func

    return forward_step


def broadcast_outputs(store: list[dict[str, torch.Tensor]], micros: list[DataProto], keys: list[str],
                      is_last: bool, src: int, group: Any) -> list[dict[str, torch.Tensor]]:
    """Every rank gets the last pipeline stage's outputs of each micro-batch (B, R) fp32 (``src``: the global
    rank of the last stage in this rank's pipeline ``group``); a no-op with one stage."""
    if dist.get_world_size(group) == 1:
        return store
    out = []
    for i, micro in enumerate(micros):
        shape = micro.batch["responses"].shape
        device = micro.batch["responses"].device
        result = {}
        for key in keys:
            tensor = store[i][key].contiguous() if is_last else torch.empty(shape, dtype=torch.float32, device=device)
            dist.broadcast(tensor, src=src, group=group)
            result[key] = tensor
        out.append(result)
    return out
