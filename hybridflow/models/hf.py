"""Loading Hugging Face causal LMs, value models, score (reward/cost) models and tokenizers from local directories
(a hub id resolves to its snapshot in the Hugging Face cache, :func:`hybridflow.models.builtin.resolve_model_path`).

Pad-token rule (documented for users): when the tokenizer has no pad token, hybridflow uses its eos token as
pad. This never breaks the ``response_mask``, because the rollout derives the mask from the step at which each
row finished, never by comparing tokens with the pad id.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any, Optional

import torch
import transformers
from transformers import AutoConfig, AutoTokenizer, GenerationConfig  # the model classes load where used: a driver
# that only tokenizes skips transformers' modeling imports (~1.5 s on a 2-core CPU)

from hybridflow.errors import UserError
from hybridflow.models.builtin import BUILTIN_MODELS, resolve_model_path
from hybridflow.models.vlm import is_vision_model_dir, load_vision_model

logger = logging.getLogger(__name__)

# files one of which holds a tokenizer's vocabulary (a fast tokenizer's tokenizer.json, or a slow tokenizer's
# vocabulary next to tokenizer_config.json); also any *.model (sentencepiece) or *.tiktoken file
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
EXPECTED_TOKENIZER_FILES = ("tokenizer.json (with tokenizer_config.json), or a vocabulary (tokenizer.model, "
                            "vocab.json + merges.txt, vocab.txt) with tokenizer_config.json")


class MissingTokenizerError(UserError, ValueError):
    """A model directory holds no tokenizer files; ``str(error)`` is one line naming the directory and the files
    expected. Also a ``ValueError``, as the loader's other tokenizer errors."""


def _quiet_transformers() -> None:
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _check_dir(path: str) -> str:
    local = resolve_model_path(path)
    if not os.path.isdir(local):
        raise FileNotFoundError(f"model path {path!r} is not a local directory: pass a local Hugging Face model "
                                f"directory, a hub id (org/name) or builtin:NAME ({', '.join(BUILTIN_MODELS)})")
    return local


def check_tokenizer_files(path: str) -> str:
    """The local directory of ``path`` (see :func:`_check_dir`) after checking that it holds a tokenizer's vocabulary
    (one of :data:`TOKENIZER_VOCAB_FILES`, a ``*.model`` or a ``*.tiktoken`` file), so a model directory saved
    without its tokenizer is reported by name instead of by transformers' guess at a missing converter.

    Raises:
        FileNotFoundError: ``path`` is not a local directory.
        MissingTokenizerError: the directory holds no tokenizer vocabulary (one line: the directory, the files
            expected and up to 8 of the files it holds).
    """
    local = _check_dir(path)
    names = sorted(os.listdir(local))
    if any(n in TOKENIZER_VOCAB_FILES or n.endswith((".model", ".tiktoken")) for n in names):
        return local
    held = ", ".join(names[:8]) + (f", ... ({len(names)} files)" if len(names) > 8 else "") if names else "nothing"
    where = local if local == path else f"{path} ({local})"
    raise MissingTokenizerError(f"no tokenizer files in {where}: expected {EXPECTED_TOKENIZER_FILES}; it holds "
                                f"{held}")


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """Tokenizer from a local model directory, with a pad token guaranteed (see the module's pad-token rule).

    Raises:
        FileNotFoundError: ``path`` is not a local directory.
        MissingTokenizerError: (a ``ValueError``) the directory holds no tokenizer files
            (:func:`check_tokenizer_files`).
        ValueError: the tokenizer has neither a pad nor an eos token.
        OSError: transformers could not load the tokenizer files there.
    """
    _quiet_transformers()
    tokenizer = AutoTokenizer.from_pretrained(check_tokenizer_files(path), trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer at {path!r} has neither a pad token nor an eos token; set one of them")
        tokenizer.pad_token = tokenizer.eos_token
        logger.info("tokenizer has no pad token: using eos %r as pad", tokenizer.eos_token)
    return tokenizer


def get_eos_token_ids(path: str, tokenizer: Any) -> list[int]:
    """Every id that ends generation: the tokenizer's eos plus all of ``generation_config.eos_token_id``."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    try:
        gen_eos = GenerationConfig.from_pretrained(_check_dir(path)).eos_token_id
    except OSError:  # no generation_config.json
        gen_eos = None
    if gen_eos is not None:
        ids.extend(int(i) for i in (gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]))
    if not ids:
        raise ValueError(f"model at {path!r} defines no eos token (tokenizer or generation_config)")
    return sorted(set(ids))


def model_positions(path: str, trust_remote_code: bool = False) -> Optional[tuple[int, float]]:
    """``(max_position_embeddings, rope factor)`` of the model at ``path`` (a local directory, hub id or
    ``builtin:NAME``), read from its ``config.json`` (a multimodal config's text model); the factor is the rope
    scaling's ``factor`` (1.0 without scaling), by which some configs (YaRN, dynamic NTK) extend the positions
    beyond ``max_position_embeddings``. None when the config cannot be read or names no position limit."""
    try:
        config = AutoConfig.from_pretrained(resolve_model_path(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError):
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    if not isinstance(limit, int) or limit <= 0:
        return None
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    factor = rope.get("factor") if isinstance(rope, dict) else None
    return limit, float(factor) if isinstance(factor, (int, float)) and factor > 1 else 1.0


def accepts_logits_to_keep(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward takes transformers' ``logits_to_keep`` (run the output head on the last
    positions, or on given positions, only)."""
    return "logits_to_keep" in inspect.signature(type(module).forward).parameters


def load_causal_lm(path: str, dtype: torch.dtype, trust_remote_code: bool = False) -> torch.nn.Module:
    """``AutoModelForCausalLM`` from a local directory, in ``dtype``, on CPU (callers move/shard it)."""
    _quiet_transformers()
    from transformers import AutoModelForCausalLM

    if is_vision_model_dir(path):  # Qwen2/2.5-VL: AutoModelForImageTextToText (hybridflow/models/vlm.py)
        return load_vision_model(_check_dir(path), dtype, trust_remote_code=trust_remote_code)
    return AutoModelForCausalLM.from_pretrained(_check_dir(path), dtype=dtype, trust_remote_code=trust_remote_code)


def load_value_model(path: str, dtype: torch.dtype, trust_remote_code: bool = False) -> torch.nn.Module:
    """A value model: the same architecture with a scalar head per token (``AutoModelForTokenClassification``
    with ``num_labels=1``); the backbone comes from the checkpoint, the head is freshly initialised unless the
    checkpoint has one. Output ``logits`` are ``(B, L, 1)``.
    """
    from transformers import AutoModelForTokenClassification

    _quiet_transformers()
    if is_vision_model_dir(path):  # a VLM critic: its output head replaced by a scalar one
        return load_vision_model(_check_dir(path), dtype, value_head=True, trust_remote_code=trust_remote_code)
    model = AutoModelForTokenClassification.from_pretrained(
        _check_dir(path), num_labels=1, dtype=dtype, trust_remote_code=trust_remote_code
    )
    # Dropout on a value head makes value estimates noisy between the rollout and training passes.
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def load_score_model(path: str, dtype: torch.dtype, trust_remote_code: bool = False) -> torch.nn.Module:
    """A one-label scorer from a local directory, as ``AutoModelForTokenClassification`` (a score per token).

    A ``*ForSequenceClassification`` checkpoint loads into the token-classification class of the same
    architecture: both keep their head in ``score``; the head is built without bias to match. Dropout is off.

    Raises:
        FileNotFoundError: ``path`` is not a local directory.
        ValueError: the checkpoint has no trained ``score`` head (e.g. a plain causal LM), or has more than one
            label.
    """
    from transformers import AutoModelForTokenClassification

    local = resolve_model_path(path)
    if not os.path.isdir(local):
        raise FileNotFoundError(f"score model path {path!r} is not a local directory: pass a local Hugging Face "
                                "model directory or a hub id (org/name)")
    config = AutoConfig.from_pretrained(local, trust_remote_code=trust_remote_code)
    architectures = config.architectures or []
    if not any(a.endswith(("ForSequenceClassification", "ForTokenClassification")) for a in architectures):
        raise ValueError(f"score model at {path!r} has no trained score head (architectures {architectures}); "
                         "expected a *ForSequenceClassification or *ForTokenClassification checkpoint")
    if config.num_labels != 1:
        raise ValueError(f"score model at {path!r} has num_labels={config.num_labels}; a reward or cost model "
                         "must have exactly one label")
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        config.token_classification_bias = False  # sequence-classification heads have no bias
    model, info = AutoModelForTokenClassification.from_pretrained(
        local, config=config, dtype=dtype, trust_remote_code=trust_remote_code, output_loading_info=True
    )
    missing = [k for k in info["missing_keys"] if k.split(".")[0] == "score"]
    if missing:
        raise ValueError(f"score model at {path!r} has no trained score head (missing {missing}); expected a "
                         "*ForSequenceClassification or *ForTokenClassification checkpoint with num_labels=1")
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    model.requires_grad_(False)
    return model.eval()
