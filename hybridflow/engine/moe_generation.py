"""The generation layout of a mixture-of-experts causal LM (Qwen3-MoE, Qwen2-MoE, Mixtral) for the
3D-HybridEngine: attention and vocabulary tensor parallel as for dense models (:mod:`hybridflow.engine.tp_model`),
the routed experts *expert parallel* inside the generation tp group.

Generation rank ``t`` of a tp_g group holds experts ``[t * E / tp_g, (t + 1) * E / tp_g)`` of every layer
(``mlp.experts.gate_up_proj`` / ``down_proj`` split along dim 0, the experts), the router replicated. Every rank
routes all tokens (same inputs, same router: the same top-k), computes the contributions of its own experts
and one all-reduce sums them (exact up to fp summation order; the tokens of other experts add zeros). Qwen2-MoE's
shared expert is split like a dense MLP (gate/up by rows, down_proj by columns with an all-reduce).

Memory: a generation rank holds ``1 / tp_g`` of the experts, attention and vocabulary, and the replicated norms
and routers, so the switch's peak extra memory stays at the plan's bound (:meth:`ReshardPlan.peak_extra_bytes`:
the generation shard, about ``model_bytes / tp_g``, plus one bucket); no rank gathers a full copy when
``tp_g > 1``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from hybridflow.distributed.tp import localize_attention, tp_dims
from hybridflow.engine.tp_model import RowParallelLinear, TPGroup, VocabParallelEmbedding, VocabParallelLMHead

__all__ = ["ExpertShard", "build_generation_model", "generation_dims", "is_moe_config"]

_MOE_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral")
_COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.shared_expert.gate_proj",
            "mlp.shared_expert.up_proj")
_ROWWISE = ("self_attn.o_proj", "mlp.shared_expert.down_proj")
_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def is_moe_config(config: Any) -> bool:
    """Whether ``config`` (or a model's) is an MoE architecture with this generation layout."""
    return getattr(getattr(config, "config", config), "model_type", None) in _MOE_TYPES


def _experts(config: Any) -> int:
    return int(getattr(config, "num_experts", None) or config.num_local_experts)


def _check(config: Any, tp: int) -> None:
    sizes = {"num_attention_heads": config.num_attention_heads,
             "num_key_value_heads": config.num_key_value_heads or config.num_attention_heads,
             "experts": _experts(config), "vocab_size": config.vocab_size,
             "shared_expert_intermediate_size": getattr(config, "shared_expert_intermediate_size", 0) or 0}
    bad = [f"{key}={value}" for key, value in sizes.items() if value % tp]
    if bad:
        raise ValueError(f"generation tensor-parallel size {tp} must divide {', '.join(bad)} (whole heads, kv "
                         "heads, experts and vocabulary rows per rank)")


def generation_dims(module: torch.nn.Module, tp: int) -> dict[str, Optional[int]]:
    """Name -> the dim split over the generation tp group for every parameter of ``module`` (None: replicated):
    dense models as :func:`hybridflow.distributed.tp.tp_dims`; MoE models as the module docstring says.

    Raises:
        ValueError: ``tp`` does not divide the heads, kv heads, experts or vocabulary (MoE).
        KeyError: a dense architecture without a tensor-parallel plan.
    """
    if tp == 1:
        return {name: None for name, _ in module.named_parameters()}
    if not is_moe_config(module):
        return tp_dims(module, "generate")
    _check(module.config, tp)
    out: dict[str, Optional[int]] = {}
    for name, _ in module.named_parameters():
        if name in ("model.embed_tokens.weight", "lm_head.weight") or name.endswith(_EXPERTS):
            out[name] = 0
        elif any(name.endswith(f"{suffix}.weight") or name.endswith(f"{suffix}.bias") for suffix in _COLWISE):
            out[name] = 0
        elif any(name.endswith(f"{suffix}.weight") for suffix in _ROWWISE):
            out[name] = 1
        else:
            out[name] = None
    return out


class ExpertShard(torch.nn.Module):
    """The experts ``[start, start + E_local)`` of one MoE layer (HF's fused ``gate_up_proj`` (E_local, 2F, H),
    ``down_proj`` (E_local, H, F)); forward(hidden (T, H), top_k_index (T, k) long global expert ids,
    top_k_weights (T, k)) -> (T, H): the sum over this rank's experts of weight * expert(token), all-reduced
    over the tp group (the other experts' terms come from their ranks)."""

    tp: TPGroup
    start: int

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        local = top_k_index - self.start
        for j in range(self.gate_up_proj.shape[0]):
            token, slot = torch.where(local == j)
            if token.numel() == 0:
                continue
            gate, up = F.linear(hidden[token], self.gate_up_proj[j]).chunk(2, dim=-1)
            value = F.linear(self.act_fn(gate) * up, self.down_proj[j]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, value.to(out.dtype))
        return self.tp.all_reduce(out)


def _swap(module: torch.nn.Module, cls: type, tp: TPGroup, **attrs: Any) -> None:
    module.__class__ = cls
    module.tp = tp
    for key, value in attrs.items():
        setattr(module, key, value)


def build_generation_model(config: Any, tp: TPGroup, dtype: torch.dtype) -> torch.nn.Module:
    """The generation causal LM of ``config`` on the ``meta`` device: a dense model through
    :func:`hybridflow.engine.tp_model.build_tp_generation_model`; an MoE model with the layout of the module
    docstring (plain model when ``tp.size == 1``).

    Raises:
        ValueError / KeyError: see :func:`generation_dims` and ``build_tp_generation_model``.
    """
    from hybridflow.engine.tp_model import build_tp_generation_model

    if not is_moe_config(config):
        return build_tp_generation_model(config, tp, dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    if tp.size == 1:
        return model
    _check(config, tp.size)
    per_rank = _experts(config) // tp.size
    for layer in model.model.layers:
        for name in _ROWWISE:
            try:
                _swap(layer.get_submodule(name), RowParallelLinear, tp)
            except AttributeError:  # no shared expert
                continue
        localize_attention(layer.self_attn, tp.size)
        _swap(layer.mlp.experts, ExpertShard, tp, start=tp.rank * per_rank)
    vocab_rows = config.vocab_size // tp.size
    _swap(model.model.embed_tokens, VocabParallelEmbedding, tp, vocab_start=tp.rank * vocab_rows)
    _swap(model.lm_head, VocabParallelLMHead, tp)
    return model
