"""``hybridflow eval MODEL_DIR DATA.parquet``: score a model on prompts without training, in one process.

The pieces are the training run's own: the tokenizer and model from :mod:`hybridflow.models.hf` (same pad and eos
rules), prompts through :class:`~hybridflow.data.dataset.RLHFDataset` and ``collate_fn`` (same chat-template
rule, the whole set collated once as validation does), the rollout backend looked up by name in the rollout
registry and built with ``from_config`` as the actor worker builds it (``hf``, or ``vllm`` with
``rollout="vllm"``), the validation loop itself (:mod:`hybridflow.rewards.validation`, which validation in training
runs too: same batching, sampling overrides, seed and averages) and scores by :func:`hybridflow.rewards.batch.score_batch` (what the
rule-reward worker runs). So eval and validation give the same numbers for the same model, data and backend.
One process, no Ray.

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
from collections import Counter
from types import SimpleNamespace
from typing import Any, Optional, Sequence, Union

import torch

from hybridflow.data.dataset import RLHFDataset, collate_fn, load_rows
from hybridflow.distributed import resolve_dtype
from hybridflow.models.hf import get_eos_token_ids, load_causal_lm, load_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.rewards import check_data_sources
from hybridflow.rewards.batch import decode_responses, score_batch
from hybridflow.rollout import BaseRollout, get_rollout_class
from hybridflow.rewards.validation import mean_by_source, score_passes

logger = logging.getLogger(__name__)

__all__ = ["build_rollout", "eval_passes", "evaluate", "prompt_dataset", "rollout_config"]

PathLike = Union[str, "os.PathLike[str]"]


def eval_passes(n: int, temperature: float, top_p: float, top_k: int) -> dict[str, dict]:
    """Generation passes by name: sampling overrides for the rollout (see :func:`evaluate`, ``n``)."""
    greedy = dict(n=1, do_sample=False, temperature=0.0)
    sampled = dict(n=n, do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
    if n > 1:
        return {"greedy": greedy, "sampled": sampled}
    return {"sampled": sampled} if temperature > 0 else {"greedy": greedy}


def evaluate(
    model_path: str, data_files: Union[PathLike, Sequence[PathLike]], n: int = 1, temperature: float = 0.0,
    top_p: float = 1.0, top_k: int = -1, batch_size: int = 64, max_prompt_length: Optional[int] = None,
    max_response_length: int = 512, truncation: str = "error", dtype: str = "auto", device: str = "auto",
    seed: int = 0, output: Optional[PathLike] = None, prompt_key: str = "prompt", trust_remote_code: bool = False,
    rollout: str = "hf",
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
        seed: seeds the sampled pass (every batch's ``meta_info["seed"]``, as in validation).
        output: if set, a JSONL file with one line per response: ``index``, ``data_source``, ``prompt``,
            ``response``, ``ground_truth``, ``score``, ``pass`` (``"greedy"`` or ``"sampled"``) and ``sample``
            (0..n-1 within its prompt).
        prompt_key, trust_remote_code: the row key of the prompt; passed to the tokenizer and model loaders.
        rollout: the rollout backend's registered name (``hf``, ``vllm``), as ``actor_rollout_ref.rollout.name``.
    Progress: a bar with ETA per pass on a terminal, plain lines otherwise (:mod:`hybridflow.utils.progress`).

    Returns:
        ``{"model", "data", "num_prompts", "num_filtered", "mean@1", ["mean@k"], "by_data_source":
        {source: {"num_prompts", "mean@1", ["mean@k"]}}, "settings": {...}, "seconds"}`` (JSON-serializable).

    Raises:
        ValueError: ``n < 1``, ``batch_size < 1``, ``n > 1`` with ``temperature <= 0``, no prompts, or bad data (a
            :class:`~hybridflow.errors.DataError`, see ``RLHFDataset``; an unknown ``data_source`` names the
            registered ones).
        FileNotFoundError: the model directory or a data file does not exist.
        UnknownNameError: (a ``KeyError``) ``rollout`` is not a registered backend (the message lists them).
    """
    if n < 1 or batch_size < 1:
        raise ValueError(f"n and batch_size must be >= 1, got n={n}, batch_size={batch_size}")
    if n > 1 and temperature <= 0:
        raise ValueError(f"mean@{n} samples {n} responses per prompt: it needs temperature > 0, got {temperature}")
    start = time.perf_counter()
    files = [os.fspath(f) for f in ([data_files] if isinstance(data_files, (str, os.PathLike)) else data_files)]
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    tokenizer = load_tokenizer(model_path, trust_remote_code)
    dataset = prompt_dataset(load_rows(files, prompt_key), tokenizer, max_prompt_length, prompt_key, truncation)
    if len(dataset) == 0:
        raise ValueError(f"no prompts to evaluate in {files}")
    data = collate_fn([dataset[i] for i in range(len(dataset))], tokenizer.pad_token_id)
    torch_dtype = resolve_dtype(dtype, device)
    generator = build_rollout(rollout, model_path, rollout_config(max_response_length, batch_size, top_p, top_k),
                              tokenizer, torch_dtype, device, trust_remote_code,
                              max_model_len=data.batch["input_ids"].shape[1] + max_response_length)
    passes = eval_passes(n, temperature, top_p, top_k)
    results = _run_passes(generator, tokenizer, data, passes, batch_size, seed, output)
    result: dict[str, Any] = {"model": model_path, "data": files, "num_prompts": len(dataset),
                              "num_filtered": dataset.num_filtered,
                              **_summarise(results, passes, data.non_tensor_batch["data_source"].tolist())}
    result["settings"] = {"n": n, "temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed,
                          "max_prompt_length": max_prompt_length, "max_response_length": max_response_length,
                          "dtype": str(torch_dtype).replace("torch.", ""), "device": device, "rollout": rollout}
    result["seconds"] = time.perf_counter() - start
    return result


def prompt_dataset(rows: list[dict], tokenizer: Any, max_prompt_length: Optional[int], prompt_key: str = "prompt",
                   truncation: str = "error") -> RLHFDataset:
    """The prompts of ``rows`` as training reads them (:class:`RLHFDataset`: chat template, truncation), after
    checking that every row's ``data_source`` has a reward (before any model loads).

    Raises:
        DataError: a bad row, or a ``data_source`` without a registered reward.
    """
    dataset = RLHFDataset(rows, tokenizer, max_prompt_length or sys.maxsize, prompt_key, truncation)
    check_data_sources(rows)
    return dataset


def rollout_config(max_response_length: int, batch_size: int, top_p: float = 1.0,
                   top_k: int = -1) -> SimpleNamespace:
    """The sampling config a rollout backend is built with outside training (greedy; each pass overrides it)."""
    return SimpleNamespace(response_length=max_response_length, n=1, do_sample=False, temperature=0.0, top_p=top_p,
                           top_k=top_k, micro_batch_size=batch_size, tensor_model_parallel_size=1)


def _run_passes(generator: BaseRollout, tokenizer: Any, data: DataProto, passes: dict[str, dict], batch_size: int,
                seed: int, output: Optional[PathLike]) -> dict[str, tuple[list[float], list[str]]]:
    """Generate and score every pass over ``data`` (the validation loop, :func:`score_passes`); writes each response
    to ``output`` when set. Returns pass name -> (scores, data sources) of its responses."""
    out = open(output, "w", encoding="utf-8") if output else None

    def write(name: str, rows: DataProto, scores: list[float]) -> None:
        _write_responses(out, tokenizer, rows, scores, name, passes[name]["n"])

    try:
        return score_passes(generator.generate_sequences, lambda r: score_batch(tokenizer, r), data, passes,
                            batch_size, seed, lambda name: f"eval ({name}, mean@{passes[name]['n']})",
                            write if out is not None else None)
    finally:
        if out is not None:
            out.close()


def _summarise(results: dict[str, tuple[list[float], list[str]]], passes: dict[str, dict],
               sources: list[str]) -> dict[str, Any]:
    """``{"mean@<n>": mean over all responses, ..., "by_data_source": {source: {"num_prompts", "mean@<n>": mean}}}``
    from the passes' results and the data source of each prompt."""
    result: dict[str, Any] = {"by_data_source": {source: {"num_prompts": count}
                                                 for source, count in sorted(Counter(sources).items())}}
    for name, (scores, response_sources) in results.items():
        metric = f"mean@{passes[name]['n']}"
        result[metric], per_source = mean_by_source(scores, response_sources)
        for source, value in per_source.items():
            result["by_data_source"][source][metric] = value
    return {k: result[k] for k in [*(k for k in result if k != "by_data_source"), "by_data_source"]}


def build_rollout(name: str, model_path: str, config: SimpleNamespace, tokenizer: Any, dtype: torch.dtype,
                   device: str, trust_remote_code: bool, max_model_len: int) -> BaseRollout:
    """The rollout backend ``name`` built as the actor worker builds it (``from_config``; a loaded module only
    for a backend that ``needs_module``)."""
    rollout_cls = get_rollout_class(name)
    module = load_causal_lm(model_path, dtype, trust_remote_code).to(device) if rollout_cls.needs_module else None
    return rollout_cls.from_config(model_path, module, config, eos_token_id=get_eos_token_ids(model_path, tokenizer),
                                   pad_token_id=tokenizer.pad_token_id, dtype=dtype,
                                   trust_remote_code=trust_remote_code, max_model_len=max_model_len)


def _write_responses(out: Any, tokenizer: Any, scored: DataProto, scores: list[float], name: str, n: int) -> None:
    """One JSON line per scored response (see :func:`evaluate`, ``output``)."""
    rows = scored.non_tensor_batch
    for i, text in enumerate(decode_responses(tokenizer, scored)):
        out.write(json.dumps({
            "index": int(rows["index"][i]), "data_source": rows["data_source"][i], "prompt": rows["raw_prompt"][i],
            "response": text, "ground_truth": rows["ground_truth"][i], "score": scores[i], "pass": name,
            "sample": i % n,
        }) + "\n")
