"""Tiny random-init Hugging Face mixture-of-experts models for the Megatron expert-parallel tests (no downloads):
Qwen3-MoE by default (8 experts, top-2, hidden 64, 2 layers, head_dim 32, expert FFN 32), fp32, fixed seed.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import transformers

QWEN3_MOE = dict(vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=8,
                 num_experts_per_tok=2, norm_topk_prob=True, router_aux_loss_coef=0.0, max_position_embeddings=128)


def tiny_moe(model_class: type = transformers.Qwen3MoeForCausalLM, seed: Optional[int] = 0,
             **overrides: Any) -> torch.nn.Module:
    """A random fp32 ``model_class`` (a Qwen3-MoE causal LM by default) with :data:`QWEN3_MOE` updated by
    ``overrides``; ``seed``: ``torch.manual_seed`` right before the weights are drawn. The router weights are
    scaled up (std 0.5) so that top-k choices are well separated (a near-tie would make EP=1 vs EP=2 comparisons
    depend on fp32 summation order)."""
    if seed is not None:
        torch.manual_seed(seed)
    model = model_class(model_class.config_class(**{**QWEN3_MOE, **overrides})).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
    return model.eval()
