"""Validation on held-out prompts, scored by the reward group.

Always a greedy pass: ``val/score`` (mean@1) and ``val/score/<data_source>``. When
``rollout.val_kwargs`` asks for sampling (``do_sample`` with ``n >= 1``), also a sampled pass:
``val/mean@<n>`` (the average score over n samples per prompt) and ``val/mean@<n>/<data_source>``.
With a cost (Safe-RLHF), the greedy pass also gives ``val/cost`` (mean cost per response). Multi-turn runs also
log the greedy pass's tool metrics: ``val/tool/calls_mean``, ``val/tool/correct_call``, ... (:func:`tool_metrics`).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Callable, Iterator, Optional

import numpy as np

from hybridflow.protocol import DataProto
from hybridflow.rollout.multi_turn import multi_turn_metrics
from hybridflow.utils.progress import Progress

logger = logging.getLogger(__name__)

GREEDY = {"do_sample": False, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "n": 1}
PROMPT_KEYS = ["input_ids", "attention_mask", "position_ids"]


def generate_and_score(generate: Callable[[DataProto], DataProto], score: Callable[[DataProto], list[float]],
                       data: DataProto, sampling: dict, batch_size: Optional[int], seed: int,
                       desc: str) -> Iterator[tuple[DataProto, list[float]]]:
    """The rollout-and-score loop shared by validation and ``hybridflow eval`` (so both give the same numbers
    for the same model, data and backend): ``data`` split into chunks of ``batch_size`` prompts (None: one
    chunk), each chunk's prompts generated with the sampling overrides ``sampling`` (``do_sample``,
    ``temperature``, ``top_p``, ``top_k``, ``n``) and ``seed`` in ``meta_info``, then scored. Shows a progress
    bar (or plain lines) named ``desc`` over the prompts.

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
            prompts = chunk.select(PROMPT_KEYS, non_tensor_batch_keys=[])
            prompts.meta_info.update(sampling, seed=seed)
            gen = generate(prompts)
            columns = chunk.select(batch_keys=[]).repeat(sampling["n"], interleave=True).non_tensor_batch
            columns.update(gen.non_tensor_batch)  # the multi-turn record (turn spans, tool calls) for the reward
            rows = DataProto(batch=gen.batch, non_tensor_batch=columns)
            yield rows, score(rows)
            progress.update(len(chunk))


def tool_metrics(rows: list[DataProto], prefix: str) -> dict[str, float]:
    """Multi-turn metrics of validation responses (empty for single-turn ones): ``<prefix>/tool/calls_mean`` and
    the rest of :func:`~hybridflow.rollout.multi_turn.multi_turn_metrics`, and ``<prefix>/tool/correct_call``: the
    share of responses with a tool call that ran without error and returned the row's ground truth (the answer
    was computed by the tool, e.g. the calculator on builtin:tool-arith)."""
    rows = [r for r in rows if "tool_calls" in r.non_tensor_batch]
    if not rows:
        return {}
    data = DataProto.concat([r.select(batch_keys=[]) for r in rows])  # chunks may differ in width
    metrics = {f"{prefix}/{k}": v for k, v in multi_turn_metrics(data).items()}
    nt = data.non_tensor_batch
    correct = [any(c["error"] is None and str(c["result"]).strip() == str(truth).strip() for c in calls)
               for calls, truth in zip(nt["tool_calls"], nt["ground_truth"])]
    metrics[f"{prefix}/tool/correct_call"] = float(np.mean(correct))
    return metrics


def _scores(config, actor, reward, val_data: DataProto, sampling: dict, cost=None,
            costs: list[float] | None = None, generated: list[DataProto] | None = None) -> tuple[list[float], list[str]]:
    """Scores and data sources of the responses; with ``cost``, also appends their costs to ``costs``; with
    ``generated``, appends the scored rows to it."""
    scores: list[float] = []
    sources: list[str] = []
    name = "greedy" if not sampling["do_sample"] else f"mean@{sampling['n']}"

    def score(rows: DataProto) -> list[float]:
        return reward.compute_rm_score(rows).batch["token_level_scores"].sum(-1).tolist()

    for rows, chunk_scores in generate_and_score(actor.generate_sequences, score, val_data, sampling,
                                                 config.data.val_batch_size, config.trainer.seed,
                                                 f"validation ({name})"):
        scores.extend(chunk_scores)
        sources.extend(rows.non_tensor_batch["data_source"].tolist())
        if generated is not None:
            generated.append(rows)
        if cost is not None:
            costs.extend(cost.compute_cost(rows).sum(-1).tolist())
    return scores, sources


def _summarise(name: str, scores: list[float], sources: list[str]) -> dict[str, float]:
    by_source: dict[str, list[float]] = defaultdict(list)
    for source, score in zip(sources, scores):
        by_source[source].append(score)
    metrics = {name: float(np.mean(scores))}
    metrics.update({f"{name}/{src}": float(np.mean(v)) for src, v in by_source.items()})
    return metrics


def validate(config, actor, reward, val_data: DataProto, cost=None) -> dict[str, float]:
    """Greedy mean@1 (and sampled mean@n per ``rollout.val_kwargs``) over ``val_data``, per data_source; with
    ``cost`` (a :class:`~hybridflow.trainer.scoring.CostScorer`) also the greedy responses' mean ``val/cost``."""
    costs: list[float] = []
    generated: list[DataProto] = []
    metrics = _summarise("val/score", *_scores(config, actor, reward, val_data, GREEDY, cost, costs, generated))
    metrics.update(tool_metrics(generated, "val"))
    if cost is not None:
        metrics["val/cost"] = float(np.mean(costs))
    kw = config.actor_rollout_ref.rollout.val_kwargs
    if kw.do_sample:
        sampling = {"do_sample": True, "temperature": kw.temperature, "top_p": kw.top_p, "top_k": kw.top_k,
                    "n": kw.n}
        metrics.update(_summarise(f"val/mean@{kw.n}", *_scores(config, actor, reward, val_data, sampling)))
    return metrics
