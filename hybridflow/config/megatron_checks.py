"""Load-time checks of the ``*.megatron`` sections (strategy=megatron); the per-role engine layout the workers
build from them is :func:`hybridflow.training.engine_layout`."""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

__all__ = ["MEGATRON_SECTIONS", "megatron_problems"]

#: megatron section -> (its strategy key, the layouts role whose pool it runs on)
MEGATRON_SECTIONS = {"actor_rollout_ref.actor": ("actor_rollout_ref.actor.strategy", "actor"),
                     "actor_rollout_ref.ref": ("actor_rollout_ref.actor.strategy", "reference"),
                     "critic": ("critic.strategy", "critic")}


def _installed() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


def _section_problems(get: Callable[[str], Any], section: str, strategy_key: str, ranks: int) -> list[str]:
    key = f"{section}.megatron"
    tp, pp = get(f"{key}.tensor_model_parallel_size"), get(f"{key}.pipeline_model_parallel_size")
    if min(tp, pp) < 1:
        return [f"{key}: tensor_model_parallel_size and pipeline_model_parallel_size must be >= 1, got {tp}, {pp}"]
    if get(strategy_key) != "megatron":
        return [] if (tp, pp) == (1, 1) else [
            f"{key} (tp {tp}, pp {pp}) is read only with strategy=megatron, but {strategy_key}={get(strategy_key)}"]
    if ranks % (tp * pp):
        return [f"{key}: tensor_model_parallel_size * pipeline_model_parallel_size = {tp} * {pp} must divide the "
                f"role's {ranks} ranks"]
    return []


def megatron_problems(get: Callable[[str], Any]) -> list[str]:
    """strategy=megatron needs megatron-core; each ``*.megatron`` layout must divide its role's ranks; the
    reference shares the actor's (tp, pp) (one process, one Megatron parallel state); the fsdp2-only
    ``actor.tensor_model_parallel_size`` stays 1 with megatron."""
    from hybridflow.config.layouts import _pool_ranks

    problems: list[str] = []
    strategies = {section: get(key) for section, (key, _) in MEGATRON_SECTIONS.items()}
    if "megatron" in strategies.values() and not _installed():
        problems.append('strategy=megatron needs megatron-core: pip install -e ".[megatron]"')
    for section, (key, role) in MEGATRON_SECTIONS.items():
        problems += _section_problems(get, section, key, _pool_ranks(get, role))
    actor, ref = "actor_rollout_ref.actor.megatron", "actor_rollout_ref.ref.megatron"
    if strategies["actor_rollout_ref.actor"] == "megatron":
        sizes = [(get(f"{s}.tensor_model_parallel_size"), get(f"{s}.pipeline_model_parallel_size")) for s in (actor, ref)]
        if sizes[1] != (1, 1) and sizes[0] != sizes[1]:
            problems.append(f"{ref} (tp, pp)={sizes[1]} must equal {actor} {sizes[0]} (or stay 1, 1): the "
                            "reference shares the actor's process and Megatron parallel state")
        if get("actor_rollout_ref.actor.tensor_model_parallel_size") != 1:
            problems.append("actor_rollout_ref.actor.tensor_model_parallel_size is the fsdp2 tp; with "
                            f"strategy=megatron set {actor}.tensor_model_parallel_size instead")
    return problems
