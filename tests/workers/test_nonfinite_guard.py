"""A NaN loss never reaches the weights: the step is skipped and counted, or stops with a clear error."""

import pytest
import torch
from omegaconf import OmegaConf

from helpers.models import tiny_model
from hybridflow.config.schema import ActorConfig
from hybridflow.algorithms.sampling import SamplingSpec
from hybridflow.protocol import DataProto
from hybridflow.workers.ppo_actor import PPOActor


def _actor(policy):
    model = tiny_model(seed=0, vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1)
    cfg = OmegaConf.structured(ActorConfig)
    cfg.ppo_micro_batch_size_per_gpu = 2
    return PPOActor(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cfg, SamplingSpec(), nonfinite_grad=policy)


def _batch():
    ids = torch.randint(0, 16, (2, 6))
    advantages = torch.ones(2, 3)
    advantages[0, 1] = float("nan")
    return DataProto.from_dict(tensors={
        "input_ids": ids, "responses": ids[:, 3:], "attention_mask": torch.ones(2, 6, dtype=torch.long),
        "position_ids": torch.arange(6).expand(2, -1), "response_mask": torch.ones(2, 3, dtype=torch.long),
        "old_log_probs": torch.zeros(2, 3), "advantages": advantages})


def test_nan_step_is_skipped_and_counted():
    actor = _actor("skip")
    before = {k: v.clone() for k, v in actor.module.state_dict().items()}
    metrics = actor.update_policy(_batch(), mini_batch_size=2)
    assert metrics["actor/skipped_steps"] == 1.0
    for k, v in actor.module.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_nan_step_can_stop_training():
    actor = _actor("error")
    before = {k: v.clone() for k, v in actor.module.state_dict().items()}
    with pytest.raises(FloatingPointError, match="actor gradient norm is nan"):
        actor.update_policy(_batch(), mini_batch_size=2)
    for k, v in actor.module.state_dict().items():
        assert torch.equal(v, before[k]), k
