"""The ``layouts`` section (written by ``hybridflow plan --emit-config``) as live config.

``layouts.<role>.<phase> = [pp, tp, dp]``, per role and phase: actor ``train`` and ``generate``, critic
``train``, reference ``infer``, reward (the reward model) ``infer``. At load (:func:`apply_layouts`, called by
``load_config`` before the semantic checks) each given layout is checked against the role's pool (pp·tp·dp = its
ranks) and the abilities of the role's training engine (``hybridflow.mapping.abilities``, declared by the engine's
registration: fsdp2 has no pipeline parallelism and tensor parallelism for the actor only; megatron runs tp x pp for
the actor and the critic; the reference on the actor's training layout), and applied: the actor's ``generate`` tp
becomes ``actor_rollout_ref.rollout.tensor_model_parallel_size``; a ``train`` layout sets the keys of the role's
engine: with an engine that reads a layout section (its registration's ``layout_section``: megatron) the
section's ``tensor_model_parallel_size`` and ``pipeline_model_parallel_size`` (actor and critic), else the actor's
``actor_rollout_ref.actor.tensor_model_parallel_size``; the workers then run dp = ranks / (tp * pp). A key set to
another value than its layout's (and than the default 1) is a conflict. The section's shape (phases, tp keys, the
pool of each role) is :mod:`hybridflow.mapping.layouts`; at start :func:`hybridflow.trainer.layouts.log_layouts` logs
what every role runs, (dp, tp, pp), and which of them came from ``layouts``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig

from hybridflow.mapping.abilities import Abilities, get_abilities
from hybridflow.mapping.cost import Layout
from hybridflow.mapping.layouts import PHASES, TP_KEYS, pool_ranks
from hybridflow.mapping.specs import SpecError
from hybridflow.training import ENGINES

__all__ = ["PHASES", "apply_layouts", "layout_problems"]

#: layouts role -> (its config section, the key naming its training engine)
ROLE_SECTIONS = {"actor": ("actor_rollout_ref.actor", "actor_rollout_ref.actor.strategy"),
                 "reference": ("actor_rollout_ref.actor", "actor_rollout_ref.actor.strategy"),
                 "critic": ("critic", "critic.strategy"), "reward": ("reward_model", "reward_model.strategy")}


def _abilities(get: Callable[[str], Any], role: str) -> Abilities | None:
    """The abilities of ``role``'s engine; None for an engine without any (unknown: strategy_problems says)."""
    try:
        return get_abilities(get(ROLE_SECTIONS[role][1]))
    except SpecError:
        return None


def _layout_keys(get: Callable[[str], Any], role: str, phase: str, lay: Layout) -> dict[str, tuple[str, int]]:
    """The config keys the layout ``lay`` of ``role``'s ``phase`` sets: key -> (what it is, its value)."""
    section, strategy_key = ROLE_SECTIONS[role]
    layout_section = ENGINES.declared(get(strategy_key), "layout_section") if phase == "train" else None
    if layout_section is not None and role in ("actor", "critic"):
        prefix = f"{section}.{layout_section}"
        return {f"{prefix}.tensor_model_parallel_size": ("tp", lay.tp),
                f"{prefix}.pipeline_model_parallel_size": ("pp", lay.pp)}
    tp_key = TP_KEYS.get((role, phase))
    return {tp_key: ("tp", lay.tp)} if tp_key else {}


def _given(get: Callable[[str], Any]) -> tuple[dict[tuple[str, str], Layout], list[str]]:
    """The layouts the config gives, as ``Layout`` by (role, phase), and the malformed or unknown entries."""
    out, problems = {}, []
    for role, phases in PHASES.items():
        for phase, value in dict(get(f"layouts.{role}") or {}).items():
            key = f"layouts.{role}.{phase}"
            if phase not in phases:
                problems.append(f"{key}: {role} has no phase {phase!r}; its phases are {', '.join(phases)}")
            elif len(value) != 3 or any(not isinstance(v, int) or v < 1 for v in value):
                problems.append(f"{key}: expected [pp, tp, dp] of three integers >= 1, got {list(value)}")
            else:
                out[(role, phase)] = Layout(*value)
    return out, problems


def layout_problems(get: Callable[[str], Any]) -> list[str]:
    """Problems of the ``layouts`` section (one line each, led by its key): a layout that is not the role's pool
    size, beyond the engine's abilities, a reference off the actor's training layout, a reward layout without
    ``reward_model.enable``, or a tp key that contradicts its layout."""
    given, problems = _given(get)
    for (role, phase), lay in given.items():
        key, ranks = f"layouts.{role}.{phase}", pool_ranks(get, role)
        if lay.size != ranks:
            problems.append(f"{key}: {lay.as_list()} is {lay.size} ranks, but the {role} runs on {ranks}")
        abilities = _abilities(get, role)
        reason = abilities and abilities.layout_reason(role, lay, generate=phase == "generate")
        if reason:
            problems.append(f"{key}: {lay.as_list()} cannot run: {reason}")
        for size_key, (what, value) in _layout_keys(get, role, phase, lay).items():
            if get(size_key) not in (1, value):
                problems.append(f"{key}: {what} {value} contradicts {size_key}={get(size_key)} (set one of them)")
    ref, train = given.get(("reference", "infer")), given.get(("actor", "train"))
    if ref and train and ref != train:
        problems.append(f"layouts.reference.infer: {ref.as_list()} differs from layouts.actor.train "
                        f"{train.as_list()}; the reference runs in the actor's process, on its training layout")
    if ("reward", "infer") in given and not get("reward_model.enable"):
        problems.append("layouts.reward.infer: given, but reward_model.enable is false (no reward model runs)")
    return problems


def apply_layouts(cfg: DictConfig, get: Callable[[str], Any]) -> list[str]:
    """Check ``cfg.layouts`` (:func:`layout_problems`) and, if it is sound, set the keys it decides (the tp keys,
    ``TP_KEYS``, or the engine's layout section; :func:`_layout_keys`) on ``cfg`` (still writable). Returns the
    problems (nothing is set when there are any)."""
    problems = layout_problems(get)
    if problems:
        return problems
    given, _ = _given(get)
    for (role, phase), lay in given.items():
        for size_key, (_, value) in _layout_keys(get, role, phase, lay).items():
            section, leaf = size_key.rsplit(".", 1)
            _section(cfg, section)[leaf] = value
    return []


def _section(cfg: DictConfig, dotted: str) -> DictConfig:
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node
