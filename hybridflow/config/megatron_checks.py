"""Load-time checks of the ``*.megatron`` layout sections against each role's pool and the other roles, decided by
each role's engine registration (its ``layout_section``, ``requires_package`` and ``install_hint`` metadata,
:mod:`hybridflow.training`), so a user engine reading the ``megatron`` layout gets them too; the per-role engine
layout the workers build from them is :func:`hybridflow.training.engine_layout`. The section itself and the checks
of its own values are the megatron engine's (:mod:`hybridflow.training.megatron_config`)."""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

from hybridflow.config.schema import ActorConfig
from hybridflow.mapping.layouts import pool_ranks
from hybridflow.models.vision_types import is_vision_model_dir
from hybridflow.training import ENGINES

__all__ = ["LAYOUT_SECTION", "MEGATRON_SECTIONS", "expert_problems", "megatron_problems"]

#: a role's config section -> (its strategy key, the layouts role whose pool it runs on)
MEGATRON_SECTIONS = {"actor_rollout_ref.actor": ("actor_rollout_ref.actor.strategy", "actor"),
                     "actor_rollout_ref.ref": ("actor_rollout_ref.actor.strategy", "reference"),
                     "critic": ("critic.strategy", "critic")}
LAYOUT_SECTION = "megatron"  # the (tp, pp) sub-section an engine reads when its registration has this layout_section
_SIZE_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
              "expert_tensor_parallel_size")
DEFAULT_STRATEGY = ActorConfig.strategy  # the schema's default strategy (registered by hybridflow.training itself)


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except ModuleNotFoundError:
        return False


def _readers() -> str:
    return " | ".join(ENGINES.names(layout_section=LAYOUT_SECTION)) or "(none registered)"


def _section_problems(get: Callable[[str], Any], section: str, strategy_key: str, ranks: int,
                      reads: bool) -> list[str]:
    key = f"{section}.{LAYOUT_SECTION}"
    tp, pp = get(f"{key}.tensor_model_parallel_size"), get(f"{key}.pipeline_model_parallel_size")
    if min(tp, pp) < 1:
        return [f"{key}: tensor_model_parallel_size and pipeline_model_parallel_size must be >= 1, got {tp}, {pp}"]
    ep, etp = get(f"{key}.expert_model_parallel_size"), get(f"{key}.expert_tensor_parallel_size")
    if not reads:
        experts = "" if (ep, etp) == (1, 1) else f", ep {ep}, etp {etp}"
        return [] if (tp, pp, ep, etp) == (1, 1, 1, 1) else [
            f"{key} (tp {tp}, pp {pp}{experts}) is read only with strategy={_readers()}, but {strategy_key}={get(strategy_key)}"]
    if ranks % (tp * pp):
        return [f"{key}: tensor_model_parallel_size * pipeline_model_parallel_size = {tp} * {pp} must divide the "
                f"role's {ranks} ranks"]
    return expert_problems(key, get(f"{key}.expert_model_parallel_size"),
                           get(f"{key}.expert_tensor_parallel_size"), ranks // (tp * pp))


def expert_problems(key: str, ep: int, etp: int, stage_ranks: int) -> list[str]:
    """Problems of a role's expert layout: ``ep`` >= 1 dividing the ``dp * tp`` ranks of a pipeline stage
    (Megatron's expert groups are cut from them); expert tensor parallelism only 1 (not supported here yet)."""
    if etp != 1:
        return [f"{key}.expert_tensor_parallel_size={etp}: only 1 is supported (experts stay whole on their "
                "expert-parallel rank)"]
    if ep < 1 or stage_ranks % ep:
        return [f"{key}.expert_model_parallel_size={ep} must be >= 1 and divide data * tensor parallel = "
                f"{stage_ranks} ranks per pipeline stage"]
    return []


def megatron_problems(get: Callable[[str], Any]) -> list[str]:
    """Each role's engine (its ``strategy``) decides from its registration's metadata: ``requires_package`` (+
    ``install_hint``) must be installed; a ``*.megatron`` layout is read by an engine with
    ``layout_section="megatron"`` and must then divide its role's ranks, else stay (1, 1); the reference shares the
    actor's (tp, pp) (one process, one parallel state); the DTensor ``actor.tensor_model_parallel_size`` stays 1
    with such an engine. All defaults (every strategy the schema's, every layout (1, 1)) need no registry lookup."""
    strategies = {section: get(key) for section, (key, _) in MEGATRON_SECTIONS.items()}
    sizes = {section: tuple(get(f"{section}.{LAYOUT_SECTION}.{key}") for key in _SIZE_KEYS) for section in strategies}
    if all(s == DEFAULT_STRATEGY for s in strategies.values()) and all(v == (1, 1, 1, 1) for v in sizes.values()):
        return []
    meta = ENGINES.declared  # None for an unknown engine: strategy_problems reports it
    problems: list[str] = []
    for engine in dict.fromkeys(strategies.values()):
        package = meta(engine, "requires_package")
        if package and not _installed(package):
            problems.append(f"strategy={engine} needs {meta(engine, 'install_hint') or f'pip install {package}'}")
    reads = {section: meta(engine, "layout_section") == LAYOUT_SECTION for section, engine in strategies.items()}
    for section, (key, role) in MEGATRON_SECTIONS.items():
        problems += _section_problems(get, section, key, pool_ranks(get, role), reads[section])
        path = get(f"{section.split('.')[0]}.model.path")  # actor/ref: actor_rollout_ref.model, critic: critic.model
        line = (f"{key}={strategies[section]}: {path} is a vision-language model; megatron does not support VLMs "
                "(use strategy=fsdp2)")
        if reads[section] and line not in problems and is_vision_model_dir(path):  # one line (actor + ref: one)
            problems.append(line)
    actor, ref = f"actor_rollout_ref.actor.{LAYOUT_SECTION}", f"actor_rollout_ref.ref.{LAYOUT_SECTION}"
    if reads["actor_rollout_ref.actor"]:
        engine = strategies["actor_rollout_ref.actor"]
        actor_size, ref_size = sizes["actor_rollout_ref.actor"], sizes["actor_rollout_ref.ref"]
        if ref_size != (1, 1, 1, 1) and actor_size != ref_size:
            problems.append(f"{ref} (tp, pp, ep, etp)={ref_size} must equal {actor} {actor_size} (or stay 1s): the "
                            "reference shares the actor's process and parallel state")
        if get("actor_rollout_ref.actor.tensor_model_parallel_size") != 1:
            problems.append("actor_rollout_ref.actor.tensor_model_parallel_size is the DTensor tp of engines without "
                            f"a layout section; with strategy={engine} set {actor}.tensor_model_parallel_size instead")
    return problems
