"""``hybridflow export`` of a LoRA checkpoint (``actor_rollout_ref.model.lora_rank`` > 0): the merged model
(W + (alpha / r) B A, a plain Hugging Face directory) or, with ``--adapter-only``, the peft adapter directory that
``peft.PeftModel.from_pretrained(base, dir)`` loads onto the base model.

A LoRA checkpoint is marked by peft's ``adapter_config.json`` in ``actor/hf/`` (written at save time); its sharded
weights carry peft's names (``base_model.model.<name>.base_layer.weight``, ``...lora_A.default.weight``, ...).
"""

from __future__ import annotations

import torch

from hybridflow.models.lora import lora_scaling, merge_lora_stream


def merged_state_dict(hf_dir: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's state dict with every LoRA layer merged, from a LoRA checkpoint's full ``state``."""
    from peft import LoraConfig

    config = LoraConfig.from_pretrained(hf_dir)
    return dict(merge_lora_stream(sorted(state.items()), lora_scaling(config)))


def save_adapter(hf_dir: str, state: dict[str, torch.Tensor], model_config, out_dir: str) -> None:
    """Write the peft adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) to ``out_dir``.

    Raises:
        ValueError: the checkpoint's names do not match a peft model of its config and adapter config.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = LoraConfig.from_pretrained(hf_dir)
    base = AutoModelForCausalLM.from_config(model_config, dtype=next(iter(state.values())).dtype)
    base.name_or_path = config.base_model_name_or_path  # keep the training run's base in the adapter config
    model = get_peft_model(base, config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k.endswith("lm_head.weight") and model_config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"LoRA checkpoint in {hf_dir!r} does not match its adapter config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    model.save_pretrained(out_dir)
