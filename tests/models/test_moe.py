"""Mixture-of-experts forwards in one process: the router's load-balancing loss against a hand computation and
against transformers' own ``aux_loss``, expert-load fractions, a value model on an MoE backbone, and routing replay
(a forward replaying a perturbed model's routing routes exactly as it did; the routing column survives DataProto's
splits, repeats and concatenation bit for bit)."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from helpers.moe import P, R, padded_micro, tiny_moe
from hybridflow.models.moe import RoutingShapeError, expert_load, load_balancing_loss, route, routers
from hybridflow.protocol import DataProto
from hybridflow.training import FSDP2Engine
from hybridflow.training.routing_replay import ROUTING_KEY, replay_view, routing_rectangle


def test_load_balancing_loss_equals_a_hand_computation():
    # 2 layers, 3 tokens, 4 experts, top-2; the last token is padding
    logits = [torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 0.5], [5.0, 0.0, 0.0, 4.0]]),
              torch.tensor([[0.0, 0.0, 1.0, 2.0], [1.0, -1.0, 2.0, 0.0], [0.0, 9.0, 9.5, 0.0]])]
    mask = torch.tensor([1, 1, 0])
    counts, probs, tokens = [0.0] * 4, [0.0] * 4, 0
    for layer in logits:
        for row, valid in zip(layer.tolist(), mask.tolist()):
            if not valid:
                continue
            z = sum(math.exp(x) for x in row)
            p = [math.exp(x) / z for x in row]
            for e in sorted(range(4), key=lambda e: -p[e])[:2]:
                counts[e] += 1
            probs = [a + b for a, b in zip(probs, p)]
            tokens += 1
    expected = 4 * sum((c / tokens) * (q / tokens) for c, q in zip(counts, probs))
    got = load_balancing_loss(logits, top_k=2, mask=mask)
    assert abs(float(got) - expected) < 1e-6
    uniform = load_balancing_loss([torch.zeros(5, 4)], top_k=2)  # f_e sums to k, P_e = 1/E: loss = k
    assert abs(float(uniform) - 2.0) < 1e-6


def test_expert_load_counts_routed_assignments():
    indices = torch.tensor([[0, 1], [0, 2], [3, 0]])
    torch.testing.assert_close(expert_load(indices, 4), torch.tensor([3 / 6, 1 / 6, 1 / 6, 1 / 6]))
    torch.testing.assert_close(expert_load(indices, 4, torch.tensor([1, 1, 0])), torch.tensor([0.5, 0.25, 0.25, 0.0]))


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
@pytest.mark.parametrize("remove_padding", [False, True])
def test_engine_aux_loss_equals_transformers(arch, remove_padding):
    model = tiny_moe(arch)
    micro = padded_micro()
    b = micro.batch
    expected = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"],
                     output_router_logits=True).aux_loss
    engine = FSDP2Engine.from_module(model, remove_padding=remove_padding)
    out = engine.forward(micro)
    assert abs(out["router_aux_loss"].item() - expected.item()) < 1e-5
    assert out["expert_load"].shape == (2, 8)
    torch.testing.assert_close(out["expert_load"].sum(1), torch.ones(2))
    out["router_aux_loss"].backward()  # differentiable: reaches every router
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers(model))


def test_value_model_on_an_moe_backbone_trains():
    model = tiny_moe("qwen3_moe", transformers.Qwen3MoeForTokenClassification, num_labels=1)
    engine = FSDP2Engine.from_module(model, torch.optim.AdamW(model.parameters(), lr=1e-2), kind="value")
    micro = padded_micro()
    engine.zero_grad()
    engine.forward_backward(micro, lambda o: (o["values"] ** 2).mean() + 0.01 * o["router_aux_loss"])
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    assert experts and all(p.grad is not None and torch.isfinite(p.grad).all() for p in experts)
    before = engine.forward(micro)["values"].detach()
    engine.optimizer_step()
    assert (engine.forward(micro)["values"] - before).abs().max() > 0


def _perturbed(model: torch.nn.Module, scale: float = 0.5) -> torch.nn.Module:
    other = tiny_moe("qwen3_moe")
    other.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for r in routers(other):
            r.weight.add_(scale * torch.randn(r.weight.shape, generator=gen))
    return other


@pytest.mark.parametrize("remove_padding", [False, True])
def test_replayed_routing_reproduces_the_recorded_one(remove_padding):
    model = tiny_moe("qwen3_moe")
    perturbed = _perturbed(model)
    micro = padded_micro(rows=6)
    source = FSDP2Engine.from_module(perturbed, remove_padding=remove_padding)
    with route(perturbed) as record:  # the perturbed model's own routing (its forward, this engine's layout)
        source.forward(micro)
    recorded = routing_rectangle(perturbed, micro, "policy", remove_padding, record)
    assert recorded.dtype == torch.int16 and recorded.shape == (6, P + R, 2, 2)
    engine = FSDP2Engine.from_module(model, remove_padding=remove_padding)
    with route(model) as plain:
        own = engine.forward(micro)["log_probs"]
    mine = routing_rectangle(model, micro, "policy", remove_padding, plain)
    valid = micro.batch["attention_mask"].bool()
    assert (mine[valid] != recorded[valid]).any()  # the perturbation changed some routing
    micro.batch[ROUTING_KEY] = recorded
    with route(model) as replayed:
        replay = engine.forward(micro)["log_probs"]
    got = routing_rectangle(model, micro, "policy", remove_padding, replayed)
    assert torch.equal(got[valid], recorded[valid])
    assert (replay - own).abs().max() > 1e-4  # the replayed experts changed the outputs
    assert ROUTING_KEY not in replay_view(micro, "off").batch.keys() and ROUTING_KEY in micro.batch.keys()


def test_replay_with_the_wrong_layer_count_fails_clearly():
    model = tiny_moe("qwen3_moe")
    micro = padded_micro()
    micro.batch[ROUTING_KEY] = torch.zeros(4, P + R, 3, 2, dtype=torch.int16)
    with pytest.raises(RoutingShapeError, match="3 layers, the model has 2"):
        FSDP2Engine.from_module(model).forward(micro)


def test_routing_round_trips_through_dataproto_exactly():
    gen = torch.Generator().manual_seed(0)
    routing = torch.randint(0, 128, (6, P + R, 4, 2), generator=gen).to(torch.int16)
    data = padded_micro(rows=6)
    data.batch[ROUTING_KEY] = routing
    data = data.repeat(2, interleave=True)
    assert torch.equal(data.batch[ROUTING_KEY], routing.repeat_interleave(2, dim=0))
    parts = data.chunk(3)
    whole = DataProto.concat([p for p in parts])
    assert torch.equal(whole.batch[ROUTING_KEY][::2], routing)
    order = torch.randperm(12, generator=gen)
    assert torch.equal(whole[order].batch[ROUTING_KEY], whole.batch[ROUTING_KEY][order])
    assert whole.batch[ROUTING_KEY].dtype == torch.int16
