"""Tensor parallelism (Megatron-style, Shoeybi et al. 2019) for Hugging Face decoder LMs, per architecture.

A :class:`TPPlan` names, for one architecture, which linears of a decoder layer are split by output features
(``colwise``: q/k/v, gate/up; each rank computes a slice of the heads / of the MLP width) and which by input
features (``rowwise``: o_proj, down_proj; each rank holds the matching input slice and the partial outputs
are summed with one all-reduce). Norms are replicated.

Embeddings and the LM head (tied in many small models) are placed differently in the two phases:

* training (:func:`apply_tp`, DTensor ``parallelize_module``): replicated over the tp axis, so a tied weight
  stays one parameter and every rank computes full-vocabulary logits (FSDP still shards it over dp);
* generation (:mod:`hybridflow.engine`): split by vocabulary rows (``vocab`` dim 0) so no rank holds the whole
  table; the embedding masks ids outside its rows and all-reduces, the head all-gathers its logit slices.
  A tied weight has the same rows in both places, so one local shard serves both.

Grouped-query attention: q is split by query heads and k/v by key/value heads, so every rank keeps whole
groups (local query head i reads local kv head i // (H / KV)); this needs ``num_key_value_heads % tp == 0``.
HF attention modules reshape with ``-1`` heads; attributes some versions keep (``num_heads``,
``num_key_value_heads``) are set to their local values by :func:`localize_attention`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from hybridflow.distributed.fsdp import apply_fsdp2
from hybridflow.registry import Registry

__all__ = [
    "TPPlan",
    "apply_tp",
    "check_tp_size",
    "get_tp_plan",
    "localize_attention",
    "parallelize_model",
    "register_tp_plan",
    "registered_tp_plans",
    "tp_dims",
]

Phase = Literal["train", "generate"]


@dataclass(frozen=True)
class TPPlan:
    """Where the weights of one architecture are split; module paths are relative to the causal-LM root
    (``layers``, ``embedding``, ``lm_head``) or to one decoder layer (``colwise``, ``rowwise``, ``attention``)."""

    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]
    layers: str = "model.layers"
    attention: str = "self_attn"
    embedding: str = "model.embed_tokens"
    lm_head: str = "lm_head"


_LLAMA_LIKE = TPPlan(
    colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
    rowwise=("self_attn.o_proj", "mlp.down_proj"),
)
TP_PLANS: Registry = Registry("tensor-parallel plan", missing="no tensor-parallel plan for model_type {name!r}")


def register_tp_plan(model_type: str, plan: TPPlan) -> None:
    """Register ``plan`` for HF ``config.model_type == model_type`` (in the registry ``TP_PLANS``).

    Raises:
        ValueError: ``model_type`` already has a different plan.
    """
    if model_type in TP_PLANS and TP_PLANS.get(model_type) != plan:
        raise ValueError(f"a different tensor-parallel plan is already registered for model_type {model_type!r}")
    TP_PLANS.register(model_type)(plan)


register_tp_plan("llama", _LLAMA_LIKE)
register_tp_plan("qwen2", _LLAMA_LIKE)  # q/k/v biases are split with their rows; o_proj has no bias


def registered_tp_plans() -> list[str]:
    """Sorted model types that have a tensor-parallel plan."""
    return TP_PLANS.names()


def get_tp_plan(config: Any) -> TPPlan:
    """The plan for ``config.model_type`` (a HF config, or a model with ``.config``); a new architecture gets one
    with :func:`register_tp_plan`.

    Raises:
        UnknownNameError: (a ``KeyError``) no plan for that model type (the message lists the known ones).
    """
    config = getattr(config, "config", config)
    return TP_PLANS.get(getattr(config, "model_type", None))


def check_tp_size(config: Any, tp: int, phase: Phase = "train") -> None:
    """Check that ``config`` splits evenly over ``tp`` ranks (whole heads and kv groups per rank; whole MLP
    columns; in the generation phase whole vocabulary rows).

    Raises:
        ValueError: naming every size that ``tp`` does not divide.
    """
    if tp < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {tp}")
    config = getattr(config, "config", config)
    sizes = {"num_attention_heads": config.num_attention_heads,
             "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
             "intermediate_size": config.intermediate_size}
    if phase == "generate":
        sizes["vocab_size"] = config.vocab_size
    bad = [f"{key}={value}" for key, value in sizes.items() if value % tp]
    if bad:
        raise ValueError(
            f"tensor-parallel size {tp} ({phase}) must divide {', '.join(bad)}: each rank holds whole attention "
            "heads and whole key/value heads (grouped-query attention is split by kv groups, so "
            "num_key_value_heads % tp must be 0), whole MLP columns"
            + (" and whole vocabulary rows" if phase == "generate" else "")
        )


def tp_dims(model: torch.nn.Module, phase: Phase) -> dict[str, Optional[int]]:
    """For every parameter of ``model`` (unique names, as ``named_parameters()``): the dim split over tp ranks
    in ``phase``, or None when it is replicated. Colwise weights and biases: 0; rowwise weights: 1 (their bias
    is replicated); embedding and LM head: None in ``train``, 0 (vocabulary rows) in ``generate``."""
    plan = get_tp_plan(model)
    split: dict[str, int] = {}
    layers = model.get_submodule(plan.layers)
    for i in range(len(layers)):
        for suffix in plan.colwise:
            split[f"{plan.layers}.{i}.{suffix}.weight"] = 0
            split[f"{plan.layers}.{i}.{suffix}.bias"] = 0
        for suffix in plan.rowwise:
            split[f"{plan.layers}.{i}.{suffix}.weight"] = 1
    if phase == "generate":
        split[f"{plan.embedding}.weight"] = 0
        split[f"{plan.lm_head}.weight"] = 0
    return {name: split.get(name) for name, _ in model.named_parameters()}


def localize_attention(attention: torch.nn.Module, tp: int) -> None:
    """Divide the head counts an attention module may keep as attributes by ``tp`` (the ratio of query to
    key/value heads, ``num_key_value_groups``, is unchanged)."""
    for attr in ("num_heads", "num_attention_heads", "num_key_value_heads"):
        if isinstance(getattr(attention, attr, None), int):
            setattr(attention, attr, getattr(attention, attr) // tp)


def apply_tp(model: torch.nn.Module, tp_mesh: DeviceMesh) -> torch.nn.Module:
    """Shard the decoder layers of ``model`` over the 1-D ``tp_mesh`` in place with DTensor (``colwise`` ->
    ``ColwiseParallel``, ``rowwise`` -> ``RowwiseParallel``, local tensors between layers); embeddings, LM head
    and norms stay replicated. Every rank of ``tp_mesh`` must feed the same inputs.

    Raises:
        KeyError: no plan for the architecture.
        ValueError: ``tp_mesh.size()`` does not divide the head counts or the MLP width.
    """
    tp = tp_mesh.size()
    check_tp_size(model.config, tp, "train")
    plan = get_tp_plan(model)
    # redistributing 2-D (FSDP x TP) parameters to full tensors warns about sequential all-gathers; expected here
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    styles = {**{name: ColwiseParallel() for name in plan.colwise},
              **{name: RowwiseParallel() for name in plan.rowwise}}
    for layer in model.get_submodule(plan.layers):
        parallelize_module(layer, tp_mesh, styles)
        localize_attention(layer.get_submodule(plan.attention), tp)
    return model


def parallelize_model(model: torch.nn.Module, mesh: DeviceMesh, reshard_after_forward: bool = True,
                      mp_policy=None) -> torch.nn.Module:
    """The training layout on ``mesh`` (from :func:`hybridflow.distributed.build_mesh`): on a 2-D ``("dp", "tp")``
    mesh, tensor parallel inside (:func:`apply_tp` over ``tp``) and FSDP2 over ``dp`` (2-D DTensor parameters);
    on a 1-D ``("dp",)`` mesh, FSDP2 only. ``mp_policy``: see :func:`apply_fsdp2`."""
    if mesh.ndim == 2:
        apply_tp(model, mesh["tp"])
        mesh = mesh["dp"]
    return apply_fsdp2(model, mesh, reshard_after_forward, mp_policy)
