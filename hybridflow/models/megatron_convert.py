"""Hugging Face <-> Megatron-core conversion for Llama / Qwen2 / Mistral-style decoders (GQA, RMSNorm, SwiGLU,
RoPE, tied or untied embeddings, Qwen2's q/k/v bias) and their value-model variant (``*ForTokenClassification``
with one label: backbone + ``score`` head).

Everything goes through *HF tp-shards*: the ``tp_rank``-th ``torch.chunk`` of a Hugging Face tensor along the dim
Megatron's tensor parallelism splits (:attr:`HFParam.tp_dim`). A rank's Megatron local tensors are built from its
HF tp-shards, and give them back:

* ``linear_qkv`` (fused, interleaved per KV group): for each of the rank's ``G/tp`` groups ``[q heads of the group
  (q_per_group * d rows), k (d rows), v (d rows)]``; the HF q/k/v tp-shards are contiguous head groups;
* ``linear_fc1`` = ``[gate tp-shard; up tp-shard]`` (Megatron's SwiGLU chunks the local output in two);
* ``linear_proj`` / ``linear_fc2`` split the input dim (HF ``o_proj`` / ``down_proj`` dim 1); embeddings and an
  untied ``lm_head`` split the vocabulary (dim 0); norms and the value head are replicated.

Pipeline stages hold ``num_layers / pp`` consecutive layers (Megatron's default split, local names restart at 0);
the embedding lives on the first stage, the final norm and output layer on the last (a tied embedding's output
copy on the last stage when ``pp > 1``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from hybridflow.models.megatron_moe import is_moe, moe_layer_params

__all__ = ["HFParam", "hf_params", "hf_shard_from_local", "local_from_hf", "merge_tp_shards", "stage_layers",
           "tp_shard"]


@dataclass(frozen=True)
class HFParam:
    """One Hugging Face parameter and where Megatron keeps it.

    Attributes:
        name: HF name (``model.layers.0.self_attn.q_proj.weight``).
        shape: full HF shape.
        tp_dim: the HF dim tensor parallelism splits (None: replicated).
        pp_stage: pipeline stage holding it.
        mg_name: the Megatron local name on that stage (layer index local to the stage).
        part: ``full`` (the Megatron tensor is the HF tp-shard), ``q``/``k``/``v`` (of ``linear_qkv``) or
            ``gate``/``up`` (of ``linear_fc1``).
        ep_dim: the HF dim expert parallelism splits (the experts of a fused MoE tensor, 0), None otherwise; the
            Megatron tensor is then the stacked pseudo-tensor of :mod:`hybridflow.models.megatron_moe`.
    """

    name: str
    shape: tuple[int, ...]
    tp_dim: Optional[int]
    pp_stage: int
    mg_name: str
    part: str = "full"
    ep_dim: Optional[int] = None


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> range:
    """The global layer indices of pipeline stage ``pp_rank`` (even split).

    Raises:
        ValueError: ``num_layers`` not divisible by ``pp``.
    """
    if num_layers % pp:
        raise ValueError(f"num_hidden_layers={num_layers} is not divisible by pipeline_model_parallel_size={pp}")
    per = num_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def _dims(cfg: Any) -> tuple[int, int, int, int]:
    """``(hidden, heads, kv_groups, head_dim)`` of an HF config."""
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.hidden_size, heads, cfg.num_key_value_heads or heads, head_dim


def _layer_params(cfg: Any, layer: int, local: int, stage: int) -> list[HFParam]:
    hidden, heads, groups, d = _dims(cfg)
    hf, mg = f"model.layers.{layer}.", f"decoder.layers.{local}."
    qkv = mg + "self_attention.linear_qkv."
    rows = {"q": heads * d, "k": groups * d, "v": groups * d}
    suffixes = ("weight", "bias") if _qkv_bias(cfg) else ("weight",)
    out = [HFParam(f"{hf}self_attn.{part}_proj.{suffix}", (rows[part], hidden)[:2 if suffix == "weight" else 1], 0,
                   stage, qkv + suffix, part) for part in "qkv" for suffix in suffixes]
    out.append(HFParam(hf + "self_attn.o_proj.weight", (hidden, heads * d), 1, stage,
                       mg + "self_attention.linear_proj.weight"))
    if cfg.model_type == "qwen3_moe":  # per-head q/k RMSNorm (head_dim,), replicated
        out += [HFParam(f"{hf}self_attn.{p}_norm.weight", (d,), None, stage, f"{mg}self_attention.{p}_layernorm.weight")
                for p in "qk"]
    if is_moe(cfg):
        mlp = moe_layer_params(cfg, layer, local, stage, HFParam)
    else:
        ffn = cfg.intermediate_size
        mlp = [HFParam(hf + "mlp.gate_proj.weight", (ffn, hidden), 0, stage, mg + "mlp.linear_fc1.weight", "gate"),
               HFParam(hf + "mlp.up_proj.weight", (ffn, hidden), 0, stage, mg + "mlp.linear_fc1.weight", "up"),
               HFParam(hf + "mlp.down_proj.weight", (hidden, ffn), 1, stage, mg + "mlp.linear_fc2.weight")]
    return out + mlp + [
        HFParam(hf + "input_layernorm.weight", (hidden,), None, stage, mg + "input_layernorm.weight"),
        HFParam(hf + "post_attention_layernorm.weight", (hidden,), None, stage, mg + "pre_mlp_layernorm.weight"),
    ]


def _qkv_bias(cfg: Any) -> bool:
    """Qwen2 has q/k/v bias (no ``attention_bias`` key); Llama/Mistral follow ``attention_bias`` (default off)."""
    return cfg.model_type in ("qwen2", "qwen2_moe") or bool(getattr(cfg, "attention_bias", False))


def hf_params(cfg: Any, kind: str = "policy", pp: int = 1) -> list[HFParam]:
    """Every HF parameter of a ``policy`` (causal LM) or ``value`` (one-label token classifier) model, in HF
    ``named_parameters`` order (a tied ``lm_head`` is not listed: it is ``model.embed_tokens.weight``)."""
    hidden = cfg.hidden_size
    last = pp - 1
    out = [HFParam("model.embed_tokens.weight", (cfg.vocab_size, hidden), 0, 0, "embedding.word_embeddings.weight")]
    for stage in range(pp):
        for local, layer in enumerate(stage_layers(cfg.num_hidden_layers, pp, stage)):
            out += _layer_params(cfg, layer, local, stage)
    out.append(HFParam("model.norm.weight", (hidden,), None, last, "decoder.final_layernorm.weight"))
    if kind == "value":
        out += [HFParam("score.weight", (1, hidden), None, last, "output_layer.weight"),
                HFParam("score.bias", (1,), None, last, "output_layer.bias")]
    elif not cfg.tie_word_embeddings:
        out.append(HFParam("lm_head.weight", (cfg.vocab_size, hidden), 0, last, "output_layer.weight"))
    return out


def tp_shard(full: torch.Tensor, tp_dim: Optional[int], tp: int, tp_rank: int) -> torch.Tensor:
    """The ``tp_rank``-th of ``tp`` chunks of ``full`` along ``tp_dim`` (a view; ``full`` itself when None).

    Raises:
        ValueError: the dim is not divisible by ``tp``.
    """
    if tp_dim is None or tp == 1:
        return full
    if full.shape[tp_dim] % tp:
        raise ValueError(f"dim {tp_dim} of a {tuple(full.shape)} tensor is not divisible by tensor parallel {tp}")
    return full.chunk(tp, dim=tp_dim)[tp_rank]


def merge_tp_shards(shards: list[torch.Tensor], tp_dim: Optional[int]) -> torch.Tensor:
    """Inverse of :func:`tp_shard` over all ranks (the first shard when replicated)."""
    return shards[0] if tp_dim is None or len(shards) == 1 else torch.cat(shards, dim=tp_dim)


def _qkv_split(cfg: Any, tp: int) -> tuple[int, int, int]:
    """``(local groups, q rows per group, kv rows per group)``; raises ValueError if groups % tp."""
    _, heads, groups, d = _dims(cfg)
    if groups % tp:
        raise ValueError(f"num_key_value_heads={groups} is not divisible by tensor_model_parallel_size={tp}")
    return groups // tp, heads // groups * d, d


def hf_shard_from_local(param: HFParam, local: torch.Tensor, cfg: Any, tp: int) -> torch.Tensor:
    """The HF tp-shard of ``param`` held in this rank's Megatron tensor ``local`` (``local_sd[param.mg_name]``).

    ``full`` and ``gate``/``up`` are views; ``q``/``k``/``v`` are views when the rank holds one KV group, else
    copies (the groups interleave). Shapes: the HF shape with ``tp_dim`` divided by ``tp``.
    """
    if param.part == "full":
        return local
    if param.part in ("gate", "up"):
        return local.chunk(2, dim=0)[0 if param.part == "gate" else 1]
    g, q_rows, kv_rows = _qkv_split(cfg, tp)
    grouped = local.view(g, q_rows + 2 * kv_rows, *local.shape[1:])
    start, rows = {"q": (0, q_rows), "k": (q_rows, kv_rows), "v": (q_rows + kv_rows, kv_rows)}[param.part]
    part = grouped[:, start:start + rows]
    return part.reshape(g * rows, *local.shape[1:])


def local_from_hf(params: list[HFParam], shards: dict[str, torch.Tensor], cfg: Any, tp: int,
                  pp_rank: int) -> dict[str, torch.Tensor]:
    """This rank's Megatron local state dict (stage ``pp_rank``) from its HF tp-shards ``shards`` (name -> tensor).

    Raises:
        KeyError: a parameter of the stage is missing from ``shards``.
    """
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[str, torch.Tensor]] = {}
    for param in params:
        if param.pp_stage != pp_rank:
            continue
        if param.part == "full":
            out[param.mg_name] = shards[param.name]
        else:
            fused.setdefault(param.mg_name, {})[param.part] = shards[param.name]
    g, _, _ = _qkv_split(cfg, tp)
    for name, parts in fused.items():
        if "gate" in parts:
            out[name] = torch.cat([parts["gate"], parts["up"]], dim=0)
            continue
        q, k, v = parts["q"], parts["k"], parts["v"]
        out[name] = torch.cat([q.reshape(g, -1, *q.shape[1:]), k.reshape(g, -1, *k.shape[1:]),
                               v.reshape(g, -1, *v.shape[1:])], dim=1).reshape(-1, *q.shape[1:])
    return out
