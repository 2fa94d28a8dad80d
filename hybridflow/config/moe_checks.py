"""The load-time checks of the mixture-of-experts keys (``actor_rollout_ref.actor.router_replay``): each problem is one
line naming the keys, as the other ``*_problems`` checks of :mod:`hybridflow.config.checks`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# what records and replays a routing today: the hf rollout records it, the fsdp2 engine replays it
RECORDING_ROLLOUTS = ("hf",)
REPLAYING_ENGINES = ("fsdp2",)


def router_replay_problems(get: Callable[[str], Any]) -> list[str]:
    """``router_replay=rollout`` needs a rollout that records the routing, and ``rollout`` or ``recompute`` an actor
    engine that replays it; otherwise the replay would silently not happen."""
    actor = "actor_rollout_ref.actor"
    mode = get(f"{actor}.router_replay")
    if mode not in ("rollout", "recompute"):
        return []
    problems = []
    rollout = get("actor_rollout_ref.rollout.name")
    if mode == "rollout" and rollout not in RECORDING_ROLLOUTS:
        problems.append(f"{actor}.router_replay=rollout needs a rollout that records the experts of each token "
                        f"({', '.join(RECORDING_ROLLOUTS)}), got actor_rollout_ref.rollout.name={rollout}")
    strategy = get(f"{actor}.strategy")
    if strategy not in REPLAYING_ENGINES:
        problems.append(f"{actor}.router_replay={mode} is replayed by the {', '.join(REPLAYING_ENGINES)} engine, "
                        f"got {actor}.strategy={strategy}")
    return problems
