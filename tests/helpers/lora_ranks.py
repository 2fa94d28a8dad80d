"""The 2-rank LoRA actor-worker setup shared by tests/workers/test_lora_worker.py (hf rollout) and
test_lora_vllm.py (vllm rollout): the config, the prompts and the training batch those tests drive the real
``ActorRolloutRefWorker`` with, rank by rank (launched with :func:`hybridflow.distributed.launch.spawn_ranks`)."""

from __future__ import annotations

import torch

from hybridflow.config import load_config
from hybridflow.protocol import DataProto

B, P, R, WORLD = 4, 6, 6, 2  # prompts, prompt length, response length, ranks
RESPONSE_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


def lora_config(sync: str, *overrides: str):
    """The default recipe with rank-8 LoRA (alpha 16) on the actor, ``lora_sync=sync``, greedy generation, B
    prompts in 2 micro-batches, lr 0.05 (one update moves the policy visibly); ``overrides`` come last."""
    return load_config(None, [
        "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
        f"actor_rollout_ref.rollout.lora_sync={sync}", "actor_rollout_ref.rollout.do_sample=false",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.optim.lr=0.05", f"data.max_prompt_length={P}", f"data.max_response_length={R}",
        *overrides,
    ])


def prompts() -> DataProto:
    """B fixed random prompts (int64 (B, P) ids in [3, 40)), the first one left-padded by 2."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 40, (B, P), generator=g)
    mask = torch.ones(B, P, dtype=torch.long)
    mask[0, :2] = 0  # one left-padded row
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask,
                                        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)})


def response_batch(gen: DataProto) -> DataProto:
    """The sequences of a generation output (:data:`RESPONSE_KEYS`, no logprobs) as a new batch."""
    return DataProto.from_dict(tensors={k: gen.batch[k] for k in RESPONSE_KEYS})


def train_batch(worker, gen: DataProto, step: int) -> DataProto:
    """An actor update batch from ``gen``: the worker's old logprobs and fixed advantages (B, R) fp32 rising
    linearly from -5 (row 0) to 5 (row B - 1), at ``meta_info["global_step"] = step``."""
    batch = response_batch(gen)
    batch.union(worker.compute_log_prob(batch))
    batch.batch["advantages"] = torch.linspace(-1, 1, B)[:, None].expand(B, R).clone() * 5
    batch.meta_info["global_step"] = step
    return batch
