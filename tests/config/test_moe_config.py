"""The MoE keys at load: ``router_replay`` takes off | rollout | recompute, and a mode is refused in one line where the
rollout would not record the routing or the engine would not replay it in that mode; the router's load-balancing
loss is refused with Ulysses sp, routing replay is not (each sp rank replays its slice)."""

import pytest

from hybridflow.config import load_config
from hybridflow.config.loader import ConfigError

REPLAY = "actor_rollout_ref.actor.router_replay"


def test_moe_recipe_loads_with_its_keys():
    cfg = load_config("moe_grpo_quickstart", [f"{REPLAY}=rollout"])
    assert cfg.actor_rollout_ref.actor.router_aux_loss_coef == 0.001
    assert cfg.actor_rollout_ref.actor.router_replay == "rollout"
    assert cfg.actor_rollout_ref.model.path == "builtin:tiny-moe"


@pytest.mark.parametrize("overrides, message", [
    ([f"{REPLAY}=sometimes"], "router_replay: 'sometimes' is not one of off, rollout, recompute"),
    ([f"{REPLAY}=rollout", "actor_rollout_ref.rollout.name=vllm"],
     "router_replay=rollout needs a rollout that records the experts of each token (registered with "
     "records_routing), got actor_rollout_ref.rollout.name=vllm"),
    ([f"{REPLAY}=recompute", "actor_rollout_ref.actor.strategy=megatron"],
     "router_replay=recompute is not replayed by the megatron engine"),
    (["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"],
     "router_aux_loss_coef > 0 does not run with actor_rollout_ref.actor.ulysses_sequence_parallel_size > 1"),
])
def test_bad_replay_settings_fail_at_load_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config("moe_grpo_quickstart", overrides)
    assert message in str(err.value)


@pytest.mark.parametrize("mode", ["rollout", "recompute"])
def test_replay_loads_with_ulysses_sp(mode):
    cfg = load_config("moe_grpo_quickstart", [f"{REPLAY}={mode}", "actor_rollout_ref.actor.router_aux_loss_coef=0",
                                              "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"])
    assert cfg.actor_rollout_ref.actor.router_replay == mode
