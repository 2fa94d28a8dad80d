"""Full Hugging Face weights from a ``megatron`` engine checkpoint directory (one ``megatron_rank_<r>.pt`` per
rank, written by :meth:`hybridflow.training.megatron.MegatronEngine.save_checkpoint`), offline: no process group,
no megatron-core. ``hybridflow export`` uses it for an actor trained with ``strategy=megatron``.
"""

from __future__ import annotations

import functools
import glob
import os
import re
from typing import Any, Callable

import torch
from transformers import AutoConfig

from hybridflow.models.megatron_convert import HFParam, hf_params, hf_shard_from_local, merge_tp_shards
from hybridflow.models.megatron_moe import stack_experts

__all__ = ["is_megatron_checkpoint", "megatron_state_dict"]

_RANK_FILE = re.compile(r"megatron_rank_(\d+)\.pt$")


def is_megatron_checkpoint(directory: str) -> bool:
    """Whether ``directory`` holds a megatron engine's per-rank files."""
    return bool(glob.glob(os.path.join(directory, "megatron_rank_*.pt")))


def _expert_tensor(param: HFParam, load: Callable[[int], dict], config: Any, layout: tuple[int, int, int],
                   ep: int, pp_rank: int) -> torch.Tensor:
    """An expert tensor (``param.ep_dim``) concatenated from the ``ep`` expert-parallel ranks of stage ``pp_rank``
    (EP rank ``r`` is the stage's ``r``-th rank in (dp, tp) order, as ``training.megatron_setup.ep_rank_of``);
    ``load(rank)``: that rank's local parameters, experts stacked."""
    dp, tp, _ = layout
    parts = []
    for ep_rank in range(ep):
        rank = (pp_rank * dp + ep_rank // tp) * tp + ep_rank % tp
        parts.append(hf_shard_from_local(param, load(rank)[param.mg_name], config, tp))
    return torch.cat(parts, dim=param.ep_dim)


def megatron_state_dict(directory: str, hf_dir: str) -> dict[str, torch.Tensor]:
    """HF name -> full tensor of the model saved under ``directory`` (config from ``hf_dir``); the ranks of
    dp rank 0 are read (dp ranks hold the same parameters), and for an MoE model's experts the ranks of each
    expert-parallel group. A tied model gets ``lm_head.weight`` too.

    Raises:
        FileNotFoundError: no rank file, or a rank of the saved layout is missing.
    """
    files = {int(_RANK_FILE.search(f).group(1)): f for f in glob.glob(os.path.join(directory, "megatron_rank_*.pt"))}
    if not files:
        raise FileNotFoundError(f"no megatron_rank_*.pt under {directory!r}")
    config = AutoConfig.from_pretrained(hf_dir)
    first = torch.load(files[min(files)], weights_only=True, map_location="cpu")
    dp, tp, pp = first["layout"]
    ep = int(first.get("ep", 1))

    @functools.lru_cache(maxsize=None)
    def load(rank: int) -> dict:
        if rank not in files:
            raise FileNotFoundError(f"megatron checkpoint {directory!r} lacks rank {rank} of its "
                                    f"(dp={dp}, tp={tp}, pp={pp}, ep={ep}) layout")
        return stack_experts(torch.load(files[rank], weights_only=True, map_location="cpu")["model"])

    params = hf_params(config, first["kind"], pp)
    state: dict[str, torch.Tensor] = {}
    for p in params:
        if p.ep_dim is not None:
            state[p.name] = _expert_tensor(p, load, config, (dp, tp, pp), ep, p.pp_stage).contiguous()
            continue
        shards = [hf_shard_from_local(p, load(p.pp_stage * dp * tp + r)[p.mg_name], config, tp)
                  for r in range(tp)]  # dp rank 0 (ParallelLayout.rank_of)
        state[p.name] = merge_tp_shards(shards, p.tp_dim).contiguous()
    if first["kind"] == "policy" and config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state
