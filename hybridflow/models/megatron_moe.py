"""Mixture-of-experts part of the Hugging Face <-> Megatron-core conversion (Qwen3-MoE, Qwen2-MoE, Mixtral):
the ``TransformerConfig`` MoE fields of an HF config, the expert / router / shared-expert rows of the
:class:`~hybridflow.models.megatron_convert.HFParam` table, and the expert-parallel (EP) split.

HF (transformers >= 5) keeps a layer's experts fused: ``mlp.experts.gate_up_proj`` (E, 2F, H) = per expert
``[gate (F rows); up (F rows)]`` and ``mlp.experts.down_proj`` (E, H, F). Megatron's local layer spec keeps them
as a ``SequentialMLP``: ``mlp.experts.local_experts.<j>.linear_fc1.weight`` (2F, H) (the same ``[gate; up]``
order) and ``...linear_fc2.weight`` (H, F), for the ``E / ep`` experts of this EP rank; local expert ``j`` of EP
rank ``r`` is global expert ``r * E / ep + j``. The conversion keeps a *stacked* pseudo-tensor per layer
(``mlp.experts.linear_fc1.weight``, (E/ep, 2F, H)): :func:`stack_experts` builds it from a model's parameters,
:func:`unstack_experts` splits it back; the EP shard of an HF expert tensor is its ``ep_rank``-th chunk along
dim 0 (:func:`ep_shard`). Expert tensor parallelism is 1 (experts are whole on each EP rank, replicated over tp).

The router ``mlp.gate.weight`` (E, H) is Megatron's ``mlp.router.weight``; Qwen2-MoE's shared expert maps to
``mlp.shared_experts.linear_fc1/fc2`` and its sigmoid gate ``shared_expert_gate.weight`` (1, H) to
``mlp.shared_experts.gate_weight``.
"""

from __future__ import annotations

import re
from typing import Any

import torch

__all__ = ["MOE_TYPES", "ep_shard", "expert_ffn", "is_moe", "moe_config_kwargs", "moe_layer_params", "num_experts",
           "stack_experts", "unstack_experts"]

MOE_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral")
_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")


def is_moe(cfg: Any) -> bool:
    """Whether HF config ``cfg`` is a mixture-of-experts architecture this conversion knows."""
    return getattr(cfg, "model_type", None) in MOE_TYPES


def num_experts(cfg: Any) -> int:
    """Routed experts per layer (``num_experts``; Mixtral: ``num_local_experts``)."""
    return int(getattr(cfg, "num_experts", None) or cfg.num_local_experts)


def expert_ffn(cfg: Any) -> int:
    """An expert's FFN width (``moe_intermediate_size``; Mixtral: ``intermediate_size``)."""
    return int(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)


def _check_all_sparse(cfg: Any) -> None:
    step = getattr(cfg, "decoder_sparse_step", 1)
    dense = list(getattr(cfg, "mlp_only_layers", None) or [])
    if step != 1 or dense:
        raise ValueError(f"megatron MoE conversion needs every layer sparse (decoder_sparse_step=1, "
                         f"mlp_only_layers=[]), got decoder_sparse_step={step}, mlp_only_layers={dense}")


def moe_config_kwargs(cfg: Any) -> dict[str, Any]:
    """The ``TransformerConfig`` MoE fields of HF config ``cfg`` ({} for a dense model): experts, top-k, expert
    FFN width, softmax routing (``norm_topk_prob`` / Mixtral: softmax over the top-k logits, i.e. renormalised
    top-k probabilities; otherwise top-k of the softmax over all experts), dropless (no capacity), the router's
    load-balancing loss coefficient ``router_aux_loss_coef`` as ``moe_aux_loss_coeff`` (``aux_loss`` balancing;
    ``none`` when 0), Qwen3-MoE's q/k RMSNorm, Qwen2-MoE's gated shared expert, Megatron's router replay
    hooks (used by routing replay). Expert tensor parallelism 1.

    Raises:
        ValueError: a model with dense layers between the sparse ones (not converted).
    """
    if not is_moe(cfg):
        return {}
    _check_all_sparse(cfg)
    normalised = cfg.model_type == "mixtral" or bool(getattr(cfg, "norm_topk_prob", False))
    coeff = float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0)
    out = dict(num_moe_experts=num_experts(cfg), moe_router_topk=int(cfg.num_experts_per_tok),
               moe_ffn_hidden_size=expert_ffn(cfg), moe_router_score_function="softmax",
               moe_router_pre_softmax=not normalised, moe_aux_loss_coeff=coeff,
               moe_router_load_balancing_type="aux_loss" if coeff > 0 else "none", moe_grouped_gemm=False,
               moe_permute_fusion=False, moe_router_dtype="fp32", expert_tensor_parallel_size=1,
               moe_enable_routing_replay=True,  # idle unless the engine sets a replay action (megatron_replay)
               qk_layernorm=cfg.model_type == "qwen3_moe")
    shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
    if cfg.model_type == "qwen2_moe" and shared:
        out.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True,
                   moe_shared_expert_overlap=False)
    return out


def moe_layer_params(cfg: Any, layer: int, local: int, stage: int, param_class: type) -> list:
    """The MLP rows of layer ``layer`` (local index ``local`` on pipeline stage ``stage``) of an MoE model, in HF
    order: router, fused experts (``ep_dim=0``), Qwen2-MoE's shared expert and its gate. ``param_class`` is
    :class:`~hybridflow.models.megatron_convert.HFParam` (passed in: that module imports this one)."""
    hidden, experts, ffn = cfg.hidden_size, num_experts(cfg), expert_ffn(cfg)
    hf, mg = f"model.layers.{layer}.mlp.", f"decoder.layers.{local}.mlp."
    out = [param_class(hf + "gate.weight", (experts, hidden), None, stage, mg + "router.weight"),
           param_class(hf + "experts.gate_up_proj", (experts, 2 * ffn, hidden), None, stage,
                       mg + "experts.linear_fc1.weight", ep_dim=0),
           param_class(hf + "experts.down_proj", (experts, hidden, ffn), None, stage,
                       mg + "experts.linear_fc2.weight", ep_dim=0)]
    if cfg.model_type == "mixtral":  # HF order: gate, then experts
        return out
    out = [out[1], out[2], out[0]] if cfg.model_type == "qwen3_moe" else out
    shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
    if cfg.model_type == "qwen2_moe" and shared:
        sh, ms = hf + "shared_expert.", mg + "shared_experts."
        out += [param_class(sh + "gate_proj.weight", (shared, hidden), 0, stage, ms + "linear_fc1.weight", "gate"),
                param_class(sh + "up_proj.weight", (shared, hidden), 0, stage, ms + "linear_fc1.weight", "up"),
                param_class(sh + "down_proj.weight", (hidden, shared), 1, stage, ms + "linear_fc2.weight"),
                param_class(hf + "shared_expert_gate.weight", (1, hidden), None, stage, ms + "gate_weight")]
    return out


def ep_shard(full: torch.Tensor, ep_dim: Any, ep: int, ep_rank: int) -> torch.Tensor:
    """The ``ep_rank``-th of ``ep`` chunks of ``full`` along ``ep_dim`` (a view; ``full`` when None or ep=1).

    Raises:
        ValueError: the dim (number of experts) is not divisible by ``ep``.
    """
    if ep_dim is None or ep == 1:
        return full
    if full.shape[ep_dim] % ep:
        raise ValueError(f"{full.shape[ep_dim]} experts are not divisible by expert_model_parallel_size={ep}")
    return full.chunk(ep, dim=ep_dim)[ep_rank]


def stack_experts(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``named`` (a Megatron model's local parameters) with each layer's ``local_experts.<j>.linear_fc{1,2}``
    replaced by one stacked (E/ep, out, in) tensor ``mlp.experts.linear_fc{1,2}.weight`` (a copy); other entries
    are kept as they are."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in named.items():
        match = _LOCAL_EXPERT.match(name)
        if match is None:
            out[name] = tensor
        else:
            experts.setdefault(f"{match.group(1)}.{match.group(3)}", {})[int(match.group(2))] = tensor
    for name, parts in experts.items():
        out[name] = torch.stack([parts[j] for j in range(len(parts))])
    return out


def unstack_experts(local: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`stack_experts` for the parameter ``names`` of a Megatron model: each wanted
    ``local_experts.<j>.linear_fc{1,2}.weight`` is row ``j`` of the stacked entry of ``local`` (kept as it is
    when ``local`` already has it unstacked, as a checkpoint's model state does)."""
    out = {name: tensor for name, tensor in local.items() if not name.endswith(
        (".mlp.experts.linear_fc1.weight", ".mlp.experts.linear_fc2.weight"))}
    for name in names:
        match = _LOCAL_EXPERT.match(name)
        if match is not None and name not in local:
            out[name] = local[f"{match.group(1)}.{match.group(3)}"][int(match.group(2))]
    return out
