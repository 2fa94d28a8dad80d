"""Validation on held-out prompts, scored by the reward group.

Always a greedy pass: ``val/score`` (mean@1) and ``val/score/<data_source>``. When
``rollout.val_kwargs`` asks for sampling (``do_sample`` with ``n >= 1``), also a sampled pass:
``val/mean@<n>`` (the average score over n samples per prompt) and ``val/mean@<n>/<data_source>``.
With a cost (Safe-RLHF), the greedy pass also gives ``val/cost`` (mean cost per response).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from hybridflow.protocol import DataProto

GREEDY = {"do_sample": False, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "n": 1}


def _scores(config, actor, reward, val_data: DataProto, sampling: dict, cost=None,
            costs: list[float] | None = None) -> tuple[list[float], list[str]]:
    """Scores and data sources of the responses; with ``cost``, also appends their costs to ``costs``."""
    batch_size = config.data.val_batch_size or len(val_data)
    scores: list[float] = []
    sources: list[str] = []
    for chunk in val_data.split(batch_size):
        prompts = chunk.select(["input_ids", "attention_mask", "position_ids"])
        prompts.meta_info.update(sampling, seed=config.trainer.seed)
        gen = actor.generate_sequences(prompts)
        rows = chunk.repeat(sampling["n"], interleave=True)
        rows = DataProto(batch=gen.batch, non_tensor_batch=rows.non_tensor_batch)
        scores.extend(reward.compute_rm_score(rows).batch["token_level_scores"].sum(-1).tolist())
        sources.extend(rows.non_tensor_batch["data_source"].tolist())
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
    metrics = _summarise("val/score", *_scores(config, actor, reward, val_data, GREEDY, cost, costs))
    if cost is not None:
        metrics["val/cost"] = float(np.mean(costs))
    kw = config.actor_rollout_ref.rollout.val_kwargs
    if kw.do_sample:
        sampling = {"do_sample": True, "temperature": kw.temperature, "top_p": kw.top_p, "top_k": kw.top_k,
                    "n": kw.n}
        metrics.update(_summarise(f"val/mean@{kw.n}", *_scores(config, actor, reward, val_data, sampling)))
    return metrics
