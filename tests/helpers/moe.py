"""Tiny mixture-of-experts models and micro-batches for the MoE tests (random init, fp32, no downloads)."""

from __future__ import annotations

import torch
import transformers

from helpers.models import tiny_model
from hybridflow.protocol import DataProto

V, P, R = 64, 5, 4  # vocabulary, prompt width, response width

# per architecture: its causal-LM class and the config keys that make it 8 experts, top-2
ARCHITECTURES = {
    "qwen3_moe": (transformers.Qwen3MoeForCausalLM, dict(num_experts=8, moe_intermediate_size=32, head_dim=32)),
    "qwen2_moe": (transformers.Qwen2MoeForCausalLM, dict(num_experts=8, moe_intermediate_size=32,
                                                         shared_expert_intermediate_size=32)),
    "mixtral": (transformers.MixtralForCausalLM, dict(num_local_experts=8, intermediate_size=32)),
}


def tiny_moe(arch: str = "qwen3_moe", model_class: type | None = None, seed: int = 0, **overrides) -> torch.nn.Module:
    """A 2-layer random fp32 MoE model of ``arch`` (8 experts, top-2); ``model_class`` e.g. the
    token-classification class of the same architecture."""
    cls, keys = ARCHITECTURES[arch]
    return tiny_model(model_class or cls, seed=seed, num_experts_per_tok=2, **{**keys, **overrides})


def padded_micro(rows: int = 4, seed: int = 3) -> DataProto:
    """``rows`` sequences of P prompt + R response columns, prompts left-padded and responses right-padded by
    different amounts (row i: i % 3 pad tokens on the left, i % R on the right)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (rows, P + R), generator=g)
    mask = torch.ones(rows, P + R, dtype=torch.long)
    for i in range(rows):
        mask[i, : i % 3] = 0
        if i % R:
            mask[i, P + R - i % R:] = 0
    ids = ids * mask
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": pos,
                                        "responses": ids[:, P:], "response_mask": mask[:, P:]})
