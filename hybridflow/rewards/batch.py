"""Decode and score a whole rollout batch with the rule rewards (shared by the reward worker and ``hybridflow eval``).

Shape legend: ``N`` rows (responses), ``R`` response tokens.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from hybridflow.protocol import DataProto
from hybridflow.rewards import default_compute_score

__all__ = ["decode_responses", "score_batch"]


def decode_responses(tokenizer: Any, data: DataProto) -> list[str]:
    """Text of each response: the tokens of ``responses`` (N, R) where ``response_mask`` (N, R) is 1, decoded
    with ``skip_special_tokens=True`` (so a closing eos is dropped).

    Raises:
        KeyError: ``responses`` or ``response_mask`` is missing from ``data.batch``.
    """
    responses = data.batch["responses"]
    mask = data.batch["response_mask"].bool()
    return [tokenizer.decode(responses[i][mask[i]].tolist(), skip_special_tokens=True) for i in range(len(data))]


def score_batch(tokenizer: Any, data: DataProto, texts: Optional[Sequence[str]] = None) -> list[float]:
    """Per-row scores of a rollout batch by :func:`hybridflow.rewards.default_compute_score`.

    Args:
        tokenizer: the policy's tokenizer (used only when ``texts`` is None).
        data: N rows with tensors ``responses`` and ``response_mask`` (N, R) and non-tensor columns
            ``data_source`` and ``ground_truth`` (and optionally ``extra_info``), e.g. the generated batch
            joined with its prompts repeated ``n`` times.
        texts: the already decoded responses (from :func:`decode_responses`), to avoid decoding twice.

    Returns:
        N floats, in row order.

    Raises:
        KeyError: a required column is missing.
        ValueError: a row's ``data_source`` has no registered reward, or ``len(texts) != N``.
    """
    if texts is None:
        texts = decode_responses(tokenizer, data)
    if len(texts) != len(data):
        raise ValueError(f"score_batch: got {len(texts)} texts for {len(data)} rows")
    nt = data.non_tensor_batch
    missing = [key for key in ("data_source", "ground_truth") if key not in nt]
    if missing:
        raise KeyError(f"score_batch needs non-tensor columns {missing}; has {sorted(nt)}")
    extra = nt.get("extra_info")
    return [
        float(default_compute_score(nt["data_source"][i], text, nt["ground_truth"][i],
                                    None if extra is None else extra[i]))
        for i, text in enumerate(texts)
    ]
