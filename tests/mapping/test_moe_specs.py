"""The auto-mapper's model shape of a mixture-of-experts model: memory counts every parameter, compute only the
experts a token runs (read from the shipped tiny-moe's config.json, checked against the loaded model)."""

import torch

from hybridflow.mapping.cost import forward_flops, train_flops
from hybridflow.mapping.specs import get_model
from hybridflow.models.hf import load_causal_lm


def test_tiny_moe_total_and_active_parameters():
    spec = get_model("builtin:tiny-moe")
    assert (spec.experts, spec.experts_per_token, spec.moe_intermediate) == (8, 2, 48)
    model = load_causal_lm("builtin:tiny-moe", torch.float32)
    # the spec has no q/k norms (Qwen3's per-head RMSNorms: 2 x head_dim per layer)
    qk_norms = spec.layers * 2 * spec.head_dim
    assert spec.n_params == sum(p.numel() for p in model.parameters()) - qk_norms
    idle = spec.layers * (8 - 2) * 3 * spec.hidden * 48  # the 6 experts a token does not run, per layer
    assert spec.n_active_params == spec.n_params - idle
    assert train_flops(spec, 10) == 6 * spec.n_active_params * 10
    assert forward_flops(spec, 10) == 2 * spec.n_active_params * 10
    dense = get_model("tiny-arith")  # a dense model: active = total
    assert dense.n_active_params == dense.n_params
