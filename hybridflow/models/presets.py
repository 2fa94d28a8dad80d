"""Size presets for benchmarks: random-init Llama models of the tiny-arith config family (same tokenizer, chat
template and architecture; more width and depth), written as a local HF directory.

``medium`` (~25M parameters) is the compute-bound shape of the performance benchmarks (docs/performance.md): 8
layers, hidden 512, 8 heads of 64 (4 key/value heads), MLP 1536, the tiny-arith vocabulary of 512 tokens.
"""

from __future__ import annotations

import os
import shutil

import torch

from hybridflow.models.builtin import resolve_model_path
from hybridflow.models.files import match_umask

PRESETS: dict[str, dict] = {
    "medium": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
               "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 1024},
}
_BASE = "builtin:tiny-arith"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def build_preset(name: str, out_dir: str, seed: int = 0) -> str:
    """Write the random-init preset ``name`` (weights fp32, seeded) with the tiny-arith tokenizer to ``out_dir``;
    returns ``out_dir``. Raises ``ValueError`` for an unknown name (listing the known ones)."""
    from transformers import AutoConfig, LlamaForCausalLM

    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    base = resolve_model_path(_BASE)
    config = AutoConfig.from_pretrained(base)
    for key, value in PRESETS[name].items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out_dir)
    match_umask(out_dir)
    for file in _TOKENIZER_FILES:
        if os.path.exists(os.path.join(base, file)):
            shutil.copy(os.path.join(base, file), out_dir)
    return out_dir


def resolve_benchmark_model(model: str, work_dir: str) -> str:
    """``model`` as a loadable path: a preset name is built under ``work_dir/<name>`` (once), anything else (a
    local directory, ``builtin:NAME``, a Hugging Face hub id) is returned unchanged.

    Raises:
        FileNotFoundError: ``model`` is no preset, no known ``builtin:NAME``, no hub id that resolves
            (:func:`~hybridflow.models.builtin.resolve_model_path`) and no local directory with a ``config.json``
            (the message names the presets).
    """
    if model not in PRESETS:
        known = (f"a preset ({', '.join(sorted(PRESETS))}), builtin:NAME, a hub id or a local Hugging Face model "
                 "directory")
        try:
            local = resolve_model_path(model)
        except ValueError as exc:
            raise FileNotFoundError(f"model {model!r}: {exc}") from None
        if not os.path.isfile(os.path.join(local, "config.json")):
            raise FileNotFoundError(f"model {model!r} is not {known} (no config.json there)")
        return model
    out = os.path.join(work_dir, model)
    if not os.path.exists(os.path.join(out, "config.json")):
        build_preset(model, out)
    return out


def parameter_count(path: str) -> int:
    """Parameters of the causal LM at ``path`` (a directory or ``builtin:NAME``), tied weights counted once."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(resolve_model_path(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())
