"""benchmarks/lora_vs_full.py: one small in-process run of each variant; the counts it reports are checked against
the architecture (LoRA on a Linear (in -> out) adds r * (in + out) parameters) and AdamW's two moments per param."""


import pytest
import torch

pytest.importorskip("peft")

from hybridflow.models.hf import load_causal_lm  # noqa: E402


def test_counts_match_the_architecture(repo_script):
    bench = repo_script("benchmarks/lora_vs_full.py")
    base = load_causal_lm("builtin:tiny-arith", torch.float32)
    rank = 4
    expected = sum(rank * (m.in_features + m.out_features) for n, m in base.named_modules()
                   if isinstance(m, torch.nn.Linear) and n != "lm_head")
    lora = bench.run_variant("builtin:tiny-arith", rank, batch=2, steps=1)
    full = bench.run_variant("builtin:tiny-arith", 0, batch=2, steps=1)
    assert lora["trainable_params"] == expected
    assert full["trainable_params"] == sum(p.numel() for p in base.parameters())  # unique (tied counted once)
    for row in (lora, full):  # exp_avg + exp_avg_sq fp32 per trainable parameter (+ one scalar step per param)
        assert row["optimizer_state_bytes"] >= 8 * row["trainable_params"]
        assert row["optimizer_state_bytes"] < 8 * row["trainable_params"] + 8 * 1000
