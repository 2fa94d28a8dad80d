"""One PPO actor update on a hand-made batch, shared by the actor's loss and metric tests.

The batch: ``B`` rows of ``P`` prompt and ``R`` response tokens of a tiny 1-layer model (vocabulary ``V``), row i's
response ``lengths[i]`` tokens long, micro-batches of 2 rows, one mini-batch; ``old_log_probs`` are the model's own
logprobs before the update and ``rollout_log_probs`` what the caller derives from them.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from omegaconf import OmegaConf

from helpers.models import tiny_model
from hybridflow.algorithms.sampling import SamplingSpec
from hybridflow.config.assemble import section_class
from hybridflow.protocol import DataProto
from hybridflow.workers.ppo_actor import PPOActor


def actor_update(lengths: torch.Tensor, advantages: torch.Tensor, rollout_from_old: Callable[[torch.Tensor], torch.Tensor],
                 prompt_len: int = 3, vocab_size: int = 32, **actor_keys: Any
                 ) -> tuple[dict[str, float], DataProto, torch.nn.Module]:
    """(the update's metrics, the batch it trained on, the updated model) for an actor built from ``actor_keys``.

    Args:
        lengths: (B,) long, each row's response length; R = ``lengths.max()``.
        advantages: (B, R) float32 advantages.
        rollout_from_old: maps ``old_log_probs`` (B, R) to the batch's ``rollout_log_probs``.
    """
    cfg = OmegaConf.structured(section_class("actor_rollout_ref.actor")(**actor_keys))
    cfg.ppo_micro_batch_size_per_gpu = 2
    rows, width = len(lengths), int(lengths.max())
    model = tiny_model(seed=0, vocab_size=vocab_size, num_hidden_layers=1)
    actor = PPOActor(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg, SamplingSpec())
    ids = torch.randint(1, vocab_size, (rows, prompt_len + width), generator=torch.Generator().manual_seed(1))
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    data = DataProto.from_dict(tensors={
        "input_ids": ids, "responses": ids[:, prompt_len:], "response_mask": mask,
        "attention_mask": torch.cat([torch.ones(rows, prompt_len, dtype=torch.long), mask], dim=1),
        "position_ids": torch.arange(prompt_len + width).expand(rows, -1).clone(), "advantages": advantages})
    old = actor.compute_log_prob(data, rows)[0]
    data.batch["old_log_probs"] = old
    data.batch["rollout_log_probs"] = rollout_from_old(old)
    return actor.update_policy(data, mini_batch_size=rows), data, model
