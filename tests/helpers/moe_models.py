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


def save_tiny_moe_for_training(out_dir: str, seed: int = 0) -> str:
    """The tiny Qwen3-MoE with the built-in tiny-arith tokenizer (vocabulary 512, its bos/eos/pad ids) saved as an
    HF directory ``out_dir`` that ``actor_rollout_ref.model.path`` can name; returns ``out_dir``."""
    import os
    import shutil

    from hybridflow.models.builtin import resolve_model_path

    base = resolve_model_path("builtin:tiny-arith")
    tiny_moe(seed=seed, vocab_size=512, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
             pad_token_id=0, num_key_value_heads=2).save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if os.path.exists(os.path.join(base, name)):
            shutil.copy(os.path.join(base, name), out_dir)
    return out_dir
