"""DAPO dynamic sampling in the PPO driver's step (Yu et al. 2025, arXiv 2503.14476, sec. 3.2, eq. 11).

Generate and score a batch of prompts; drop the groups (a prompt's ``rollout.n`` responses) whose metric
(``algorithm.filter_groups.metric``) is the same for every response -- their group-relative advantage is 0 and
they give no gradient; keep generating from the next prompt batches until ``data.train_batch_size`` informative
groups are gathered (extra ones are dropped) or ``filter_groups.max_num_gen_batches`` batches were generated. At
the limit, ``filter_groups.on_limit=error`` stops with an error and ``train`` trains on the groups found.

The extra prompt batches come from the trainer's data cursor (:meth:`Driver.next_batch`), which counts every
batch consumed and is checkpointed, so a resumed run continues from the same prompt as the uninterrupted one.
Each extra batch is sampled with a seed of its own data position, so resumed sampling is identical too.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import torch

from hybridflow.algorithms import informative_groups
from hybridflow.protocol import DataProto
from hybridflow.trainer.steps import add_worker_time
from hybridflow.workers.timing import WORKER_SPAN_PREFIX, WORKER_TIME_PREFIX

logger = logging.getLogger(__name__)

EXTRA_BATCH_SEED_OFFSET = 10_000_000  # sampling-seed index of extra batch at data position p: offset + p


def filter_metric(batch: DataProto, metric: str) -> torch.Tensor:
    """(B,) per-response values of ``filter_groups.metric``: ``acc`` and ``score`` are the task score (the sum of
    ``token_level_scores`` minus the DAPO ``overlong_penalty`` when it was added), ``seq_reward`` the score with the
    overlong penalty (the sum of ``token_level_scores``).

    Raises:
        ValueError: an unknown metric name.
    """
    scores = batch.batch["token_level_scores"].sum(-1)
    if metric == "seq_reward":
        return scores
    if metric in ("acc", "score"):
        penalty = batch.batch.get("overlong_penalty")
        return scores if penalty is None else scores - penalty
    raise ValueError(f"algorithm.filter_groups.metric must be acc, score or seq_reward, got {metric!r}")


class _Gathered:
    """The informative groups found so far and the counts logged as ``dapo/*`` metrics."""

    def __init__(self) -> None:
        self.pieces: list[DataProto] = []
        self.metas: list[dict] = []
        self.groups = self.filtered = self.gen_batches = 0
        self.last: DataProto | None = None

    def add(self, batch: DataProto, uid: np.ndarray, values: torch.Tensor, n: int) -> None:
        keep = informative_groups(uid, values)
        self.gen_batches += 1
        self.metas.append(batch.meta_info)
        self.filtered += (len(batch) - int(keep.sum())) // n
        self.groups += int(keep.sum()) // n
        self.last = batch
        if keep.any():
            self.pieces.append(batch[keep])


def collect_informative_groups(trainer: Any, first: DataProto, t: dict[str, float]) -> tuple[DataProto, dict]:
    """Generate and score from ``first`` (a batch of prompts) and further batches until the batch holds
    ``data.train_batch_size`` informative groups (see the module docstring); returns the scored batch
    (``train_batch_size * n`` rows, groups in generation order) and the metrics ``dapo/gen_batches``,
    ``dapo/filtered_groups`` (groups dropped for equal metrics), ``dapo/informative_groups`` (found, including
    surplus ones) and ``dapo/trained_groups``. ``trainer`` is the :class:`~hybridflow.trainer.ppo.PPOTrainer`.

    Raises:
        RuntimeError: ``max_num_gen_batches`` reached with too few groups and ``on_limit=error``.
    """
    cfg = trainer.config
    fg = cfg.algorithm.filter_groups
    n, want = cfg.actor_rollout_ref.rollout.n, cfg.data.train_batch_size
    found, prompts = _Gathered(), first
    while True:
        seed_index = None if found.gen_batches == 0 else EXTRA_BATCH_SEED_OFFSET + trainer.data_position
        batch = trainer.generate_and_score(prompts, t, seed_index=seed_index)
        found.add(batch, batch.non_tensor_batch["uid"], filter_metric(batch, fg.metric), n)
        if found.groups >= want:
            break
        if 0 < fg.max_num_gen_batches <= found.gen_batches:
            message = (f"DAPO dynamic sampling: {found.groups} of the {want} groups data.train_batch_size asks for "
                       f"are informative (metric {fg.metric!r} not equal across the group) after "
                       f"algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches} generation batches")
            if fg.on_limit == "error":
                raise RuntimeError(message + "; raise max_num_gen_batches, set filter_groups.on_limit=train, or "
                                   "check that the rewards vary within a group")
            logger.warning("%s; training on those (filter_groups.on_limit=train)", message)
            break
        prompts = trainer.next_batch()
    batch = _training_batch(found, want, n, _divisor(trainer))
    metrics = {"dapo/gen_batches": float(found.gen_batches), "dapo/filtered_groups": float(found.filtered),
               "dapo/informative_groups": float(found.groups), "dapo/trained_groups": float(len(batch) // n)}
    return batch, metrics


def _divisor(trainer: Any) -> int:
    """Rows of a training batch must split evenly over the trained groups' ranks (dispatch would pad with
    duplicates otherwise, which the loss would count)."""
    groups = [g for g in (trainer.actor, trainer.critic) if g is not None]
    return math.lcm(*(int(getattr(g, "world_size", 1)) for g in groups)) if groups else 1


def _training_batch(found: _Gathered, want: int, n: int, divisor: int) -> DataProto:
    """The first ``want`` informative groups; short of them (``on_limit=train``) as many whole groups as split
    over ``divisor`` ranks, or, with none, the last generated batch as it is (its advantages are all 0)."""
    groups = min(found.groups, want)
    while groups and (groups * n) % divisor:
        groups -= 1
    if groups == 0:
        logger.warning("DAPO dynamic sampling found no usable informative group; training on the last generation "
                       "batch unfiltered (zero advantages: only KL/entropy terms move the policy)")
        batch = found.last
    else:
        batch = DataProto.concat(_same_prompt_width(found.pieces))[: groups * n]
    for key in [k for k in batch.meta_info if k.startswith((WORKER_TIME_PREFIX, WORKER_SPAN_PREFIX))]:
        del batch.meta_info[key]
    for meta in found.metas:  # worker seconds and spans of every generation batch, kept or not
        add_worker_time(batch.meta_info, meta)
    return batch


# rollout tensors whose width is prompt + response (P+R) or prompt only (P); left padding widens all of them
_PROMPT_AND_RESPONSE_KEYS = ("input_ids", "attention_mask", "position_ids")


def _same_prompt_width(pieces: list[DataProto]) -> list[DataProto]:
    """Left-pad the prompt part of every piece to the widest prompt (each prompt batch is padded only to its own
    longest prompt): ``prompts`` (N, P) and the ``(N, P+R)`` tensors get columns of attention 0, position 0 and
    the pad id found in the left padding (0 if no piece has any: a masked position's id is never read)."""
    width = max(p.batch["prompts"].shape[1] for p in pieces)
    pad_ids = [p.batch["prompts"][p.batch["attention_mask"][:, : p.batch["prompts"].shape[1]] == 0] for p in pieces]
    pad_id = next((int(ids[0]) for ids in pad_ids if ids.numel()), 0)
    out = []
    for piece in pieces:
        extra = width - piece.batch["prompts"].shape[1]
        if extra:
            piece = piece.select()  # a shallow copy: the generated batch is left as it was
            for key in ("prompts",) + _PROMPT_AND_RESPONSE_KEYS:
                value = pad_id if key in ("prompts", "input_ids") else 0
                tensor = piece.batch[key]
                piece.batch[key] = torch.cat([tensor.new_full((len(piece), extra), value), tensor], dim=1)
        out.append(piece)
    return out
