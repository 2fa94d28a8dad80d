"""The one builder of tiny random Hugging Face models for tests (no downloads): a config with small defaults, any
override, a fixed seed, fp32.

``tiny_model()`` is a 2-layer Llama causal LM (vocab 64, hidden 32, MLP 64, 2 query heads, 1 key-value head);
``tiny_model(transformers.Qwen2ForCausalLM, ...)`` or ``tiny_model(transformers.LlamaForSequenceClassification,
num_labels=1, ...)`` build another architecture or head with the same defaults (the config class is the model
class's ``config_class``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import transformers

DEFAULTS = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1)


def tiny_config(config_class: type = transformers.LlamaConfig, **overrides: Any) -> transformers.PretrainedConfig:
    """A ``config_class`` with :data:`DEFAULTS` updated by ``overrides``."""
    return config_class(**{**DEFAULTS, **overrides})


def tiny_model(model_class: type = transformers.LlamaForCausalLM, seed: Optional[int] = 0, eval: bool = False,
               **overrides: Any) -> torch.nn.Module:
    """A random fp32 ``model_class`` built from :func:`tiny_config` (``overrides`` go to the config).

    ``seed``: ``torch.manual_seed(seed)`` right before the weights are drawn (None: the current RNG state);
    ``eval``: return the model in eval mode.
    """
    if seed is not None:
        torch.manual_seed(seed)
    model = model_class(tiny_config(model_class.config_class, **overrides)).float()
    return model.eval() if eval else model
