"""The load-time checks of the mixture-of-experts keys (``actor_rollout_ref.actor.router_replay``): each problem is one
line naming the keys, as the other ``*_problems`` checks of :mod:`hybridflow.config.checks`.

What records and replays a routing is registration metadata, not a name table here: a rollout backend registered
with ``records_routing=True`` (hf, vllm) records each token's experts; a training engine registered with
``router_replay=(modes...)`` replays them (fsdp2: ``rollout`` and ``recompute``; megatron: ``rollout``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridflow.config.checks import declared
from hybridflow.training import ENGINES


def _engine_replay_modes(engine: str) -> tuple[str, ...]:
    if engine not in ENGINES:  # reported by strategy_problems
        return ("rollout", "recompute")
    return tuple(ENGINES.meta(engine, "router_replay") or ())


def router_replay_problems(get: Callable[[str], Any]) -> list[str]:
    """``router_replay=rollout`` needs a rollout that records the routing, and ``rollout`` or ``recompute`` an actor
    engine that replays in that mode; otherwise the replay would silently not happen. Under Ulysses sequence
    parallelism each sp rank replays (and records) the routing of its slice of the sequence
    (:func:`hybridflow.training.ulysses.routing_index`); the router's load-balancing loss does not run with sp yet
    (each sp rank would balance its slice only)."""
    actor = "actor_rollout_ref.actor"
    mode = get(f"{actor}.router_replay")
    problems = []
    if get(f"{actor}.router_aux_loss_coef") and get(f"{actor}.ulysses_sequence_parallel_size") != 1:
        problems.append(f"{actor}.router_aux_loss_coef > 0 does not run with {actor}.ulysses_sequence_parallel_size "
                        "> 1 (each sp rank sees a slice of the sequence: not supported yet)")
    if mode not in ("rollout", "recompute"):
        return problems
    rollout = get("actor_rollout_ref.rollout.name")
    if mode == "rollout" and not declared("rollout", rollout, "records_routing", False):
        problems.append(f"{actor}.router_replay=rollout needs a rollout that records the experts of each token "
                        f"(registered with records_routing), got actor_rollout_ref.rollout.name={rollout}")
    strategy = get(f"{actor}.strategy")
    if mode not in _engine_replay_modes(strategy):
        problems.append(f"{actor}.router_replay={mode} is not replayed by the {strategy} engine ({actor}.strategy)")
    return problems
