"""The 3D-HybridEngine reshards a Megatron expert-parallel layout (2 gloo ranks, dp=2, ep=2, a tiny Qwen3-MoE with
8 experts) into the generation layout:

* tp_g=2: each generation rank holds its 4 experts per layer (rows of HF ``gate_up_proj`` / ``down_proj``),
  half the heads and vocabulary, and the replicated norms and routers; no rank holds a full copy; the expert
  shards coincide with the EP shards, so they are used in place;
* tp_g=1: every rank gathers the other rank's experts (a full copy, as generation at tp_g=1 needs);
* each generation shard is the exact slice of the HF weights; the generation model's logits equal the HF model's
  (fp32, <= 1e-5);
* memory (counted by TensorMemoryTracker): peak extra bytes of a switch <= the plan's bound (generation shard not
  used in place + one bucket, itself <= model_bytes / tp_g + one bucket) + what the engine's shard iterator
  stages (Megatron keeps experts as separate tensors: the rank's own E/ep experts are stacked into the HF layout,
  and q/k/v are split out of the fused linear_qkv), which is at most the rank's own training shard of those.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from omegaconf import OmegaConf

pytest.importorskip("megatron.core")

from hybridflow.distributed.launch import spawn_ranks
from hybridflow.engine import HybridEngine, TensorMemoryTracker
from hybridflow.training import EngineSpec, ParallelLayout, get_engine_class
from tests.helpers.moe_models import tiny_moe

BUCKET = 1 << 14
IDS = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))


def _worker(rank: int, root: str) -> None:
    from megatron.core import parallel_state

    model_cfg = OmegaConf.create({"path": root, "dtype": "float32", "trust_remote_code": False,
                                  "enable_gradient_checkpointing": False})
    train = get_engine_class("megatron").build(EngineSpec(kind="policy", model=model_cfg, role="actor",
                                                          layout=ParallelLayout(dp=2, ep=2), device="cpu"))
    with TensorMemoryTracker() as staging:  # what the shard iterator materialises (stacked experts, fused qkv split)
        held = dict(train.iter_shards())
        staged = staging.live_bytes
    results = {"held": {k: tuple(v.shape) for k, v in held.items()}, "staged": staged,
               "expert_bytes": sum(v.numel() * 4 for k, v in held.items() if ".experts." in k),
               "qkv_bytes": sum(v.numel() * 4 for k, v in held.items() if k.endswith(("q_proj.weight",
                                                                                        "k_proj.weight",
                                                                                        "v_proj.weight")))}
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
    parallel_state.destroy_model_parallel()
    torch.save(results, os.path.join(root, f"res.{rank}"))


@pytest.mark.slow
def test_ep_layout_reshards_into_generation_shards(tmp_path) -> None:
    hf = tiny_moe(num_key_value_heads=2)  # kv heads split over tp_g=2
    hf.save_pretrained(str(tmp_path))
    full = {k: v.detach() for k, v in hf.named_parameters()}
    with torch.no_grad():
        want = hf(input_ids=IDS).logits
    spawn_ranks(_worker, str(tmp_path), world=2)
    for rank in range(2):
        res = torch.load(os.path.join(tmp_path, f"res.{rank}"), weights_only=False)
        # training: this rank holds its EP half of each expert tensor, everything else whole
        assert res["held"]["model.layers.0.mlp.experts.gate_up_proj"] == (4, 64, 64)
        for tp_g in (2, 1):
            out = res[tp_g]
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
            # the plan's bound: the new generation shard + one bucket; the engine's shard iterator adds its staged
            # copies (the rank's own EP half of the experts, stacked; q/k/v split out of the fused linear_qkv)
            assert out["plan_peak"] <= out["model_bytes"] / tp_g + BUCKET, (rank, tp_g)
            assert out["peak"] <= out["plan_peak"] + res["staged"], (rank, tp_g, out["peak"], out["plan_peak"])
        assert res["staged"] <= res["expert_bytes"] + res["qkv_bytes"], rank
        assert res["expert_bytes"] == sum(math.prod(full[k].shape) * 4 for k in full if ".experts." in k) // 2
