"""``hybridflow eval MODEL_DIR DATA.parquet``: score a model on prompts without training, in one process.

The pieces are the training run's own: the tokenizer and model from :mod:`hybridflow.models.hf` (same pad and eos
rules), prompts through :class:`~hybridflow.data.dataset.RLHFDataset` and ``collate_fn`` (same chat-template
rule, the whole set collated once as validation does), the rollout backend looked up by name in the rollout
registry and built with ``from_config`` as the actor worker builds it (``hf``, or ``vllm`` with
``rollout="vllm"``), the validation loop itself (:mod:`hybridflow.rewards.validation`, which validation in training
runs too: same batching, sampling overrides, seed and averages) and scores by :func:`hybridflow.rewards.batch.score_batch` (what the
rule-reward worker runs), with the training run's reward options: a user ``compute_score`` function and
``plugins`` loaded by the same functions as ``reward_model.compute_score`` and ``trainer.plugins``
(:func:`reward_scorer`). So eval and validation give the same numbers for the same model, data and backend.
One process, no Ray. Ctrl-C stops it with :class:`~hybridflow.errors.EvalInterrupted`; the responses scored so far
stay in the output file.

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
from typing import Any, Callable, Optional, Sequence, Union

import torch

from hybridflow.data.dataset import RLHFDataset, collate_fn, first_rows, load_rows
from hybridflow.data.multimodal import MultimodalDataset, collate_multimodal, vision_dataset
from hybridflow.distributed import resolve_dtype
from hybridflow.errors import EvalInterrupted
from hybridflow.models.hf import get_eos_token_ids, load_causal_lm, load_tokenizer, model_positions
from hybridflow.protocol import DataProto
from hybridflow.plugins import import_plugins, resolve_plugins
from hybridflow.rewards import check_data_sources, extract_answer, load_compute_score
from hybridflow.rewards.batch import decode_responses, score_batch
from hybridflow.rollout import BaseRollout, get_rollout_class
from hybridflow.rewards.sample_metrics import sampled_metrics
from hybridflow.rewards.validation import mean_by_source, score_passes

logger = logging.getLogger(__name__)

__all__ = ["build_rollout", "eval_passes", "evaluate", "prompt_dataset", "reward_scorer", "rollout_config"]

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
    rollout: str = "hf", compute_score: str = "default", error_score: Optional[float] = None,
    plugins: Sequence[str] = (), max_samples: int = -1, reward_timeout_s: Optional[float] = 300.0,
    pass_threshold: float = 1.0,
) -> dict:
    """Score ``model_path`` on the parquet prompts of ``data_files`` (verl schema) with the rule rewards or a user
    scoring function.

    Args:
        model_path: local Hugging Face causal-LM directory (tokenizer in the same directory), or ``builtin:NAME``.
        data_files: one parquet file or several.
        n: responses per prompt. 1: one pass at ``temperature`` (greedy at 0) -> ``mean@1``. k > 1: a greedy
            pass -> ``mean@1`` plus a sampled pass of k responses per prompt at ``temperature`` -> ``mean@k``.
        temperature, top_p, top_k: sampling settings (top_k -1 disables).
        batch_size, max_response_length: prompts per generation call; generated tokens per response.
        max_prompt_length: prompt tokens; None means no limit. Longer prompts are handled per ``truncation``
            (``error`` | ``left`` | ``right`` | ``filter``; filtered prompts are counted in ``num_filtered``).
        dtype: ``auto`` (fp32 on CPU, bf16 on GPU), ``float32``, ``bfloat16`` or ``float16``.
        device: ``auto`` (cuda when available), ``cpu`` or ``cuda``.
        seed: seeds the sampled pass (every batch's ``meta_info["seed"]``, as in validation).
        output: if set, a JSONL file with one line per response: ``index``, ``data_source``, ``prompt``,
            ``response``, ``ground_truth``, ``score``, ``pass`` (``"greedy"`` or ``"sampled"``) and ``sample``
            (0..n-1 within its prompt).
        prompt_key, trust_remote_code: the row key of the prompt; passed to the tokenizer and model loaders.
        rollout: the rollout backend's registered name (``hf``, ``vllm``), as ``actor_rollout_ref.rollout.name``.
        compute_score, error_score, plugins, reward_timeout_s: as ``reward_model.compute_score``,
            ``reward_model.error_score``, ``trainer.plugins`` and ``reward_model.timeout_s`` in training
            (:func:`reward_scorer`).
        max_samples: keep the first N prompt rows of ``data_files`` (-1: all), as ``data.val_max_samples``.
        pass_threshold: ``pass@k`` counts a response as correct when its score is >= this (as ``val_kwargs``').
    Progress: a bar with ETA per pass on a terminal, plain lines otherwise (:mod:`hybridflow.utils.progress`).

    Returns:
        ``{"model", "data", "num_prompts", "num_filtered", "mean@1", ["mean@k"], "by_data_source":
        {source: {"num_prompts", "mean@1", ["mean@k"]}}, "settings": {...}, "seconds"}`` (JSON-serializable).
        ``n`` >= 2 adds the sampled pass's ``pass@j``, ``best@j``, ``maj@n`` as validation logs them, overall and
        per source (:mod:`hybridflow.rewards.sample_metrics`: Chen et al. 2021 eq. 1; maj@n where answers extract).

    Raises:
        ValueError: ``n``/``batch_size`` < 1, ``n > 1`` with ``temperature <= 0``, no prompts, prompt + response
            beyond the model's positions (:func:`_check_positions`), or bad data (a ``DataError``, see
            ``RLHFDataset``; an unknown ``data_source`` names the registered ones).
        FileNotFoundError: the model directory or a data file does not exist.
        UnknownNameError: (a ``KeyError``) ``rollout`` is not a registered backend (the message lists them).
        UserError: a plugin cannot be imported; ``MissingTokenizerError`` (also a ``ValueError``): the model
            directory holds no tokenizer files.
        EvalInterrupted: (a ``KeyboardInterrupt``) Ctrl-C during generation; ``output`` keeps what was scored.
    """
    _check_sampling(n, batch_size, temperature)
    start = time.perf_counter()
    files = [os.fspath(f) for f in ([data_files] if isinstance(data_files, (str, os.PathLike)) else data_files)]
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    tokenizer = load_tokenizer(model_path, trust_remote_code)
    score = reward_scorer(tokenizer, compute_score, error_score, plugins, reward_timeout_s)  # before data, model
    rows = first_rows(load_rows(files, prompt_key), max_samples, "max_samples")
    dataset = prompt_dataset(rows, tokenizer, max_prompt_length, prompt_key, truncation,
                             check_sources=compute_score == "default", model_path=model_path)
    data = _collate(dataset, tokenizer, files)
    _check_positions(model_path, trust_remote_code, data.batch["input_ids"].shape[1], max_response_length)
    torch_dtype = resolve_dtype(dtype, device)
    generator = build_rollout(rollout, model_path, rollout_config(max_response_length, batch_size, top_p, top_k),
                              tokenizer, torch_dtype, device, trust_remote_code,
                              max_model_len=data.batch["input_ids"].shape[1] + max_response_length)
    passes = eval_passes(n, temperature, top_p, top_k)
    answers: dict[str, list] = {}
    results = _run_passes(generator, tokenizer, score, data, passes, batch_size, seed, output, answers)
    result: dict[str, Any] = {"model": model_path, "data": files, "num_prompts": len(dataset),
                              "num_filtered": dataset.num_filtered,
                              **_summarise(results, passes, data.non_tensor_batch["data_source"].tolist(), answers,
                                           pass_threshold)}
    result["settings"] = dict(n=n, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, rollout=rollout,
                              max_prompt_length=max_prompt_length, max_response_length=max_response_length,
                              dtype=str(torch_dtype).replace("torch.", ""), device=device, max_samples=max_samples,
                              compute_score=compute_score, pass_threshold=pass_threshold)
    result["seconds"] = time.perf_counter() - start
    return result


def prompt_dataset(rows: list[dict], tokenizer: Any, max_prompt_length: Optional[int], prompt_key: str = "prompt",
                   truncation: str = "error", check_sources: bool = True,
                   model_path: Optional[str] = None) -> RLHFDataset:
    """The prompts of ``rows`` as training reads them (:class:`RLHFDataset`: chat template, truncation; rows with
    images for the vision-language model at ``model_path``: its :class:`MultimodalDataset`, images processed once,
    no truncation), after checking (with ``check_sources``: the rule rewards score them) that every row's
    ``data_source`` has a reward (before any model loads).

    Raises:
        DataError: a bad row, or a ``data_source`` without a registered reward; ``ImageError`` (a DataError): a bad
            image, or images for a model that is not a VLM.
    """
    limit = max_prompt_length or sys.maxsize
    dataset = vision_dataset(rows, tokenizer, model_path, limit, prompt_key) if model_path else None
    dataset = dataset or RLHFDataset(rows, tokenizer, limit, prompt_key, truncation)
    if check_sources:
        check_data_sources(rows)
    return dataset


def reward_scorer(tokenizer: Any, compute_score: str = "default", error_score: Optional[float] = None,
                  plugins: Sequence[str] = (), timeout_s: Optional[float] = None) -> Callable[[DataProto], list[float]]:
    """N scored responses -> N floats, as training scores them: ``plugins`` imported as the config loader imports
    ``trainer.plugins`` (:func:`hybridflow.plugins.import_plugins`, file paths made absolute), then
    ``compute_score`` loaded as the reward worker loads ``reward_model.compute_score`` (``default``: the reward
    registered for each row's ``data_source``; else ``path/file.py:fn`` or ``module:fn``,
    :func:`hybridflow.rewards.load_compute_score`) and :func:`score_batch` with ``error_score`` and ``timeout_s``
    (seconds per response's call, as ``reward_model.timeout_s``; None: unbounded).

    Raises:
        UserError: a plugin cannot be imported (one line naming it).
        ValueError: ``compute_score`` names no importable function (one line naming it).
    """
    import_plugins(resolve_plugins(plugins))
    fn = None if compute_score == "default" else load_compute_score(compute_score)  # None: the registry

    def score(rows: DataProto) -> list[float]:
        return score_batch(tokenizer, rows, error_score=error_score, compute_score=fn, timeout_s=timeout_s)

    return score


def rollout_config(max_response_length: int, batch_size: int, top_p: float = 1.0,
                   top_k: int = -1) -> SimpleNamespace:
    """The sampling config a rollout backend is built with outside training (greedy; each pass overrides it)."""
    return SimpleNamespace(response_length=max_response_length, n=1, do_sample=False, temperature=0.0, top_p=top_p,
                           top_k=top_k, micro_batch_size=batch_size, tensor_model_parallel_size=1)


def _run_passes(generator: BaseRollout, tokenizer: Any, score: Callable[[DataProto], list[float]], data: DataProto,
                passes: dict[str, dict], batch_size: int, seed: int, output: Optional[PathLike],
                answers: dict[str, list]) -> dict[str, tuple[list[float], list[str]]]:
    """Generate and score every pass over ``data`` (the validation loop, :func:`score_passes`); writes each response
    to ``output`` when set, flushed per batch. Returns pass name -> (scores, data sources) of its responses; fills
    ``answers``: pass name -> the answer each response gives as its data source's reward extracts it (None: none),
    for the passes of n >= 2 (maj@n).

    Raises:
        EvalInterrupted: Ctrl-C (``KeyboardInterrupt``); it counts the prompts scored per pass and the responses
            written to ``output``, which keeps them.
    """
    out = open(output, "w", encoding="utf-8") if output else None
    scored = {name: 0 for name in passes}  # prompts scored per pass
    written = 0

    def on_chunk(name: str, rows: DataProto, scores: list[float]) -> None:
        nonlocal written
        texts = decode_responses(tokenizer, rows) if out is not None or passes[name]["n"] >= 2 else []
        if out is not None:
            _write_responses(out, texts, rows, scores, name, passes[name]["n"])
            out.flush()
            written += len(rows)
        scored[name] += len(rows) // passes[name]["n"]
        if passes[name]["n"] >= 2:
            sources = rows.non_tensor_batch["data_source"]
            answers.setdefault(name, []).extend(
                extract_answer(str(src), text) for src, text in zip(sources, texts))

    try:
        return score_passes(generator.generate_sequences, score, data, passes, batch_size, seed,
                            lambda name: f"eval ({name}, mean@{passes[name]['n']})", on_chunk)
    except KeyboardInterrupt:
        raise EvalInterrupted(scored, len(data), None if output is None else os.fspath(output), written) from None
    finally:
        if out is not None:
            out.close()


def _summarise(results: dict[str, tuple[list[float], list[str]]], passes: dict[str, dict], sources: list[str],
               answers: dict[str, list], pass_threshold: float) -> dict[str, Any]:
    """``{"mean@<n>": mean over all responses, ..., "by_data_source": {source: {"num_prompts", "mean@<n>": mean}}}``
    from the passes' results and the data source of each prompt; with a sampled pass of n >= 2 also its pass@k,
    best@k and maj@n (:func:`_add_sampled_metrics`, ``answers`` of that pass, ``pass_threshold``)."""
    result: dict[str, Any] = {"by_data_source": {source: {"num_prompts": count}
                                                 for source, count in sorted(Counter(sources).items())}}
    for name, (scores, response_sources) in results.items():
        metric = f"mean@{passes[name]['n']}"
        result[metric], per_source = mean_by_source(scores, response_sources)
        for source, value in per_source.items():
            result["by_data_source"][source][metric] = value
    if passes.get("sampled", {}).get("n", 1) >= 2:
        _add_sampled_metrics(result, *results["sampled"], answers["sampled"], passes["sampled"]["n"], pass_threshold)
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


def _write_responses(out: Any, texts: list[str], scored: DataProto, scores: list[float], name: str, n: int) -> None:
    """One JSON line per scored response (``texts``: the decoded responses; see :func:`evaluate`, ``output``)."""
    rows = scored.non_tensor_batch
    for i, text in enumerate(texts):
        out.write(json.dumps({
            "index": int(rows["index"][i]), "data_source": rows["data_source"][i], "prompt": rows["raw_prompt"][i],
            "response": text, "ground_truth": rows["ground_truth"][i], "score": scores[i], "pass": name,
            "sample": i % n,
        }) + "\n")


def _check_sampling(n: int, batch_size: int, temperature: float) -> None:
    """Raises ValueError: ``n`` or ``batch_size`` below 1, or ``n`` > 1 with a greedy ``temperature`` (<= 0)."""
    if n < 1 or batch_size < 1:
        raise ValueError(f"n and batch_size must be >= 1, got n={n}, batch_size={batch_size}")
    if n > 1 and temperature <= 0:
        raise ValueError(f"mean@{n} samples {n} responses per prompt: it needs temperature > 0, got {temperature}")


def _collate(dataset: RLHFDataset, tokenizer: Any, files: list[str]) -> DataProto:
    """Every prompt of ``dataset`` as one left-padded DataProto. Raises ValueError: no prompts (all filtered)."""
    if len(dataset) == 0:
        raise ValueError(f"no prompts to evaluate in {files}")
    features = [dataset[i] for i in range(len(dataset))]
    if isinstance(dataset, MultimodalDataset):  # + mrope positions and the per-row images (the hf rollout's inputs)
        return collate_multimodal(features, tokenizer.pad_token_id, dataset.image_token_id, dataset.merge_size)
    return collate_fn(features, tokenizer.pad_token_id)


def _check_positions(model_path: str, trust_remote_code: bool, prompt_length: int, max_response_length: int) -> None:
    """Refuse, before the model loads, a longest prompt + ``max_response_length`` beyond the model's positions
    (``max_position_embeddings`` x its rope factor, from config.json; no check where the config names none).

    Raises:
        ValueError: one line naming both numbers and the options to change.
    """
    limits = model_positions(model_path, trust_remote_code)
    if limits is None:
        return
    limit, factor = limits
    need = prompt_length + max_response_length
    if need > limit * factor:
        scaled = f" x rope scaling factor {factor:g}" if factor > 1 else ""
        raise ValueError(f"the longest prompt ({prompt_length} tokens) + --max-response-length {max_response_length}"
                         f" = {need} exceeds the model's max_position_embeddings={limit}{scaled} ({model_path}, its "
                         "config.json): lower --max-response-length or --max-prompt-length (with --truncation)")


def _add_sampled_metrics(result: dict[str, Any], scores: list[float], sources: list[str], answers: list,
                         n: int, threshold: float) -> None:
    """Add pass@k, best@k and maj@n of the sampled pass (:func:`sampled_metrics`) to ``result``: overall at the top
    level, per data source under ``by_data_source``."""
    for key, value in sampled_metrics("eval", scores, sources, answers, n, threshold).items():
        parts = key.split("/", 2)  # eval/<metric>[/<data_source>], a data source may hold "/" itself
        if len(parts) == 2:
            result[parts[1]] = value
        else:
            result["by_data_source"][parts[2]][parts[1]] = value
