"""Megatron-core ``GPTModel`` built from a Hugging Face Llama / Qwen2 / Mistral config (local, non-TransformerEngine
layer spec), for a causal LM (``policy``) or a value model (``value``: the output layer is a tp-replicated
``Linear(hidden, 1)``, HF ``score``). Must run after ``megatron.core.parallel_state.initialize_model_parallel``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

__all__ = ["ValueHead", "build_gpt_model", "transformer_config"]


def _rope_theta(cfg: Any) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta or getattr(cfg, "rope_theta", None) or 10000.0)


def transformer_config(cfg: Any, *, tp: int, pp: int, dtype: torch.dtype, device: str, ep: int = 1) -> Any:
    """The ``TransformerConfig`` of HF config ``cfg`` (GQA groups, RMSNorm eps, SwiGLU, head_dim, qkv bias, no
    dropout; an MoE model's fields from :func:`hybridflow.models.megatron_moe.moe_config_kwargs`, ``ep`` experts
    groups); fused CUDA kernels are off on CPU.

    Raises:
        ValueError: an activation other than SiLU, rope scaling, or sliding-window attention (not converted).
    """
    from megatron.core.transformer import TransformerConfig

    from hybridflow.models.megatron_convert import _dims, _qkv_bias
    from hybridflow.models.megatron_moe import moe_config_kwargs

    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"megatron conversion supports SwiGLU (hidden_act=silu), got {cfg.hidden_act!r}")
    scaling = getattr(cfg, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ValueError(f"megatron conversion does not convert rope_scaling {scaling}")
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True) and cfg.model_type == "mistral":
        if cfg.sliding_window < cfg.max_position_embeddings:
            raise ValueError("megatron conversion does not convert sliding-window attention")
    hidden, heads, groups, head_dim = _dims(cfg)
    gpu = device != "cpu"
    return TransformerConfig(
        num_layers=cfg.num_hidden_layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
        kv_channels=head_dim, ffn_hidden_size=cfg.intermediate_size, normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=_qkv_bias(cfg), hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, params_dtype=dtype,
        pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=True, variable_seq_lengths=True, bias_activation_fusion=gpu,
        bias_dropout_fusion=gpu, masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, deallocate_pipeline_outputs=False,
        expert_model_parallel_size=ep, **moe_config_kwargs(cfg),
        moe_token_dispatcher_type="alltoall")  # allgather (the default) rejects variable_seq_lengths


class ValueHead(torch.nn.Linear):
    """``Linear(hidden, 1)`` with the call signature of Megatron's output layer (returns ``(values, None)``).

    Input (S, B, hidden), output (S, B, 1); replicated over tp (inputs are tp-replicated after the last
    row-parallel layer), so its gradient is the same on every tp rank.
    """

    def forward(self, hidden: torch.Tensor, weight: Optional[torch.Tensor] = None,  # type: ignore[override]
                runtime_gather_output: Optional[bool] = None) -> tuple[torch.Tensor, None]:
        return super().forward(hidden), None


def build_gpt_model(cfg: Any, kind: str, *, tp: int, pp: int, pp_rank: int, dtype: torch.dtype,
                    device: str, ep: int = 1) -> torch.nn.Module:
    """``GPTModel`` for stage ``pp_rank`` (pre_process on the first stage, post_process on the last) on ``device``,
    every parameter in ``dtype`` (the distributed optimizer keeps fp32 main copies of bf16/fp16 ones).

    ``kind="value"`` replaces the output layer with a :class:`ValueHead`; its forward then returns (B, S, 1).

    Raises:
        ValueError: vocabulary not divisible by ``tp``, or what :func:`transformer_config` rejects.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if cfg.vocab_size % tp:
        raise ValueError(f"vocab_size={cfg.vocab_size} is not divisible by tensor_model_parallel_size={tp}")
    config = transformer_config(cfg, tp=tp, pp=pp, dtype=dtype, device=device, ep=ep)
    last = pp_rank == pp - 1
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                    qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
    model = GPTModel(config, spec, vocab_size=cfg.vocab_size,
                     max_sequence_length=cfg.max_position_embeddings, pre_process=pp_rank == 0, post_process=last,
                     parallel_output=True, position_embedding_type="rope", rotary_base=_rope_theta(cfg),
                     share_embeddings_and_output_weights=kind == "policy" and bool(cfg.tie_word_embeddings))
    if kind == "value" and last:
        model.output_layer = ValueHead(cfg.hidden_size, 1, bias=True, dtype=dtype)
    # the local spec's RMSNorm weights are made in fp32 whatever params_dtype says; Megatron's training loop
    # casts the whole model (Float16Module), so every parameter is in ``dtype`` here too, as in the HF model:
    # one dtype per rank for the pipeline, the iterators and the resharder (buffers such as rotary tables stay)
    with torch.no_grad():
        for param in model.parameters():
            if param.dtype != dtype:
                param.data = param.data.to(dtype)
    return model.to(device)


def local_state_from_hf(hf_state: dict[str, torch.Tensor], cfg: Any, kind: str, *, tp: int, tp_rank: int, pp: int,
                        pp_rank: int, ep: int = 1, ep_rank: int = 0) -> dict[str, torch.Tensor]:
    """This rank's Megatron local state dict from a full HF state dict (a tied embedding's output copy included
    on the last stage when ``pp > 1``; an MoE model's experts as the stacked pseudo-tensors of EP rank
    ``ep_rank``, which :func:`load_local_state` splits)."""
    from hybridflow.models.megatron_convert import hf_params, local_from_hf, tp_shard
    from hybridflow.models.megatron_moe import ep_shard

    params = hf_params(cfg, kind, pp)
    shards = {p.name: ep_shard(tp_shard(hf_state[p.name], p.tp_dim, tp, tp_rank), p.ep_dim, ep, ep_rank)
              for p in params if p.pp_stage == pp_rank}
    local = local_from_hf(params, shards, cfg, tp, pp_rank)
    if kind == "policy" and cfg.tie_word_embeddings and pp > 1 and pp_rank == pp - 1:
        local["output_layer.weight"] = tp_shard(hf_state["model.embed_tokens.weight"], 0, tp, tp_rank)
    return local


def load_local_state(model: torch.nn.Module, local: dict[str, torch.Tensor]) -> None:
    """Copy ``local`` into ``model``'s parameters (in place, so optimizer/DDP buffers stay bound).

    ``local`` may hold an MoE layer's experts stacked (:func:`hybridflow.models.megatron_moe.stack_experts`).

    Raises:
        KeyError: a parameter of ``model`` has no entry in ``local``, or ``local`` has an unknown name.
    """
    from hybridflow.models.megatron_moe import unstack_experts

    params = dict(model.named_parameters())
    local = unstack_experts(local, list(params))
    missing = sorted(set(params) - set(local))
    unknown = sorted(set(local) - set(params))
    if missing or unknown:
        raise KeyError(f"megatron state mismatch: missing {missing[:4]}, unknown {unknown[:4]}")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(local[name])
