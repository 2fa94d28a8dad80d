"""The one generate-and-score path of validation in training, ``hybridflow eval`` and the built-in model's check
script: prompts in chunks through a rollout, each chunk's responses scored, scores averaged over all responses and
per ``data_source``. Each caller brings its own ``generate`` (the actor group's ``generate_sequences`` or a local
rollout's) and ``score`` (the reward group, or :func:`hybridflow.rewards.batch.score_batch`); the loop, the sampling
overrides, the seeding and the averaging are here, so all of them give the same numbers for the same model, data
and backend.

Shapes: B prompts, n responses per prompt, N = B*n responses; P prompt tokens.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Callable, Iterator, Optional

import numpy as np

from hybridflow.protocol import DataProto
from hybridflow.rollout.vision import prompt_vision_keys, share_vision_columns
from hybridflow.utils.progress import Progress

logger = logging.getLogger(__name__)

__all__ = ["GREEDY", "PROMPT_KEYS", "generate_and_score", "mean_by_source", "score_passes", "summarise_scores"]

GREEDY = {"do_sample": False, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "n": 1}
PROMPT_KEYS = ["input_ids", "attention_mask", "position_ids"]

ChunkHook = Callable[[str, DataProto, list[float]], None]


def generate_and_score(generate: Callable[[DataProto], DataProto], score: Callable[[DataProto], list[float]],
                       data: DataProto, sampling: dict, batch_size: Optional[int], seed: int,
                       desc: str) -> Iterator[tuple[DataProto, list[float]]]:
    """The rollout-and-score loop: ``data`` split into chunks of ``batch_size`` prompts (None: one chunk), each
    chunk's prompts generated with the sampling overrides ``sampling`` (``do_sample``, ``temperature``, ``top_p``,
    ``top_k``, ``n``) and ``seed`` in ``meta_info``, then scored. Shows a progress bar (or plain lines) named
    ``desc`` over the prompts.

    Args:
        generate: the actor group's (or a local rollout's) ``generate_sequences``.
        score: N responses -> N floats (e.g. the summed ``token_level_scores`` of the reward).
        data: B left-padded prompts (``input_ids``, ``attention_mask``, ``position_ids`` (B, P)) and their
            non-tensor columns (``data_source``, ``ground_truth``, ...).

    Yields:
        per chunk of b prompts: the N = b*n scored rows (the generated tensors and the prompts' non-tensor
        columns repeated n times, interleaved: p0, p0, p1, ...) and their N scores.
    """
    batch_size = batch_size or len(data)
    logger.info("%s: %d prompts x %d responses, %d prompts per batch", desc, len(data), sampling["n"], batch_size)
    with Progress(desc, len(data), "prompts", leave=False) as progress:
        for chunk in data.split(batch_size):
            prompts = share_vision_columns(  # + a VLM's mrope positions and per-row images
                chunk.select(list(PROMPT_KEYS) + prompt_vision_keys(chunk), non_tensor_batch_keys=[]), chunk)
            prompts.meta_info.update(sampling, seed=seed)
            gen = generate(prompts)
            columns = chunk.select(batch_keys=[]).repeat(sampling["n"], interleave=True).non_tensor_batch
            columns.update(gen.non_tensor_batch)  # the multi-turn record (turn spans, tool calls) for the reward
            rows = DataProto(batch=gen.batch, non_tensor_batch=columns)
            yield rows, score(rows)
            progress.update(len(chunk))


def score_passes(generate: Callable[[DataProto], DataProto], score: Callable[[DataProto], list[float]],
                 data: DataProto, passes: dict[str, dict], batch_size: Optional[int], seed: int,
                 desc: Callable[[str], str], on_chunk: Optional[ChunkHook] = None,
                 ) -> dict[str, tuple[list[float], list[str]]]:
    """Run :func:`generate_and_score` once per pass (name -> sampling overrides) over ``data``; ``desc(name)`` names
    the pass's progress bar.

    ``on_chunk(pass_name, rows, scores)``, when given, sees every scored chunk (to write responses, or to score a
    cost on the same responses). Returns pass name -> (the N scores, their N data sources), in pass order.
    """
    results: dict[str, tuple[list[float], list[str]]] = {}
    for name, sampling in passes.items():
        scores: list[float] = []
        sources: list[str] = []
        for rows, chunk_scores in generate_and_score(generate, score, data, sampling, batch_size, seed, desc(name)):
            scores.extend(chunk_scores)
            sources.extend(rows.non_tensor_batch["data_source"].tolist())
            if on_chunk is not None:
                on_chunk(name, rows, chunk_scores)
        results[name] = (scores, sources)
    return results


def mean_by_source(scores: list[float], sources: list[str]) -> tuple[float, dict[str, float]]:
    """The mean of ``scores`` over all responses, and per data source (sorted by source) over its responses.

    Raises:
        ValueError: ``scores`` and ``sources`` differ in length, or are empty.
    """
    if len(scores) != len(sources) or not scores:
        raise ValueError(f"need one data source per score and at least one score, got {len(scores)} scores and "
                         f"{len(sources)} sources")
    by_source: dict[str, list[float]] = defaultdict(list)
    for source, value in zip(sources, scores):
        by_source[source].append(value)
    return float(np.mean(scores)), {src: float(np.mean(v)) for src, v in sorted(by_source.items())}


def summarise_scores(name: str, scores: list[float], sources: list[str]) -> dict[str, float]:
    """Validation's metric names: ``{name: mean, f"{name}/{data_source}": mean of that source, ...}``."""
    overall, per_source = mean_by_source(scores, sources)
    return {name: overall, **{f"{name}/{src}": value for src, value in per_source.items()}}
