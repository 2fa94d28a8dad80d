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
  from the unforced forward's;
* the 3D-HybridEngine reshards the EP layout into generation layouts: tp_g=2 (each generation rank holds its 4
  experts per layer, half the heads and vocabulary, the norms and routers; no full copy; the expert shards
  coincide with the EP shards and are used in place) and tp_g=1 (each rank gathers the other's experts); every
  generation shard is the exact slice of the HF weights and the generation model's logits equal HF's (<= 1e-5);
  memory (TensorMemoryTracker): peak extra bytes of a switch <= the plan's bound (generation shard not used in
  place + one bucket, itself <= model_bytes / tp_g + one bucket) + what the shard iterator stages (Megatron keeps
  experts as separate tensors: the rank's own E/ep experts are stacked into the HF layout; q/k/v are split out of
  the fused linear_qkv), which is at most the rank's own training shard of those.

The model has 2 key/value heads (split over tp_g=2). One spawn of 2 ranks runs everything (the module fixture).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import transformers
from omegaconf import OmegaConf

pytest.importorskip("megatron.core")

from hybridflow.distributed.launch import spawn_ranks
from hybridflow.engine import HybridEngine, TensorMemoryTracker
from hybridflow.protocol import DataProto
from hybridflow.training import EngineSpec, ParallelLayout, get_engine_class
from tests.helpers.moe_models import tiny_moe
from tests.training.test_megatron_parity import P, _batch, _cfgs, _update

LAYOUT = ParallelLayout(dp=2, tp=1, pp=1, ep=2)
KV = dict(num_key_value_heads=2)
BUCKET = 1 << 14
IDS = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))


def _logits_ep1_equal_ep2(rank: int) -> dict:
    from megatron.core import parallel_state as ps

    from hybridflow.models.megatron_model import build_gpt_model, load_local_state, local_state_from_hf
    from hybridflow.training.megatron_cpu import cpu_adapter
    from hybridflow.training.megatron_setup import ep_rank_of, init_parallel_state

    hf = tiny_moe(**KV)
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


def _reshard(root: str, rank: int) -> dict:
    """A frozen EP engine switched to generation at tp_g=2 and 1: memory counts, logits, shards."""
    model_cfg = OmegaConf.create({"path": os.path.join(root, "actor"), "dtype": "float32", "trust_remote_code": False,
                                  "enable_gradient_checkpointing": False})
    train = get_engine_class("megatron").build(EngineSpec(kind="policy", model=model_cfg, role="actor",
                                                          layout=LAYOUT, device="cpu"))
    with TensorMemoryTracker() as staging:  # what the shard iterator materialises
        held = dict(train.iter_shards())
        staged = staging.live_bytes
    results = {"held": {k: tuple(v.shape) for k, v in held.items()}, "staged": staged,
               "expert_bytes": sum(v.numel() * 4 for k, v in held.items() if ".experts." in k),
               "qkv_bytes": sum(v.numel() * 4 for k, v in held.items()
                                if k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")))}
    del held
    for tp_g in (2, 1):
        engine = HybridEngine(train, gen_tp=tp_g, bucket_bytes=BUCKET)
        plan = engine.plan
        with TensorMemoryTracker() as mem:
            gen = engine.switch_to_generation()
        with torch.no_grad():
            logits = gen(input_ids=IDS).logits
        results[tp_g] = {"peak": mem.peak_bytes, "plan_peak": plan.peak_extra_bytes(rank, BUCKET),
                         "model_bytes": plan.model_bytes(), "gen_bytes": plan.gen_bytes(rank),
                         "tp_rank": engine.gen_tp_rank, "logits": logits,
                         "shards": {k: v.detach().clone() for k, v in gen.named_parameters()}}
        engine.switch_to_training()
    return results


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
    results["reshard"] = _reshard(root, rank)
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


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[str, list]:
    """(root, per-rank results) of one 2-rank spawn over the saved tiny MoE."""
    root = str(tmp_path_factory.mktemp("megatron_ep"))
    tiny_moe(**KV).save_pretrained(os.path.join(root, "actor"))
    spawn_ranks(_worker, root, world=2)
    return root, [torch.load(os.path.join(root, f"res.{r}"), weights_only=False) for r in range(2)]


@pytest.mark.slow
def test_ep2_logits_equal_ep1_and_hf(runs) -> None:
    for rank, res in enumerate(runs[1]):
        logits = res["logits"]
        assert (logits[1] - logits[2]).abs().max() <= 1e-5, rank
        assert (logits[2] - logits["hf"]).abs().max() <= 1e-5, rank


@pytest.mark.slow
def test_ep2_update_equals_fsdp2(runs) -> None:
    root, per_rank = runs
    ref_metrics, ref_out, ref_weights = _reference(os.path.join(root, "actor"))
    mask = _batch().batch["response_mask"].bool()
    for rank, res in enumerate(per_rank):
        metrics, out, weights = res["update"]
        assert abs(metrics["actor/pg_loss"] - ref_metrics["actor/pg_loss"]) <= 1e-5, rank
        assert abs(metrics["actor/grad_norm"] - ref_metrics["actor/grad_norm"]) <= 1e-5, rank
        rows = mask.chunk(2)[rank]
        assert (out[rows] - ref_out.chunk(2)[rank][rows]).abs().max() <= 1e-5, rank
        assert list(weights) == list(ref_weights)
        for name, want in ref_weights.items():
            assert (weights[name] - want).abs().max() <= 1e-4, (rank, name)


@pytest.mark.slow
def test_ep2_resumes_exactly_and_exports(runs) -> None:
    root, per_rank = runs
    assert all(res["resume"][0] for res in per_rank)
    _check_export(root, per_rank)


@pytest.mark.slow
def test_ep2_routing_replay(runs) -> None:
    _check_replay(*runs)


@pytest.mark.slow
def test_ep_layout_reshards_into_generation_shards(runs) -> None:
    root, per_rank = runs
    hf = tiny_moe(**KV)
    full = {k: v.detach() for k, v in hf.named_parameters()}
    with torch.no_grad():
        want = hf(input_ids=IDS).logits
    for rank, all_res in enumerate(per_rank):
        res = all_res["reshard"]
        assert res["held"]["model.layers.0.mlp.experts.gate_up_proj"] == (4, 64, 64)  # its EP half
        for tp_g in (2, 1):
            _check_generation(res[tp_g], full, want, tp_g, rank, res["staged"])
        assert res["staged"] <= res["expert_bytes"] + res["qkv_bytes"], rank
        assert res["expert_bytes"] == sum(math.prod(full[k].shape) * 4 for k in full if ".experts." in k) // 2


def _check_generation(out: dict, full: dict, want: torch.Tensor, tp_g: int, rank: int, staged: int) -> None:
    assert (out["logits"] - want).abs().max() <= 1e-5, (rank, tp_g)
    t = out["tp_rank"]
    for name, shard in out["shards"].items():
        expected = full[name]
        if tp_g == 2 and (name.endswith(("experts.gate_up_proj", "experts.down_proj", "q_proj.weight",
                                         "k_proj.weight", "v_proj.weight"))
                          or name in ("model.embed_tokens.weight", "lm_head.weight")):
            expected = expected.chunk(2, dim=0)[t]
        elif tp_g == 2 and name.endswith("o_proj.weight"):
            expected = expected.chunk(2, dim=1)[t]
        assert torch.equal(shard, expected), (rank, tp_g, name)
    held = sum(math.prod(s.shape) * 4 for s in out["shards"].values())
    assert held == out["gen_bytes"]
    assert (held < out["model_bytes"]) == (tp_g == 2)  # no full copy when tp_g > 1
    assert out["plan_peak"] <= out["model_bytes"] / tp_g + BUCKET, (rank, tp_g)
    assert out["peak"] <= out["plan_peak"] + staged, (rank, tp_g, out["peak"], out["plan_peak"])


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
    """Routers chose exactly the given experts; logprobs equal HF with forced routing, differ from free routing."""
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
