"""The actor on an MoE policy: ``router_aux_loss_coef`` adds the router's load-balancing loss to the update (its
gradient is transformers' own ``aux_loss``'s, times the coefficient), the router metrics are logged, and
``router_replay`` decides whether the ``routed_experts`` column reaches the forwards."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from helpers.moe import P, R, padded_micro, tiny_moe
from hybridflow.algorithms.sampling import SamplingSpec
from hybridflow.config.schema import ActorConfig
from hybridflow.models.moe import ROUTING_KEY
from hybridflow.workers.ppo_actor import PPOActor

COEF = 0.5


def _actor(coef: float, replay: str = "off"):
    cfg = OmegaConf.structured(ActorConfig(router_aux_loss_coef=coef, router_replay=replay, grad_clip=1e9))
    cfg.ppo_micro_batch_size_per_gpu = 4
    model = tiny_moe()
    return PPOActor(model, torch.optim.SGD(model.parameters(), lr=1.0), cfg, SamplingSpec()), model


def test_aux_loss_coef_adds_transformers_load_balancing_gradient():
    actor, model = _actor(COEF)
    data = padded_micro()
    b = data.batch
    reference = tiny_moe()  # the same weights: HF's own aux loss and its gradient
    aux = reference(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"],
                    output_router_logits=True).aux_loss
    (COEF * aux).backward()
    data.batch["advantages"] = torch.zeros(4, R)  # the policy term has zero gradient: only the aux term moves
    data.batch["old_log_probs"] = actor.compute_log_prob(data, 4)[0]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    metrics = actor.update_policy(data, mini_batch_size=4)
    for name, p in reference.named_parameters():  # SGD, lr 1: the step is minus the gradient
        step = before[name] - dict(model.named_parameters())[name].detach()
        expected = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(step, expected, atol=1e-6, rtol=1e-4)
    assert abs(metrics["actor/router_aux_loss"] - aux.item()) < 1e-5
    assert metrics["actor/expert_load_max_min_ratio"] >= 1.0
    assert 1 / 8 <= metrics["actor/expert_load/layer0_max"] <= 1.0


@pytest.mark.parametrize("replay", ["off", "rollout"])
def test_router_replay_decides_whether_the_routing_is_replayed(replay):
    actor, _ = _actor(0.0, replay)
    data = padded_micro()
    own = _actor(0.0)[0].compute_log_prob(data, 4)[0]  # the same weights routing by their own top-k
    data.batch[ROUTING_KEY] = torch.zeros(4, P + R, 2, 2, dtype=torch.int16)
    data.batch[ROUTING_KEY][..., 1] = 7  # every token to experts 0 and 7
    got = actor.compute_log_prob(data, 4)[0]
    valid = data.batch["response_mask"].bool()
    moved = (got - own)[valid].abs().max().item()
    assert (moved == 0.0) if replay == "off" else (moved > 1e-3)


def test_replay_without_a_recorded_routing_is_refused_in_one_line():
    from hybridflow.training.routing_replay import MissingRoutingError

    with pytest.raises(MissingRoutingError, match="router_replay=rollout but the batch has no routed_experts column"):
        _actor(0.0, "rollout")[0].compute_log_prob(padded_micro(), 4)


def test_recompute_records_the_old_logprob_routing_and_the_update_replays_it():
    from hybridflow.models.moe import route
    from hybridflow.training import FSDP2Engine
    from hybridflow.training.routing_replay import routing_rectangle

    actor, model = _actor(0.0, "recompute")
    data = padded_micro()
    data.batch[ROUTING_KEY] = torch.zeros(4, P + R, 2, 2, dtype=torch.int16)  # a stale column: not replayed here
    data.batch[ROUTING_KEY][..., 1] = 7
    old = actor.compute_log_prob(data, 2, record_routing=True)[0]
    with route(model) as record:
        own = FSDP2Engine.from_module(model).forward(padded_micro())["log_probs"]
    valid = data.batch["response_mask"].bool()
    torch.testing.assert_close(old[valid], own[valid], rtol=0, atol=1e-6)
    expected = routing_rectangle(model, padded_micro(), "policy", False, record)
    seen = data.batch["attention_mask"].bool()
    assert torch.equal(actor.recorded_routing[seen], expected[seen])
    assert actor.compute_log_prob(data, 2)[0] is not None and actor.recorded_routing is None  # not asked
    # the update replays the column it is given (here: the stale one), unlike mode off
    grads = {}
    for mode in ("recompute", "off"):
        actor, model = _actor(0.0, mode)
        batch = padded_micro()
        batch.batch.update({ROUTING_KEY: data.batch[ROUTING_KEY], "advantages": torch.ones(4, R), "old_log_probs": old})
        before = model.lm_head.weight.detach().clone()
        actor.update_policy(batch, mini_batch_size=4)
        grads[mode] = before - model.lm_head.weight.detach()
    assert (grads["recompute"] - grads["off"]).abs().max() > 1e-6
