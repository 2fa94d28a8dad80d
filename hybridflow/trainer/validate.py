"""Validation on held-out prompts, scored by the reward group.

Always a greedy pass: ``val/score`` (mean@1) and ``val/score/<data_source>``. When
``rollout.val_kwargs`` asks for sampling (``do_sample`` with ``n >= 1``), also a sampled pass:
``val/mean@<n>`` (the average score over n samples per prompt) and ``val/mean@<n>/<data_source>``.
With a cost (Safe-RLHF), the greedy pass also gives ``val/cost`` (mean cost per response).

The loop and the averages are :mod:`hybridflow.rewards.validation`'s, which ``hybridflow eval`` uses too.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from hybridflow.protocol import DataProto
from hybridflow.rewards.validation import GREEDY, PROMPT_KEYS, generate_and_score, score_passes, summarise_scores

if TYPE_CHECKING:
    from omegaconf import DictConfig

logger = logging.getLogger(__name__)

__all__ = ["GREEDY", "PROMPT_KEYS", "generate_and_score", "validate"]  # the first three: their former home


def validate(config: DictConfig, actor: Any, reward: Any, val_data: DataProto, cost: Any = None) -> dict[str, float]:
    """Greedy mean@1 (and sampled mean@n per ``rollout.val_kwargs``) over ``val_data``, per data_source; with
    ``cost`` (a :class:`~hybridflow.trainer.scoring.CostScorer`) also the greedy responses' mean ``val/cost``."""
    passes, labels = {"val/score": GREEDY}, {"val/score": "greedy"}  # metric -> sampling, progress label
    kw = config.actor_rollout_ref.rollout.val_kwargs
    if kw.do_sample:
        passes[f"val/mean@{kw.n}"] = {"do_sample": True, "temperature": kw.temperature, "top_p": kw.top_p,
                                      "top_k": kw.top_k, "n": kw.n}
        labels[f"val/mean@{kw.n}"] = f"mean@{kw.n}"
    costs: list[float] = []

    def score(rows: DataProto) -> list[float]:
        return reward.compute_rm_score(rows).batch["token_level_scores"].sum(-1).tolist()

    def cost_of_greedy(name: str, rows: DataProto, scores: list[float]) -> None:
        if name == "val/score":
            costs.extend(cost.compute_cost(rows).sum(-1).tolist())

    results = score_passes(actor.generate_sequences, score, val_data, passes, config.data.val_batch_size,
                           config.trainer.seed, lambda name: f"validation ({labels[name]})",
                           cost_of_greedy if cost is not None else None)
    metrics: dict[str, float] = {}
    for name, (scores, sources) in results.items():
        metrics.update(summarise_scores(name, scores, sources))
    if cost is not None:
        metrics["val/cost"] = float(np.mean(costs))
    return metrics
