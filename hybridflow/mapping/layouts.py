"""The shape of the config's ``layouts`` section, which the mapper writes (:mod:`hybridflow.mapping.emit`), the config
checks and applies at load (:mod:`hybridflow.config.layouts`) and the trainer logs at start
(:mod:`hybridflow.trainer.layouts`): ``layouts.<role>.<phase> = [pp, tp, dp]`` per role and phase, the config key
each tp sets, and the pool each role runs on. Pure Python, like the rest of the mapper.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["PHASES", "POOL_ROLES", "TP_KEYS", "pool_ranks"]

#: role -> its phases in ``layouts``
PHASES = {"actor": ("train", "generate"), "critic": ("train",), "reference": ("infer",), "reward": ("infer",)}
#: (role, phase) -> the config key its tp sets
TP_KEYS = {("actor", "train"): "actor_rollout_ref.actor.tensor_model_parallel_size",
           ("actor", "generate"): "actor_rollout_ref.rollout.tensor_model_parallel_size"}
#: layouts role -> the resource_pool.mapping role whose pool it runs on
POOL_ROLES = {"actor": "actor", "reference": "actor", "critic": "critic", "reward": "reward_model"}


def pool_ranks(get: Callable[[str], Any], role: str) -> int:
    """Ranks of the pool the layouts role ``role`` runs on (a role not mapped follows the actor; no pools: the whole
    cluster, ``trainer.n_gpus_per_node * trainer.nnodes``); ``get(dotted key) -> value`` reads the config.

    Raises:
        KeyError: ``role`` is not a key of ``POOL_ROLES``.
    """
    pools, mapping = get("resource_pool.pools"), dict(get("resource_pool.mapping") or {})
    pool = mapping.get(POOL_ROLES[role], mapping.get("actor", "global_pool"))
    if pools and pool in pools:
        return sum(pools[pool])
    return get("trainer.n_gpus_per_node") * get("trainer.nnodes")
