"""An MoE policy (tiny Qwen3-MoE, 8 experts top-2) under FSDP2 on 2 gloo ranks: every decoder block is an FSDP unit,
so the stacked expert weights (E, ., .) are sharded over the experts' dim (4 experts per rank); the gradients of the
policy loss plus the router's load-balancing term equal those of one process computing the same per-rank losses
(compared before any optimizer step: Adam's first step would amplify float noise on near-zero gradients)."""

from __future__ import annotations

import os

import torch
from torch.distributed.tensor import DTensor, Shard

from helpers.moe import padded_micro, tiny_moe
from hybridflow.distributed import apply_fsdp2, build_mesh
from hybridflow.distributed.launch import spawn_ranks
from hybridflow.training import FSDP2Engine

AUX = 0.3  # weight of the load-balancing term in the test loss


def _loss(out: dict, micro) -> torch.Tensor:
    mask = micro.batch["response_mask"]
    return -(out["log_probs"] * mask).sum() / mask.sum() + AUX * out["router_aux_loss"]


def _rank(rank: int, out: str) -> None:
    model = apply_fsdp2(tiny_moe(), build_mesh(dp=2))
    engine = FSDP2Engine.from_module(model, torch.optim.AdamW(model.parameters()), mesh=build_mesh(dp=2))
    micro = padded_micro(rows=8)[rank * 4:(rank + 1) * 4]
    engine.zero_grad()
    engine.forward_backward(micro, lambda o: _loss(o, micro))
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"grads": grads, "local_experts": experts.to_local().shape[0],
                    "placements": experts.placements if isinstance(experts, DTensor) else None},
                   os.path.join(out, "result.pt"))


def test_fsdp2_moe_gradients_equal_one_process(tmp_path):
    spawn_ranks(_rank, str(tmp_path))
    res = torch.load(tmp_path / "result.pt", weights_only=False)
    assert res["placements"] == (Shard(0),) and res["local_experts"] == 4  # 8 experts, 4 per rank
    model = tiny_moe()
    batch = padded_micro(rows=8)
    # FSDP2 averages the ranks' gradients: the reference is the mean of the two ranks' losses
    loss = sum(_loss(FSDP2Engine.from_module(model).forward(batch[i:i + 4]), batch[i:i + 4]) for i in (0, 4)) / 2
    loss.backward()
    worst = max((res["grads"][n] - p.grad).abs().max().item() for n, p in model.named_parameters())
    assert set(res["grads"]) == {n for n, _ in model.named_parameters()}
    print(f"max abs gradient diff fsdp2 dp=2 vs one process: {worst:.2e}")
    assert worst <= 1e-5
    router_grad = model.model.layers[0].mlp.gate.weight.grad
    assert router_grad.abs().max() > 1e-4  # the aux term and the policy loss reach the router
