"""What every rollout backend shares: reading the prompt batch, resolving sampling parameters, and laying out
the output batch, so all backends return the same keys, shapes and padding.

Shape legend: B prompts, n samples per prompt, N = B*n rows, P prompt tokens, R = response_length response
tokens.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch

from hybridflow.protocol import DataProto

__all__ = [
    "PROMPT_KEYS",
    "SAMPLING_KEYS",
    "as_id_list",
    "build_rollout_output",
    "prompt_tensors",
    "resolve_sampling_params",
    "truncated_responses",
]

PROMPT_KEYS = ("input_ids", "attention_mask", "position_ids")
SAMPLING_KEYS = ("do_sample", "temperature", "top_p", "top_k", "n", "response_length")


def as_id_list(ids: Union[int, Sequence[int], None]) -> list[int]:
    """Normalize an int, a sequence of ints or None to a list of ints."""
    if ids is None:
        return []
    if isinstance(ids, int):
        return [ids]
    return [int(i) for i in ids]


def resolve_sampling_params(config: Any, meta_info: dict[str, Any]) -> dict[str, Any]:
    """The backend config's sampling values (:data:`SAMPLING_KEYS`), overridden by ``meta_info``, validated.

    Returns:
        dict with ``do_sample`` (bool), ``temperature`` (float), ``top_p`` (float), ``top_k`` (int, -1 off),
        ``n`` (int), ``response_length`` (int).

    Raises:
        ValueError: every invalid value, listed together.
    """
    params = {key: meta_info.get(key, getattr(config, key)) for key in SAMPLING_KEYS}
    params["do_sample"] = bool(params["do_sample"])
    params["temperature"] = float(params["temperature"])
    params["top_p"] = float(params["top_p"])
    params["top_k"] = int(params["top_k"])
    params["n"] = int(params["n"])
    params["response_length"] = int(params["response_length"])
    problems = []
    if params["n"] < 1:
        problems.append(f"n must be >= 1, got {params['n']}")
    if params["response_length"] < 1:
        problems.append(f"response_length must be >= 1, got {params['response_length']}")
    if params["temperature"] < 0:
        problems.append(f"temperature must be >= 0, got {params['temperature']}")
    if not 0.0 < params["top_p"] <= 1.0:
        problems.append(f"top_p must be in (0, 1], got {params['top_p']}")
    if params["top_k"] == 0 or params["top_k"] < -1:
        problems.append(f"top_k must be -1 (off) or >= 1, got {params['top_k']}")
    if problems:
        raise ValueError("invalid sampling parameters: " + "; ".join(problems))
    return params


def prompt_tensors(prompts: DataProto) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``input_ids``, ``attention_mask``, ``position_ids`` of a prompt batch, each (B, P).

    Raises:
        KeyError: a prompt tensor is missing.
        ValueError: the three tensors are not all (B, P) of one shape.
    """
    missing = [key for key in PROMPT_KEYS if key not in prompts.batch.keys()]
    if missing:
        raise KeyError(f"generate_sequences needs prompt tensors {list(PROMPT_KEYS)}; missing {missing}")
    input_ids, attention_mask, position_ids = (prompts.batch[key] for key in PROMPT_KEYS)
    shapes = {key: tuple(prompts.batch[key].shape) for key in PROMPT_KEYS}
    if len(set(shapes.values())) != 1 or input_ids.dim() != 2:
        raise ValueError(f"prompt tensors must all be (B, P); got shapes {shapes}")
    return input_ids, attention_mask, position_ids


def build_rollout_output(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    log_probs: torch.Tensor,
    seconds: float,
    eos_ids: Sequence[int] | torch.Tensor,
    response_attention: Optional[torch.Tensor] = None,
) -> DataProto:
    """The rollout output batch (the layout :meth:`BaseRollout.generate_sequences` promises).

    Args:
        input_ids, attention_mask, position_ids: (N, P) prompt tensors, already repeated n times per prompt.
        responses: (N, R) long, pad id after a row's end.
        response_mask: (N, R) long, 1 on generated tokens up to and including the first eos.
        log_probs: (N, R) float32, 0 where ``response_mask`` is 0.
        seconds: wall-clock generation time, reported as ``meta_info["generate_seconds"]``.
        eos_ids: the ids that ended a response in this call.
        response_attention: (N, R) the response part of ``attention_mask`` when it differs from ``response_mask``
            (multi-turn: observation tokens are attended to but not trained on); default ``response_mask``.

    Returns:
        tensors ``prompts`` (N, P); ``responses`` (N, R); ``input_ids`` (N, P+R) = cat(prompts, responses);
        ``attention_mask`` (N, P+R) = cat(prompt mask, response_mask); ``position_ids`` (N, P+R): the prompt
        positions, then last prompt position + 1, + 2, ... for every response slot (padded ones included);
        ``response_mask``; ``rollout_log_probs``; ``truncated`` (N,) bool: the response filled all R slots and its
        last token is no eos (it was cut by the length limit; DAPO's overlong filtering reads it). meta_info ``num_generated_tokens`` (sum of response_mask)
        and ``generate_seconds``.
    """
    response_length = responses.shape[1]
    steps = torch.arange(1, response_length + 1, device=position_ids.device, dtype=position_ids.dtype)
    tensors = {
        "prompts": input_ids,
        "responses": responses,
        "input_ids": torch.cat([input_ids, responses], dim=1),
        "attention_mask": torch.cat([attention_mask, (response_mask if response_attention is None
                                                      else response_attention).to(attention_mask.dtype)], dim=1),
        "position_ids": torch.cat([position_ids, position_ids[:, -1:] + steps], dim=1),
        "response_mask": response_mask,
        "rollout_log_probs": log_probs,
        "truncated": truncated_responses(responses, response_mask, eos_ids),
    }
    meta_info = {"num_generated_tokens": int(response_mask.sum()), "generate_seconds": seconds}
    return DataProto.from_dict(tensors=tensors, meta_info=meta_info)


def truncated_responses(responses: torch.Tensor, response_mask: torch.Tensor,
                        eos_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """(N,) bool: rows of ``responses`` (N, R) whose ``response_mask`` (N, R) covers all R slots and whose last
    token is not one of ``eos_ids`` -- the responses the length limit cut off."""
    eos = torch.as_tensor(eos_ids, dtype=responses.dtype, device=responses.device).reshape(-1)
    full = response_mask.sum(-1) >= responses.shape[1]
    return full & ~torch.isin(responses[:, -1], eos)
