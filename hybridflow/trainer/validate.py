"""Validation: greedy (or ``rollout.val_kwargs``) generation on held-out prompts, scored by the reward group."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from hybridflow.protocol import DataProto


def validate(config, actor, reward, val_data: DataProto) -> dict[str, float]:
    """Mean score over ``val_data`` as ``val/score`` plus ``val/score/<data_source>`` per source.

    With ``val_kwargs.n > 1`` the score is mean@n (the average over n samples per prompt).
    """
    kw = config.actor_rollout_ref.rollout.val_kwargs
    batch_size = config.data.val_batch_size or len(val_data)
    scores: list[float] = []
    sources: list[str] = []
    for chunk in val_data.split(batch_size):
        prompts = chunk.select(["input_ids", "attention_mask", "position_ids"])
        prompts.meta_info.update(do_sample=kw.do_sample, temperature=kw.temperature, top_p=kw.top_p,
                                 top_k=kw.top_k, n=kw.n, seed=config.trainer.seed)
        gen = actor.generate_sequences(prompts)
        rows = chunk.repeat(kw.n, interleave=True)
        rows = DataProto(batch=gen.batch, non_tensor_batch=rows.non_tensor_batch)
        seq_scores = reward.compute_rm_score(rows).batch["token_level_scores"].sum(-1)
        scores.extend(seq_scores.tolist())
        sources.extend(rows.non_tensor_batch["data_source"].tolist())
    by_source: dict[str, list[float]] = defaultdict(list)
    for source, score in zip(sources, scores):
        by_source[source].append(score)
    metrics = {"val/score": float(np.mean(scores))}
    metrics.update({f"val/score/{src}": float(np.mean(v)) for src, v in by_source.items()})
    return metrics
