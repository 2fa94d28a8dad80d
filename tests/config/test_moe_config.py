"""The MoE keys at load: ``router_replay`` takes off | rollout | recompute, and a mode is refused in one line where the
rollout would not record the routing or the engine would not replay it in that mode; the router's load-balancing
loss is refused with Ulysses sp, routing replay is not (each sp rank replays its slice)."""

import pytest

from hybridflow.config import load_config
from hybridflow.config.loader import ConfigError
from hybridflow.rollout import HFRollout
from hybridflow.rollout.base import ROLLOUTS, register_rollout

REPLAY = "actor_rollout_ref.actor.router_replay"


def test_moe_recipe_loads_with_its_keys():
    cfg = load_config("moe_grpo_quickstart", [f"{REPLAY}=rollout"])
    assert cfg.actor_rollout_ref.actor.router_aux_loss_coef == 0.001
    assert cfg.actor_rollout_ref.actor.router_replay == "rollout"
    assert cfg.actor_rollout_ref.model.path == "builtin:tiny-moe"


@pytest.fixture
def no_routing_rollout():
    """A rollout registered without ``records_routing`` (both shipped rollouts, hf and vllm, record)."""
    register_rollout("test-no-routing")(type("NoRouting", (HFRollout,), {}))
    yield
    ROLLOUTS.pop("test-no-routing")


def test_both_rollouts_record_the_routing_for_replay():
    for rollout in ("hf", "vllm"):
        cfg = load_config("moe_grpo_quickstart", [f"{REPLAY}=rollout", f"actor_rollout_ref.rollout.name={rollout}"])
        assert cfg.actor_rollout_ref.rollout.name == rollout


@pytest.mark.parametrize("overrides, message", [
    ([f"{REPLAY}=sometimes"], "router_replay: 'sometimes' is not one of off, rollout, recompute"),
    ([f"{REPLAY}=rollout", "actor_rollout_ref.rollout.name=test-no-routing"],
     "router_replay=rollout needs a rollout that records the experts of each token (registered with "
     "records_routing), got actor_rollout_ref.rollout.name=test-no-routing"),
    ([f"{REPLAY}=recompute", "actor_rollout_ref.actor.strategy=megatron"],
     "router_replay=recompute is not replayed by the megatron engine"),
    (["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"],
     "router_aux_loss_coef > 0 does not run with actor_rollout_ref.actor.ulysses_sequence_parallel_size > 1"),
])
def test_bad_replay_settings_fail_at_load_in_one_line(overrides, message, no_routing_rollout):
    with pytest.raises(ConfigError) as err:
        load_config("moe_grpo_quickstart", overrides)
    assert message in str(err.value)


@pytest.mark.parametrize("mode", ["rollout", "recompute"])
def test_replay_loads_with_ulysses_sp(mode):
    cfg = load_config("moe_grpo_quickstart", [f"{REPLAY}={mode}", "actor_rollout_ref.actor.router_aux_loss_coef=0",
                                              "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"])
    assert cfg.actor_rollout_ref.actor.router_replay == mode
