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


def test_qwen3_30b_a3b_preset_has_the_published_sizes_and_plans_on_16_to_64_gpus():
    from hybridflow.mapping.presets import get_cost_preset
    from hybridflow.mapping.search import search
    from hybridflow.mapping.specs import Workload, parse_cluster

    spec = get_model("qwen3-30b-a3b")
    assert abs(spec.n_params / 30.5e9 - 1) < 0.01 and abs(spec.n_active_params / 3.3e9 - 1) < 0.03  # model card
    work = Workload(algorithm="grpo", batch=512, n=8, prompt_len=1024, response_len=2048)
    seconds = {}
    for cluster in ("2x8:H100", "8x8:H100"):
        result = search({"actor": spec, "reference": spec, "reward": None}, work, parse_cluster(cluster),
                        get_cost_preset("a100-paper"))
        assert result.best is not None, cluster
        seconds[cluster] = result.best.seconds
    assert seconds["8x8:H100"] < seconds["2x8:H100"]
    # compute follows the active parameters: the same shapes as a dense model of 30.5B train ~9x slower per token
    assert train_flops(get_model("qwen3-30b-a3b"), 1) * 9 < 6 * spec.n_params
