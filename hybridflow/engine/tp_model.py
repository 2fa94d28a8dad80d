"""A tensor-parallel Hugging Face causal LM for generation, built from plain local tensors.

:func:`build_tp_generation_model` makes the model's skeleton on the ``meta`` device (no memory) and turns the
layers the plan splits into their tensor-parallel versions; the hybrid engine then installs each rank's
generation shard as ordinary parameters. The forward is the unchanged HF forward plus three small layer
classes (Megatron-style, Shoeybi et al. 2019):

* colwise linears (q/k/v, gate/up) need nothing: they hold a slice of the output features, and attention
  reshapes with ``-1`` heads, so each rank runs its own heads;
* :class:`RowParallelLinear` (o_proj, down_proj): partial products summed by one all-reduce, bias added once;
* :class:`VocabParallelEmbedding` / :class:`VocabParallelLMHead`: each rank holds rows
  ``[tp_rank * V / tp, (tp_rank + 1) * V / tp)`` of the (possibly tied) table; the embedding looks up the ids
  it holds and all-reduces, the head all-gathers the logit slices into full (.., V) logits.

All ranks of a generation tp group run the same decode loop on the same inputs; collectives keep them in
lockstep, and the all-gathered logits are the same bits everywhere, so the same seed draws the same tokens.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from hybridflow.distributed.shm_comm import ShmGroup
from hybridflow.distributed.tp import check_tp_size, get_tp_plan, localize_attention
from hybridflow.models.vlm import is_vision_config, vision_model_from_config

__all__ = ["RowParallelLinear", "TPGroup", "VocabParallelEmbedding", "VocabParallelLMHead",
           "build_tp_generation_model"]


class TPGroup:
    """A generation tp group: the process group, this rank's tp_g rank, the size, and ``order[i]``: the tp_g
    rank of the group's i-th member by global rank (the order of ``all_gather`` outputs). ``shm``: the members'
    shared-memory collectives (:mod:`hybridflow.distributed.shm_comm`; a gloo group on one host), used for the CPU
    tensors that fit its slots; everything else goes through ``torch.distributed``."""

    def __init__(self, group: Optional[dist.ProcessGroup], rank: int, size: int, order: list[int],
                 shm: Optional[ShmGroup] = None) -> None:
        self.group, self.rank, self.size, self.order, self.shm = group, rank, size, order, shm

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group in place; returns it."""
        if self.size == 1:
            return tensor
        if self.shm is not None and self.shm.fits(tensor):
            return self.shm.all_reduce_(tensor)
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every member's ``tensor`` along the last dim, in tp_g rank order."""
        if self.size == 1:
            return tensor
        if self.shm is not None and self.shm.fits(tensor):
            parts = self.shm.all_gather(tensor)  # views of shared memory: the cat below copies them out
        else:
            parts = [torch.empty_like(tensor) for _ in range(self.size)]
            dist.all_gather(parts, tensor.contiguous(), group=self.group)
        ordered = [None] * self.size
        for member, tp_rank in enumerate(self.order):
            ordered[tp_rank] = parts[member]
        return torch.cat(ordered, dim=-1)


class RowParallelLinear(torch.nn.Linear):
    """``y = all_reduce(x_local @ W_local^T) + b``: x_local (.., in/tp) this rank's input slice, W_local
    (out, in/tp), y (.., out) the same on every rank."""

    tp: TPGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(torch.nn.Embedding):
    """Embedding over the vocabulary rows ``[vocab_start, vocab_start + rows)``: ids (B, T) long -> (B, T, H);
    ids elsewhere give zeros on this rank and their row from the rank that holds it (all-reduce, exact: one
    non-zero term per id)."""

    tp: TPGroup
    vocab_start: int

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))


class VocabParallelLMHead(torch.nn.Linear):
    """Logits of this rank's vocabulary rows (.., V/tp), all-gathered into the full (.., V) logits."""

    tp: TPGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last_dim(F.linear(x, self.weight, self.bias))


def _swap(module: torch.nn.Module, cls: type, tp: TPGroup, **attrs: Any) -> None:
    module.__class__ = cls  # same parameters and names, tensor-parallel forward
    module.tp = tp
    for key, value in attrs.items():
        setattr(module, key, value)


def build_tp_generation_model(config: Any, tp: TPGroup, dtype: torch.dtype) -> torch.nn.Module:
    """The causal LM of ``config`` on the ``meta`` device, with its split layers made tensor parallel over
    ``tp`` (plain model when ``tp.size == 1``). Parameters keep their HF names and full shapes until the
    engine installs the local shards; tied weights stay tied (one parameter).

    Raises:
        KeyError: no tensor-parallel plan for the architecture.
        ValueError: ``tp.size`` does not divide the heads, kv heads, MLP width or vocabulary.
    """
    with torch.device("meta"):
        model = (vision_model_from_config(config, dtype, tp.size) if is_vision_config(config)  # a VLM, tp 1
                 else AutoModelForCausalLM.from_config(config, dtype=dtype))
    model.eval()
    model.requires_grad_(False)
    if tp.size == 1:
        return model
    check_tp_size(config, tp.size, "generate")
    plan = get_tp_plan(model)
    for layer in model.get_submodule(plan.layers):
        for name in plan.rowwise:
            _swap(layer.get_submodule(name), RowParallelLinear, tp)
        localize_attention(layer.get_submodule(plan.attention), tp.size)
    vocab_rows = config.vocab_size // tp.size
    _swap(model.get_submodule(plan.embedding), VocabParallelEmbedding, tp, vocab_start=tp.rank * vocab_rows)
    _swap(model.get_submodule(plan.lm_head), VocabParallelLMHead, tp)
    return model
