"""A NaN loss never reaches the weights: the step is skipped and counted, or stops with a clear error; a skipped
step does not advance the lr schedule."""

import pytest
import torch
from omegaconf import OmegaConf

from helpers.models import tiny_model
from hybridflow.config.schema import ActorConfig, OptimConfig
from hybridflow.algorithms.sampling import SamplingSpec
from hybridflow.protocol import DataProto
from hybridflow.training import FSDP2Engine
from hybridflow.training.optim import build_lr_scheduler, build_optimizer
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


def _scheduled_actor(lr: float, warmup: int) -> PPOActor:
    """An actor whose engine owns a linear-warmup schedule of ``warmup`` steps (constant after it) to ``lr``."""
    model = tiny_model(seed=0, vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1)
    optim = OmegaConf.structured(OptimConfig)
    optim.lr, optim.lr_warmup_steps = lr, warmup
    optimizer = build_optimizer(model, optim)
    engine = FSDP2Engine.from_module(model, optimizer, lr_scheduler=build_lr_scheduler(optimizer, optim, 10))
    cfg = OmegaConf.structured(ActorConfig)
    cfg.ppo_micro_batch_size_per_gpu = 2
    return PPOActor(engine, None, cfg, SamplingSpec())


def _train_step(actor: PPOActor, batch: DataProto) -> float:
    """One training step as the actor worker runs it: the update, then the schedule; the lr the step used."""
    actor.update_policy(batch, mini_batch_size=2)
    return actor.engine.lr_scheduler_step()


def test_skipped_steps_leave_the_lr_schedule_and_applied_ones_advance_it():
    lr, warmup = 0.03, 2
    actor = _scheduled_actor(lr, warmup)
    good = _batch()
    good.batch["advantages"] = torch.ones(2, 3)
    # every update skipped (NaN advantage): the lr stays the first warmup value lr * 1 / (W + 1)
    for _ in range(3):
        assert _train_step(actor, _batch()) == pytest.approx(lr / 3)
    assert actor.skipped_steps == 3
    assert actor.optimizer.param_groups[0]["lr"] == pytest.approx(lr / 3)
    # applied updates walk the warmup ramp: update k uses lr * k / (W + 1), update W + 1 the full lr
    assert [_train_step(actor, good) for _ in range(4)] == pytest.approx([lr / 3, 2 * lr / 3, lr, lr])
    # a step with an update skipped after applied ones leaves it too; the checkpointed state counts 4 updates
    assert _train_step(actor, _batch()) == pytest.approx(lr)
    state = actor.engine.lr_scheduler.state_dict()
    assert state["last_epoch"] == 4
    resumed = _scheduled_actor(lr, warmup)
    resumed.engine.lr_scheduler.load_state_dict(state)
    assert resumed.engine.lr_scheduler.get_last_lr()[0] == pytest.approx(lr)
