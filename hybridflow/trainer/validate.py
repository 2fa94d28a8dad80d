"""Validation on held-out prompts, scored by the reward group.

Always a greedy pass: ``val/score`` (mean@1) and ``val/score/<data_source>``. When
``rollout.val_kwargs`` asks for sampling (``do_sample`` with ``n >= 1``), also a sampled pass:
``val/mean@<n>`` (the average score over n samples per prompt) and ``val/mean@<n>/<data_source>``; with n >= 2
also ``val/pass@<k>`` (k = 1, 2, 4, ..., n; unbiased estimator, correct: score >= ``val_kwargs.pass_threshold``),
``val/best@<k>`` (k = 2, 4, ..., n; exact expected best of k) and ``val/maj@<n>`` (majority vote over the answers the
rule reward extracts), each also per data source (``val/pass@<k>/<data_source>``;
:mod:`hybridflow.rewards.sample_metrics`).
With a cost (Safe-RLHF), the greedy pass also gives ``val/cost`` (mean cost per response). Multi-turn runs also
log the greedy pass's tool metrics: ``val/tool/calls_mean``, ``val/tool/correct_call``, ... (:func:`tool_metrics`).

The loop and the averages are :mod:`hybridflow.rewards.validation`'s, which ``hybridflow eval`` uses too.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from hybridflow.protocol import DataProto
from hybridflow.rewards.sample_metrics import sampled_metrics
from hybridflow.rewards.validation import GREEDY, PROMPT_KEYS, generate_and_score, score_passes, summarise_scores
from hybridflow.rollout.multi_turn import multi_turn_metrics

if TYPE_CHECKING:
    from omegaconf import DictConfig

logger = logging.getLogger(__name__)

__all__ = ["GREEDY", "PROMPT_KEYS", "generate_and_score", "validate"]  # the first three: their former home


def validate(config: DictConfig, actor: Any, reward: Any, val_data: DataProto, cost: Any = None) -> dict[str, float]:
    """Greedy mean@1 (and sampled mean@n per ``rollout.val_kwargs``) over ``val_data``, per data_source; with
    ``cost`` (a :class:`~hybridflow.trainer.scoring.CostScorer`) also the greedy responses' mean ``val/cost``.

    The prompts go through the actor in chunks of ``data.val_batch_size`` (default ``data.train_batch_size``)
    prompts (x n responses), each pass with its progress bar or plain progress lines; the chunks keep
    ``val_data``'s padding, so greedy results do not depend on the chunk size."""
    passes, labels = {"val/score": GREEDY}, {"val/score": "greedy"}  # metric -> sampling, progress label
    kw = config.actor_rollout_ref.rollout.val_kwargs
    if kw.do_sample:
        passes[f"val/mean@{kw.n}"] = {"do_sample": True, "temperature": kw.temperature, "top_p": kw.top_p,
                                      "top_k": kw.top_k, "n": kw.n}
        labels[f"val/mean@{kw.n}"] = f"mean@{kw.n}"
    costs: list[float] = []
    greedy: list[DataProto] = []
    answers: dict[str, list] = {name: [] for name in passes}

    def score(rows: DataProto) -> list[float]:
        rows.meta_info["extract_answers"] = True  # the rule reward adds an "answer" column (maj@n)
        out = reward.compute_rm_score(rows)
        rows.meta_info.pop("extract_answers")
        if "answer" in out.non_tensor_batch:
            rows.non_tensor_batch["answer"] = out.non_tensor_batch["answer"]
        return out.batch["token_level_scores"].sum(-1).tolist()

    def on_greedy(name: str, rows: DataProto, scores: list[float]) -> None:
        answers[name].extend(rows.non_tensor_batch.get("answer", [None] * len(rows)))
        if name == "val/score":
            greedy.append(rows)
            if cost is not None:
                costs.extend(cost.compute_cost(rows).sum(-1).tolist())

    batch_size = config.data.val_batch_size or config.data.train_batch_size  # chunks with progress, never one
    results = score_passes(actor.generate_sequences, score, val_data, passes, batch_size,
                           config.trainer.seed, lambda name: f"validation ({labels[name]})", on_greedy)
    metrics: dict[str, float] = {}
    for name, (scores, sources) in results.items():
        metrics.update(summarise_scores(name, scores, sources))
    if kw.do_sample and kw.n >= 2:
        scores, sources = results[f"val/mean@{kw.n}"]
        metrics.update(sampled_metrics("val", scores, sources, answers[f"val/mean@{kw.n}"], kw.n, kw.pass_threshold))
    metrics.update(tool_metrics(greedy, "val"))
    if cost is not None:
        metrics["val/cost"] = float(np.mean(costs))
    return metrics


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
