"""Export a training checkpoint's actor as a Hugging Face model directory (safetensors + config + tokenizer).

A checkpoint's ``actor/`` holds the sharded weights (``torch.distributed.checkpoint``) and ``actor/hf/`` the
model config, generation config and tokenizer written at save time, so no original model directory is needed.
"""

from __future__ import annotations

import os
import tempfile

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from hybridflow.models.files import match_umask
from hybridflow.models.lora import is_lora_checkpoint
from hybridflow.models.lora_export import merged_state_dict, save_adapter
from hybridflow.models.megatron_export import is_megatron_checkpoint, megatron_state_dict

HF_SUBDIR = "hf"


def _actor_dir(checkpoint_dir: str) -> str:
    for candidate in (checkpoint_dir, os.path.join(checkpoint_dir, "actor")):
        if os.path.isdir(os.path.join(candidate, HF_SUBDIR)):
            return candidate
    raise FileNotFoundError(
        f"{checkpoint_dir!r} is not a hybridflow checkpoint: expected <dir>/actor/{HF_SUBDIR}/ "
        "(pass a global_step_<N> directory or its actor/ subdirectory)"
    )


def load_actor_state_dict(checkpoint_dir: str) -> dict[str, torch.Tensor]:
    """The full (unsharded) actor weights of a checkpoint, by HF parameter name (read with
    ``weights_only=True``: tensors and plain containers only, no code runs)."""
    actor = _actor_dir(checkpoint_dir)
    if is_megatron_checkpoint(actor):  # strategy=megatron: per-rank Megatron tensors
        return megatron_state_dict(actor, os.path.join(actor, HF_SUBDIR))
    with tempfile.TemporaryDirectory() as tmp:
        target = os.path.join(tmp, "full.pt")
        dcp_to_torch_save(actor, target)
        return torch.load(target, weights_only=True)["model"]


def export_checkpoint(checkpoint_dir: str, out_dir: str, adapter_only: bool = False) -> str:
    """Write ``out_dir`` loadable by ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer`` (the weight
    files with the umask's mode, like the files beside them: :func:`~hybridflow.models.files.match_umask`); a LoRA
    checkpoint is merged (W + (alpha / r) B A), or with ``adapter_only`` written as a peft adapter directory
    (see :mod:`hybridflow.models.lora_export`).

    Raises:
        FileNotFoundError: ``checkpoint_dir`` is not a checkpoint.
        ValueError: the checkpoint's weights do not match the saved architecture (missing/unexpected names), or
            ``adapter_only`` on a checkpoint trained without LoRA.
    """
    actor = _actor_dir(checkpoint_dir)
    hf = os.path.join(actor, HF_SUBDIR)
    config = AutoConfig.from_pretrained(hf)
    lora = is_lora_checkpoint(hf)
    if adapter_only and not lora:
        raise ValueError(f"--adapter-only: {checkpoint_dir!r} was trained without LoRA "
                         "(actor_rollout_ref.model.lora_rank=0); export it without --adapter-only")
    state = load_actor_state_dict(checkpoint_dir)
    if adapter_only:
        save_adapter(hf, state, config, out_dir)
        AutoTokenizer.from_pretrained(hf).save_pretrained(out_dir)
        match_umask(out_dir)  # the weights readable like the config beside them
        return out_dir
    if lora:
        state = merged_state_dict(hf, state)
    model = AutoModelForCausalLM.from_config(config, dtype=next(iter(state.values())).dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"checkpoint {checkpoint_dir!r} does not match its config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    model.save_pretrained(out_dir)
    match_umask(out_dir)  # safetensors writes 0600: the weights readable like the config beside them
    AutoTokenizer.from_pretrained(hf).save_pretrained(out_dir)
    if os.path.exists(os.path.join(hf, "generation_config.json")):
        GenerationConfig.from_pretrained(hf).save_pretrained(out_dir)
    return out_dir
