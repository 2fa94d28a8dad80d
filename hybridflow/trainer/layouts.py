"""What every role runs, (dp, tp, pp) per phase, logged at start (:func:`log_layouts`, called when the worker groups
are spawned) with the entries the ``layouts`` section planned marked: the section's shape is
:mod:`hybridflow.mapping.layouts`; the config checks and applies it at load (:mod:`hybridflow.config.layouts`).
"""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import DictConfig

from hybridflow.algorithms import need_critic_for
from hybridflow.mapping.layouts import PHASES, TP_KEYS, pool_ranks
from hybridflow.training import engine_layout

__all__ = ["log_layouts", "run_layouts"]

logger = logging.getLogger(__name__)


def _select(config: DictConfig, dotted: str) -> Any:
    node = config
    for part in dotted.split("."):
        node = node[part]
    return node


def run_layouts(config: DictConfig) -> dict[str, dict[str, tuple[int, int, int]]]:
    """(dp, tp, pp) per role and phase that the workers of ``config`` (a loaded config) run (the roles that run: the
    critic when trained, the reward model when enabled).

    Raises:
        KeyError: ``config`` lacks a key of the loaded schema (not a loaded config).
    """
    def get(path: str) -> Any:
        return _select(config, path)

    actor = pool_ranks(get, "actor")
    tp, tp_g = (get(k) for k in TP_KEYS.values())
    section = config.actor_rollout_ref.actor
    train = engine_layout(section.strategy, section, actor, tp, section.ulysses_sequence_parallel_size)  # strategy=megatron: actor.megatron's tp x pp
    out = {"actor": {"train": (train.dp, train.tp, train.pp), "generate": (actor // tp_g, tp_g, 1)},
           "reference": {"infer": (train.dp, train.tp, train.pp)}}
    if need_critic_for(config.critic.enable, config.algorithm.adv_estimator):
        critic = engine_layout(config.critic.strategy, config.critic, pool_ranks(get, "critic"),
                               sp=config.critic.ulysses_sequence_parallel_size)
        out["critic"] = {"train": (critic.dp, critic.tp, critic.pp)}
    if config.reward_model.enable:
        out["reward"] = {"infer": (pool_ranks(get, "reward"), 1, 1)}
    return out


def _sequence_parallel(config: DictConfig) -> dict[str, int]:
    """Ulysses sp per role of its training / inference forwards (the reference runs on the actor's layout; generation
    never splits sequences)."""
    actor = config.actor_rollout_ref.actor.ulysses_sequence_parallel_size
    return {"actor": actor, "reference": actor, "critic": config.critic.ulysses_sequence_parallel_size}


def log_layouts(config: DictConfig) -> str:
    """Log (and return) the layout of every role as (dp, tp, pp), with ``sp`` where a role's forwards split each
    sequence over more than one Ulysses rank (then dp x sp x tp x pp is its ranks), marking those set by the
    ``layouts`` section.

    Raises:
        KeyError: as :func:`run_layouts`.
    """
    planned = {(r, p) for r, phases in PHASES.items() for p in (config.layouts.get(r) or {})}
    sp_of = _sequence_parallel(config)
    parts = []
    for role, phases in run_layouts(config).items():
        for phase, (dp, tp, pp) in phases.items():
            mark = " planned" if (role, phase) in planned else ""
            sp = sp_of.get(role, 1) if phase != "generate" else 1
            parts.append(f"{role} {phase} (dp={dp}, tp={tp}, pp={pp}{f', sp={sp}' if sp > 1 else ''}){mark}")
    line = "parallel layouts: " + "; ".join(parts)
    logger.info(line)
    return line
