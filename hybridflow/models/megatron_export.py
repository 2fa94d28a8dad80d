"""Full Hugging Face weights from a ``megatron`` engine checkpoint directory (one ``megatron_rank_<r>.pt`` per
rank, written by :meth:`hybridflow.training.megatron.MegatronEngine.save_checkpoint`), offline: no process group,
no megatron-core. ``hybridflow export`` uses it for an actor trained with ``strategy=megatron``.
"""

from __future__ import annotations

import glob
import os
import re

import torch
from transformers import AutoConfig

from hybridflow.models.megatron_convert import hf_params, hf_shard_from_local, merge_tp_shards

__all__ = ["is_megatron_checkpoint", "megatron_state_dict"]

_RANK_FILE = re.compile(r"megatron_rank_(\d+)\.pt$")


def is_megatron_checkpoint(directory: str) -> bool:
    """Whether ``directory`` holds a megatron engine's per-rank files."""
    return bool(glob.glob(os.path.join(directory, "megatron_rank_*.pt")))


def megatron_state_dict(directory: str, hf_dir: str) -> dict[str, torch.Tensor]:
    """HF name -> full tensor of the model saved under ``directory`` (config from ``hf_dir``); the ranks of
    dp rank 0 are read (dp ranks hold the same parameters). A tied model gets ``lm_head.weight`` too.

    Raises:
        FileNotFoundError: no rank file, or a (tp, pp) rank of the saved layout is missing.
    """
    files = {int(_RANK_FILE.search(f).group(1)): f for f in glob.glob(os.path.join(directory, "megatron_rank_*.pt"))}
    if not files:
        raise FileNotFoundError(f"no megatron_rank_*.pt under {directory!r}")
    config = AutoConfig.from_pretrained(hf_dir)
    first = torch.load(files[min(files)], weights_only=True, map_location="cpu")
    dp, tp, pp = first["layout"]
    params = hf_params(config, first["kind"], pp)
    shards: dict[tuple[int, str], torch.Tensor] = {}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            rank = pp_rank * dp * tp + tp_rank  # dp rank 0 (ParallelLayout.rank_of)
            if rank not in files:
                raise FileNotFoundError(f"megatron checkpoint {directory!r} lacks rank {rank} of its "
                                        f"(dp={dp}, tp={tp}, pp={pp}) layout")
            local = torch.load(files[rank], weights_only=True, map_location="cpu")["model"]
            for p in params:
                if p.pp_stage == pp_rank:
                    shards[tp_rank, p.name] = hf_shard_from_local(p, local[p.mg_name], config, tp)
    state = {p.name: merge_tp_shards([shards[r, p.name] for r in range(tp)], p.tp_dim).contiguous() for p in params}
    if first["kind"] == "policy" and config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state
