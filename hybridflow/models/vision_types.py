"""Which checkpoints are vision-language models, read from their ``config.json`` alone (no torch, no transformers):
the config checks and the vLLM engine arguments ask this before any model code is imported."""

from __future__ import annotations

import json
import os

VISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")  # the supported VLM families (hybridflow/models/vlm.py)


def is_vision_model_dir(path: str) -> bool:
    """Whether the model at ``path`` (a directory, ``builtin:NAME`` or a hub id) is a supported VLM (its
    ``config.json`` ``model_type``); False for a path that does not resolve to a directory."""
    from hybridflow.models.builtin import resolve_model_path

    try:
        path = resolve_model_path(str(path))
    except (ValueError, FileNotFoundError):
        return False
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return False
    with open(config) as f:
        return json.load(f).get("model_type") in VISION_MODEL_TYPES
