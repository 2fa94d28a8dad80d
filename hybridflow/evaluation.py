"""``hybridflow eval MODEL_DIR DATA.parquet``: score a model on prompts without training, in one process.

The pieces are the training run's own: the tokenizer and model from :mod:`hybridflow.models.hf` (same pad and eos
rules), prompts through :class:`~hybridflow.data.dataset.RLHFDataset` and ``collate_fn`` (same chat-template
rule), generation by :class:`~hybridflow.rollout.HFRollout` and scores by
:func:`hybridflow.rewards.batch.score_batch` (the rule rewards, by ``data_source``). No Ray.

Metrics (verl's names for the same thing in validation):

* ``mean@1``: the mean score of one response per prompt, greedy by default (``temperature=0``).
* ``mean@k`` (with ``n=k > 1``): the mean over ``k`` sampled responses per prompt at ``temperature`` (> 0),
  in addition to the greedy ``mean@1``.

Both are reported over all prompts and per ``data_source``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections import defaultdict
from types import SimpleNamespace
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from hybridflow.data.dataset import RLHFDataset, collate_fn, load_rows
from hybridflow.distributed import resolve_dtype
from hybridflow.models.hf import get_eos_token_ids, load_causal_lm, load_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.rewards.batch import decode_responses, score_batch
from hybridflow.rollout import HFRollout

logger = logging.getLogger(__name__)

__all__ = ["evaluate"]

PathLike = Union[str, "os.PathLike[str]"]


def _generate_and_score(
    rollout: HFRollout, tokenizer: Any, batch: DataProto, sampling: dict, seed: Optional[int]
) -> tuple[list[float], list[str], dict]:
    """Generate ``sampling["n"]`` responses per prompt of ``batch`` (B prompts) and score them.

    Returns N = B*n scores and texts, interleaved (p0, p0, p1, ...), and the prompts' non-tensor columns
    repeated to match.
    """
    prompts = batch.select(["input_ids", "attention_mask", "position_ids"], non_tensor_batch_keys=[])
    prompts.meta_info.update(sampling)
    if seed is not None:
        prompts.meta_info["seed"] = seed
    gen = rollout.generate_sequences(prompts)
    rows = batch.select(batch_keys=[]).repeat(sampling["n"], interleave=True).non_tensor_batch
    scored = DataProto(batch=gen.batch, non_tensor_batch=rows)
    texts = decode_responses(tokenizer, scored)
    return score_batch(tokenizer, scored, texts), texts, rows


def _passes(n: int, temperature: float, top_p: float, top_k: int) -> dict[str, dict]:
    """Generation passes by name: sampling overrides for ``HFRollout`` (see :func:`evaluate`, ``n``)."""
    greedy = dict(n=1, do_sample=False, temperature=0.0)
    sampled = dict(n=n, do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
    if n > 1:
        return {"greedy": greedy, "sampled": sampled}
    return {"sampled": sampled} if temperature > 0 else {"greedy": greedy}


def evaluate(
    model_path: str,
    data_files: Union[PathLike, Sequence[PathLike]],
    n: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = -1,
    batch_size: int = 64,
    max_prompt_length: Optional[int] = None,
    max_response_length: int = 512,
    truncation: str = "error",
    dtype: str = "auto",
    device: str = "auto",
    seed: int = 0,
    output: Optional[PathLike] = None,
    prompt_key: str = "prompt",
    trust_remote_code: bool = False,
) -> dict:
    """Score ``model_path`` on the parquet prompts of ``data_files`` (verl schema) with the rule rewards.

    Args:
        model_path: local Hugging Face causal-LM directory (tokenizer in the same directory), or ``builtin:NAME``.
        data_files: one parquet file or several.
        n: responses per prompt. 1: one pass at ``temperature`` (greedy at 0) -> ``mean@1``. k > 1: a greedy
            pass -> ``mean@1`` plus a sampled pass of k responses per prompt at ``temperature`` -> ``mean@k``.
        temperature, top_p, top_k: sampling settings (top_k -1 disables).
        batch_size: prompts per generation call.
        max_prompt_length: prompt tokens; None means no limit. Longer prompts are handled per ``truncation``
            (``error`` | ``left`` | ``right`` | ``filter``; filtered prompts are counted in ``num_filtered``).
        max_response_length: generated tokens per response.
        dtype: ``auto`` (fp32 on CPU, bf16 on GPU), ``float32``, ``bfloat16`` or ``float16``.
        device: ``auto`` (cuda when available), ``cpu`` or ``cuda``.
        seed: seeds the sampled pass (batch ``i`` uses ``seed + i``).
        output: if set, a JSONL file with one line per response: ``index``, ``data_source``, ``prompt``,
            ``response``, ``ground_truth``, ``score``, ``pass`` (``"greedy"`` or ``"sampled"``) and ``sample``
            (0..n-1 within its prompt).

    Returns:
        ``{"model", "data", "num_prompts", "num_filtered", "mean@1", ["mean@k"], "by_data_source":
        {source: {"num_prompts", "mean@1", ["mean@k"]}}, "settings": {...}, "seconds"}`` (JSON-serializable).

    Raises:
        ValueError: ``n < 1``, ``batch_size < 1``, ``n > 1`` with ``temperature <= 0``, no prompts, or bad data
            (see ``RLHFDataset``; an unknown ``data_source`` names the registered ones).
        FileNotFoundError: the model directory or a data file does not exist.
    """
    if n < 1 or batch_size < 1:
        raise ValueError(f"n and batch_size must be >= 1, got n={n}, batch_size={batch_size}")
    if n > 1 and temperature <= 0:
        raise ValueError(f"mean@{n} samples {n} responses per prompt: it needs temperature > 0, got {temperature}")
    start = time.perf_counter()
    paths = [data_files] if isinstance(data_files, (str, os.PathLike)) else list(data_files)
    files = [os.fspath(f) for f in paths]
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    tokenizer = load_tokenizer(model_path, trust_remote_code)
    dataset = RLHFDataset(load_rows(files, prompt_key), tokenizer, max_prompt_length or sys.maxsize, prompt_key,
                          truncation)
    if len(dataset) == 0:
        raise ValueError(f"no prompts to evaluate in {files}")
    model = load_causal_lm(model_path, resolve_dtype(dtype, device), trust_remote_code).to(device)
    rollout = HFRollout(
        model,
        SimpleNamespace(response_length=max_response_length, n=1, do_sample=False, temperature=0.0, top_p=top_p,
                        top_k=top_k, micro_batch_size=batch_size),
        eos_token_id=get_eos_token_ids(model_path, tokenizer),
        pad_token_id=tokenizer.pad_token_id,
    )

    passes = _passes(n, temperature, top_p, top_k)
    metric_of = {name: f"mean@{sampling['n']}" for name, sampling in passes.items()}
    scores: dict[str, dict[str, list[float]]] = {metric: defaultdict(list) for metric in metric_of.values()}
    prompts_per_source: dict[str, int] = defaultdict(int)
    out = open(output, "w", encoding="utf-8") if output else None
    try:
        for b, lo in enumerate(range(0, len(dataset), batch_size)):
            items = [dataset[i] for i in range(lo, min(lo + batch_size, len(dataset)))]
            for item in items:
                prompts_per_source[item["data_source"]] += 1
            batch = collate_fn(items, tokenizer.pad_token_id)
            for name, sampling in passes.items():
                batch_scores, texts, rows = _generate_and_score(
                    rollout, tokenizer, batch, sampling, seed + b if name == "sampled" else None)
                for i, score in enumerate(batch_scores):
                    scores[metric_of[name]][rows["data_source"][i]].append(score)
                    if out is not None:
                        out.write(json.dumps({
                            "index": int(rows["index"][i]), "data_source": rows["data_source"][i],
                            "prompt": rows["raw_prompt"][i], "response": texts[i],
                            "ground_truth": rows["ground_truth"][i], "score": score, "pass": name,
                            "sample": i % sampling["n"],
                        }) + "\n")
            logger.info("eval: %d / %d prompts", lo + len(items), len(dataset))
    finally:
        if out is not None:
            out.close()

    result: dict[str, Any] = {"model": model_path, "data": files, "num_prompts": len(dataset),
                              "num_filtered": dataset.num_filtered}
    for metric, by_source in scores.items():
        result[metric] = float(np.mean([s for v in by_source.values() for s in v]))
    result["by_data_source"] = {
        source: {"num_prompts": count,
                 **{metric: float(np.mean(by_source[source])) for metric, by_source in scores.items()}}
        for source, count in sorted(prompts_per_source.items())
    }
    result["settings"] = {"n": n, "temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed,
                          "max_prompt_length": max_prompt_length, "max_response_length": max_response_length,
                          "dtype": str(model.dtype).replace("torch.", ""), "device": device}
    result["seconds"] = time.perf_counter() - start
    return result
