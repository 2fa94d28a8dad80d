"""The ``layouts`` section (written by ``hybridflow plan --emit-config``) as live config.

``layouts.<role>.<phase> = [pp, tp, dp]``, per role and phase: actor ``train`` and ``generate``, critic
``train``, reference ``infer``, reward (the reward model) ``infer``. At load (:func:`apply_layouts`, called by
``load_config`` before the semantic checks) each given layout is checked against the role's pool (pp·tp·dp = its
ranks) and the training engine's abilities (``hybridflow.mapping.abilities``: no pipeline parallelism, tensor
parallelism for the actor only, the reference on the actor's training layout), and applied: the actor's ``train``
tp becomes ``actor_rollout_ref.actor.tensor_model_parallel_size``, its ``generate`` tp
``actor_rollout_ref.rollout.tensor_model_parallel_size``; the workers then run dp = ranks / tp. A tp key set to
another value than its layout's (and than the default 1) is a conflict. The section's shape (phases, tp keys, the
pool of each role) is :mod:`hybridflow.mapping.layouts`; at start :func:`hybridflow.trainer.layouts.log_layouts` logs
what every role runs, (dp, tp, pp), and which of them came from ``layouts``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig

from hybridflow.mapping.abilities import ENGINE_ABILITIES
from hybridflow.mapping.cost import Layout
from hybridflow.mapping.layouts import PHASES, TP_KEYS, pool_ranks

__all__ = ["PHASES", "apply_layouts", "layout_problems"]


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
    abilities = ENGINE_ABILITIES.get(get("actor_rollout_ref.actor.strategy"))  # unknown: strategy_problems says
    for (role, phase), lay in given.items():
        key, ranks = f"layouts.{role}.{phase}", pool_ranks(get, role)
        if lay.size != ranks:
            problems.append(f"{key}: {lay.as_list()} is {lay.size} ranks, but the {role} runs on {ranks}")
        reason = abilities and abilities.layout_reason(role, lay, generate=phase == "generate")
        if reason:
            problems.append(f"{key}: {lay.as_list()} cannot run: {reason}")
        tp_key = TP_KEYS.get((role, phase))
        if tp_key and get(tp_key) not in (1, lay.tp):
            problems.append(f"{key}: tp {lay.tp} contradicts {tp_key}={get(tp_key)} (set one of them)")
    ref, train = given.get(("reference", "infer")), given.get(("actor", "train"))
    if ref and train and ref != train:
        problems.append(f"layouts.reference.infer: {ref.as_list()} differs from layouts.actor.train "
                        f"{train.as_list()}; the reference runs in the actor's process, on its training layout")
    if ("reward", "infer") in given and not get("reward_model.enable"):
        problems.append("layouts.reward.infer: given, but reward_model.enable is false (no reward model runs)")
    return problems


def apply_layouts(cfg: DictConfig, get: Callable[[str], Any]) -> list[str]:
    """Check ``cfg.layouts`` (:func:`layout_problems`) and, if it is sound, set the tp keys it decides
    (``TP_KEYS``) on ``cfg`` (still writable). Returns the problems (nothing is set when there are any)."""
    problems = layout_problems(get)
    if problems:
        return problems
    given, _ = _given(get)
    for (role, phase), tp_key in TP_KEYS.items():
        if (role, phase) in given:
            section, leaf = tp_key.rsplit(".", 1)
            _section(cfg, section)[leaf] = given[(role, phase)].tp
    return []


def _section(cfg: DictConfig, dotted: str) -> DictConfig:
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node
