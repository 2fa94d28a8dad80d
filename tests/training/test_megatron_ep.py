"""Megatron expert parallelism on 2 gloo ranks with a tiny Qwen3-MoE (8 experts, top-2):

* the CPU adapter's MoE shims let the all-to-all dispatcher run: GPTModel logits at EP=2 equal EP=1's and the HF
  model's (fp32, <= 1e-5);
* the engine at (dp=2, ep=2) against the fsdp2 engine over the plain HF model (one process, the whole batch): one
  PPO actor update gives the same loss, grad norm and post-update logprobs (<= 1e-5), and the gathered weights
  equal the reference's (<= 1e-4: AdamW's first step amplifies summation-order noise on near-zero gradients);
* exact resume: 2 updates, save, 2 more == a fresh engine loaded from the save + 2 updates (bit-identical);
* ``hybridflow export`` of the EP checkpoint is an HF directory transformers loads, whose logprobs equal the
  engine's at the save;
* routing replay (``router_replay=rollout``): given a random routing as the ``routed_experts`` column (int16,
  (B, L, layers, top_k)), every Megatron router picks exactly those experts for every attended token, and the
  logprobs equal the HF model's forward with its routers forced to the same experts (<= 1e-5), while they differ
  from the unforced forward's.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import transformers
from omegaconf import OmegaConf

pytest.importorskip("megatron.core")

from hybridflow.distributed.launch import spawn_ranks
from hybridflow.protocol import DataProto
from hybridflow.training import EngineSpec, ParallelLayout, get_engine_class
from tests.helpers.moe_models import tiny_moe
from tests.training.test_megatron_parity import P, _batch, _cfgs, _update

LAYOUT = ParallelLayout(dp=2, tp=1, pp=1, ep=2)


def _logits_ep1_equal_ep2(rank: int) -> dict:
    from megatron.core import parallel_state as ps

    from hybridflow.models.megatron_model import build_gpt_model, load_local_state, local_state_from_hf
    from hybridflow.training.megatron_cpu import cpu_adapter
    from hybridflow.training.megatron_setup import ep_rank_of, init_parallel_state

    hf = tiny_moe()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))[rank:rank + 1]
    out = {"hf": hf(input_ids=ids).logits.detach()}
    for ep in (1, 2):
        layout = ParallelLayout(dp=2, ep=ep)
        init_parallel_state(layout, 0, "cpu")
        assert ps.get_expert_model_parallel_rank() == ep_rank_of(layout, rank)
        with cpu_adapter("cpu"), torch.no_grad():
            mg = build_gpt_model(hf.config, "policy", tp=1, pp=1, pp_rank=0, dtype=torch.float32, device="cpu",
                                 ep=ep)
            load_local_state(mg, local_state_from_hf(dict(hf.named_parameters()), hf.config, "policy", tp=1,
                                                     tp_rank=0, pp=1, pp_rank=0, ep=ep,
                                                     ep_rank=ep_rank_of(layout, rank)))
            assert len(mg.decoder.layers[0].mlp.experts.local_experts) == 8 // ep
            out[ep] = mg.eval()(ids, torch.arange(7)[None], None)
        ps.destroy_model_parallel()
    return out


def _engine(root: str):
    _, _, optim = _cfgs()
    model_cfg = OmegaConf.create({"path": os.path.join(root, "actor"), "dtype": "float32", "trust_remote_code": False,
                                  "enable_gradient_checkpointing": False})
    return get_engine_class("megatron").build(EngineSpec(
        kind="policy", model=model_cfg, layout=LAYOUT, device="cpu", optim=optim, total_steps=8, grad_clip=1.0,
        role="actor"))


def _resume(root: str, data: DataProto) -> tuple[bool, torch.Tensor]:
    """(2 + 2 updates == save after 2, load into a fresh engine, 2 updates: bit-identical; logprobs at the save)."""
    engine = _engine(root)
    for _ in range(2):
        _, saved_logprobs = _update("actor", engine, data)
    ckpt = os.path.join(root, "ckpt", "actor")
    engine.save_checkpoint(ckpt, extra={"step": 2})
    if dist.get_rank() == 0:  # what the actor worker adds for `hybridflow export`
        from hybridflow.models.hf import load_tokenizer

        engine.module.config.save_pretrained(os.path.join(ckpt, "hf"))
        load_tokenizer("builtin:tiny-arith").save_pretrained(os.path.join(ckpt, "hf"))
    for _ in range(2):
        _update("actor", engine, data)
    four = [v.clone() for _, v in engine.iter_shards()]
    fresh = _engine(root)
    assert fresh.load_checkpoint(ckpt) == {"step": 2}
    for _ in range(2):
        _update("actor", fresh, data)
    exact = all(torch.equal(a, b) for a, (_, b) in zip(four, fresh.iter_shards()))
    return exact, saved_logprobs


def _routing() -> torch.Tensor:
    """A random routing of the test batch: (B, L, layers, top_k) int16, distinct experts per token and layer."""
    g = torch.Generator().manual_seed(7)
    b, length = _batch().batch["input_ids"].shape
    return torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(b * length * 2)]).view(
        b, length, 2, 2).to(torch.int16)


def _replay(root: str, data: DataProto, rank: int) -> dict:
    """Frozen engine with router_replay=rollout: logprobs with / without the column, and each router's chosen
    expert sets (aligned tokens, Megatron order) with the column."""
    from hybridflow.training.megatron_pipeline import aligned_order

    model_cfg = OmegaConf.create({"path": os.path.join(root, "actor"), "dtype": "float32", "trust_remote_code": False,
                                  "enable_gradient_checkpointing": False})
    engine = get_engine_class("megatron").build(EngineSpec(kind="policy", model=model_cfg, layout=LAYOUT,
                                                           device="cpu", role="actor", router_replay="rollout"))
    chosen = []
    routers = [m for m in engine.gpt.modules() if type(m).__name__ == "TopKRouter"]
    hooks = [r.register_forward_hook(lambda mod, inp, out: chosen.append(out[1].clone())) for r in routers]
    routed = _routing().chunk(2)[rank]
    with_column = DataProto.from_dict(tensors={**data.batch, "routed_experts": routed})
    forced = engine.forward(with_column)["log_probs"]
    for hook in hooks:
        hook.remove()
    free = engine.forward(data)["log_probs"]
    order, attended = aligned_order(with_column)
    want = []
    for layer in range(2):
        idx = torch.gather(routed.long()[:, :, layer], 1, order[:, :, None].expand(-1, -1, 2))  # (B, S, k)
        want.append((idx.transpose(0, 1).reshape(-1, 2), attended.transpose(0, 1).reshape(-1)))
    return {"forced": forced, "free": free, "chosen": chosen, "want": want}


def _worker(rank: int, root: str) -> None:
    from megatron.core import parallel_state

    results = {"logits": _logits_ep1_equal_ep2(rank)}
    data = _batch().chunk(LAYOUT.dp)[LAYOUT.coords(rank)[0]]
    engine = _engine(root)
    metrics, out = _update("actor", engine, data)
    results["update"] = (metrics, out, {k: v.clone() for k, v in engine.iter_weights()})
    del engine
    results["resume"] = _resume(root, data)
    results["replay"] = _replay(root, data, rank)
    parallel_state.destroy_model_parallel()
    torch.save(results, os.path.join(root, f"res.{rank}"))


def _reference(path: str) -> tuple[dict, torch.Tensor, dict]:
    """The fsdp2 engine over the plain HF MoE module (one process, the whole batch)."""
    from hybridflow.models import hf
    from hybridflow.training import FSDP2Engine
    from hybridflow.training.optim import build_lr_scheduler, build_optimizer

    model = hf.load_causal_lm(path, torch.float32)
    _, _, optim = _cfgs()
    opt = build_optimizer(model, optim)
    engine = FSDP2Engine.from_module(model, opt, kind="policy", grad_clip=1.0,
                                     lr_scheduler=build_lr_scheduler(opt, optim, 1), role="actor")
    metrics, out = _update("actor", engine, _batch())
    return metrics, out, {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.slow
def test_megatron_ep2_equals_ep1_and_fsdp2_and_resumes_exactly(tmp_path) -> None:
    root = str(tmp_path)
    tiny_moe().save_pretrained(os.path.join(root, "actor"))
    ref_metrics, ref_out, ref_weights = _reference(os.path.join(root, "actor"))
    spawn_ranks(_worker, root, world=2)
    per_rank = [torch.load(os.path.join(root, f"res.{r}"), weights_only=False) for r in range(2)]
    mask = _batch().batch["response_mask"].bool()
    for rank, res in enumerate(per_rank):
        logits = res["logits"]
        assert (logits[1] - logits[2]).abs().max() <= 1e-5, rank
        assert (logits[2] - logits["hf"]).abs().max() <= 1e-5, rank
        metrics, out, weights = res["update"]
        assert abs(metrics["actor/pg_loss"] - ref_metrics["actor/pg_loss"]) <= 1e-5, rank
        assert abs(metrics["actor/grad_norm"] - ref_metrics["actor/grad_norm"]) <= 1e-5, rank
        rows = mask.chunk(2)[rank]
        assert (out[rows] - ref_out.chunk(2)[rank][rows]).abs().max() <= 1e-5, rank
        assert list(weights) == list(ref_weights)
        for name, want in ref_weights.items():
            assert (weights[name] - want).abs().max() <= 1e-4, (rank, name)
        assert res["resume"][0], rank
    _check_export(root, per_rank)
    _check_replay(root, per_rank)


def _forced_hf_logprobs(path: str, routed: torch.Tensor) -> torch.Tensor:
    """HF forward of the test batch with each layer's router forced to ``routed`` (gates: the router's softmax
    at those experts, renormalised: norm_topk_prob), response logprobs (B, R)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for layer, block in enumerate(model.model.layers):
        router = block.mlp.gate

        def forced(hidden, router=router, layer=layer):
            logits = torch.nn.functional.linear(hidden.reshape(-1, router.hidden_dim), router.weight)
            index = routed[:, :, layer].reshape(-1, 2).long()
            gates = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, index)
            return logits, (gates / gates.sum(-1, keepdim=True)).to(logits.dtype), index

        router.forward = forced
    b = _batch().batch
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"]).logits[:, P - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, b["responses"][..., None]).squeeze(-1)


def _check_replay(root: str, per_rank: list) -> None:
    want = _forced_hf_logprobs(os.path.join(root, "actor"), _routing())
    mask = _batch().batch["response_mask"].bool()
    for rank, res in enumerate(per_rank):
        replay = res["replay"]
        assert len(replay["chosen"]) == 2, rank  # one router per layer, one forward
        for routing_map, (index, attended) in zip(replay["chosen"], replay["want"]):
            expected = torch.zeros_like(routing_map).scatter_(1, index, True)
            assert torch.equal(routing_map[attended], expected[attended]), rank
        rows = mask.chunk(2)[rank]
        assert (replay["forced"][rows] - want.chunk(2)[rank][rows]).abs().max() <= 1e-5, rank
        assert (replay["free"][rows] - replay["forced"][rows]).abs().max() > 1e-3, rank


def _check_export(root: str, per_rank: list) -> None:
    from hybridflow.models.export import export_checkpoint

    out = export_checkpoint(os.path.join(root, "ckpt"), os.path.join(root, "exported"))
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    b = _batch().batch
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"]).logits[:, P - 1:-1]
    logprobs = torch.log_softmax(logits.float(), -1).gather(-1, b["responses"][..., None]).squeeze(-1)
    mask = b["response_mask"].bool()
    for rank, res in enumerate(per_rank):
        rows = mask.chunk(2)[rank]
        assert (res["resume"][1][rows] - logprobs.chunk(2)[rank][rows]).abs().max() <= 1e-5, rank
