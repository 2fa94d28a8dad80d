"""Load-time checks of the Ulysses sequence-parallel keys (``actor_rollout_ref.actor.ulysses_sequence_parallel_size``,
``actor_rollout_ref.ref.ulysses_sequence_parallel_size``, ``critic.ulysses_sequence_parallel_size``): what the
engines (:func:`hybridflow.training.engine_layout`, :mod:`hybridflow.training.ulysses`) need, reported at load as one
line each instead of failing inside a worker."""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional

from hybridflow.mapping.layouts import pool_ranks
from hybridflow.training import ENGINES

__all__ = ["SP_SECTIONS", "sequence_parallel_problems"]

KEY = "ulysses_sequence_parallel_size"
#: a role's config section -> (its strategy key, the layouts role whose pool it runs on, its model path key)
SP_SECTIONS = {"actor_rollout_ref.actor": ("actor_rollout_ref.actor.strategy", "actor", "actor_rollout_ref.model.path"),
               "critic": ("critic.strategy", "critic", "critic.model.path")}


def _attention_heads(path: str) -> Optional[int]:
    """``num_attention_heads`` of the Hugging Face config in the local directory ``path`` (its text model's for a
    vision-language config); None when there is none to read (a hub name: the engine checks at build)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    config = config.get("text_config") or config
    return config.get("num_attention_heads")


def _engine_reads_sp(engine: str) -> bool:
    return engine not in ENGINES or bool(ENGINES.meta(engine, "sequence_parallel"))  # unknown: strategy_problems


def _section_problems(get: Callable[[str], Any], section: str, strategy_key: str, role: str,
                      path_key: str) -> list[str]:
    key, sp = f"{section}.{KEY}", get(f"{section}.{KEY}")
    if sp < 1:
        return [f"{key} must be >= 1, got {sp}"]
    if sp == 1:
        return []
    engine = get(strategy_key)
    if not _engine_reads_sp(engine):
        return [f"{key}={sp}: strategy={engine} has no Ulysses sequence parallelism (use strategy=fsdp2)"]
    tp = get("actor_rollout_ref.actor.tensor_model_parallel_size") if role == "actor" else 1
    if tp > 1:
        return [f"{key}={sp} with actor_rollout_ref.actor.tensor_model_parallel_size={tp}: sp and tp do not combine yet"]
    ranks = pool_ranks(get, role)
    if ranks % sp:
        return [f"{key}={sp} must divide the role's {ranks} ranks (dp = ranks / sp)"]
    path = get(path_key) or get("actor_rollout_ref.model.path")
    heads = _attention_heads(path) if isinstance(path, str) and path else None
    if heads is not None and heads % sp:
        return [f"{key}={sp} must divide the model's {heads} attention heads ({path})"]
    return []


def sequence_parallel_problems(get: Callable[[str], Any]) -> list[str]:
    """The sp keys: >= 1; > 1 only with an engine registered ``sequence_parallel=True`` (fsdp2), without the DTensor
    tp, dividing the role's ranks and the model's attention heads; the reference's is 1 (it follows the actor's)
    or the actor's (it shares the actor's process and layout)."""
    problems: list[str] = []
    for section, (strategy_key, role, path_key) in SP_SECTIONS.items():
        if section == "critic" and get(f"{section}.{KEY}") == 1:
            continue
        problems += _section_problems(get, section, strategy_key, role, path_key)
    actor, ref = get(f"actor_rollout_ref.actor.{KEY}"), get(f"actor_rollout_ref.ref.{KEY}")
    if ref not in (1, actor):
        problems.append(f"actor_rollout_ref.ref.{KEY}={ref} must equal actor_rollout_ref.actor.{KEY}={actor} (or "
                        "stay 1): the reference runs on the actor's ranks and layout")
    return problems  # *.megatron.context_parallel_size: the megatron engine's own check (training/megatron_config.py)
