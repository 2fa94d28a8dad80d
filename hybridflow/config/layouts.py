"""The ``layouts`` section (written by ``hybridflow plan --emit-config``) as live config.

``layouts.<role>.<phase> = [pp, tp, dp]``, per role and phase: actor ``train`` and ``generate``, critic
``train``, reference ``infer``, reward (the reward model) ``infer``. At load (:func:`apply_layouts`, called by
``load_config`` before the semantic checks) each given layout is checked against the role's pool (pp·tp·dp = its
ranks) and the training engine's abilities (``hybridflow.mapping.abilities``: no pipeline parallelism, tensor
parallelism for the actor only, the reference on the actor's training layout), and applied: the actor's ``train``
tp becomes ``actor_rollout_ref.actor.tensor_model_parallel_size``, its ``generate`` tp
``actor_rollout_ref.rollout.tensor_model_parallel_size``; the workers then run dp = ranks / tp. A tp key set to
another value than its layout's (and than the default 1) is a conflict. At start :func:`log_layouts` logs what
every role runs, (dp, tp, pp), and which of them came from ``layouts``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig

from hybridflow.mapping.abilities import ENGINE_ABILITIES
from hybridflow.mapping.cost import Layout

__all__ = ["PHASES", "apply_layouts", "layout_problems", "log_layouts", "run_layouts"]

logger = logging.getLogger(__name__)

#: role -> its phases in ``layouts``
PHASES = {"actor": ("train", "generate"), "critic": ("train",), "reference": ("infer",), "reward": ("infer",)}
#: (role, phase) -> the config key its tp sets
TP_KEYS = {("actor", "train"): "actor_rollout_ref.actor.tensor_model_parallel_size",
           ("actor", "generate"): "actor_rollout_ref.rollout.tensor_model_parallel_size"}
#: layouts role -> the resource_pool.mapping role whose pool it runs on
POOL_ROLES = {"actor": "actor", "reference": "actor", "critic": "critic", "reward": "reward_model"}


def _pool_ranks(get: Callable[[str], Any], role: str) -> int:
    """Ranks of the pool ``role`` runs on (a role not mapped follows the actor; no pools: the whole cluster)."""
    pools, mapping = get("resource_pool.pools"), dict(get("resource_pool.mapping") or {})
    pool = mapping.get(POOL_ROLES[role], mapping.get("actor", "global_pool"))
    if pools and pool in pools:
        return sum(pools[pool])
    return get("trainer.n_gpus_per_node") * get("trainer.nnodes")


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
        key, ranks = f"layouts.{role}.{phase}", _pool_ranks(get, role)
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


def run_layouts(config: DictConfig) -> dict[str, dict[str, tuple[int, int, int]]]:
    """(dp, tp, pp) per role and phase that the workers of ``config`` run (the roles that run: the critic when
    trained, the reward model when enabled)."""
    from hybridflow.config.checks import need_critic_for

    def get(path: str) -> Any:
        return _section(config, path)

    from hybridflow.training import engine_layout

    actor = _pool_ranks(get, "actor")
    tp, tp_g = (get(k) for k in TP_KEYS.values())
    section = config.actor_rollout_ref.actor
    train = engine_layout(section.strategy, section, actor, tp)  # strategy=megatron: actor.megatron's tp x pp
    out = {"actor": {"train": (train.dp, train.tp, train.pp), "generate": (actor // tp_g, tp_g, 1)},
           "reference": {"infer": (train.dp, train.tp, train.pp)}}
    if need_critic_for(config.critic.enable, config.algorithm.adv_estimator):
        critic = engine_layout(config.critic.strategy, config.critic, _pool_ranks(get, "critic"))
        out["critic"] = {"train": (critic.dp, critic.tp, critic.pp)}
    if config.reward_model.enable:
        out["reward"] = {"infer": (_pool_ranks(get, "reward"), 1, 1)}
    return out


def log_layouts(config: DictConfig) -> str:
    """Log (and return) the layout of every role as (dp, tp, pp), marking those set by the ``layouts`` section."""
    planned = {(r, p) for r, phases in PHASES.items() for p in (config.layouts.get(r) or {})}
    parts = []
    for role, phases in run_layouts(config).items():
        for phase, (dp, tp, pp) in phases.items():
            mark = " planned" if (role, phase) in planned else ""
            parts.append(f"{role} {phase} (dp={dp}, tp={tp}, pp={pp}){mark}")
    line = "parallel layouts: " + "; ".join(parts)
    logger.info(line)
    return line
