"""Every registry of the package answers an unknown name with one error type (UnknownNameError: a UserError,
KeyError and ValueError) whose message lists the known names and the nearest one."""

import pytest

from hybridflow.errors import UserError
from hybridflow.registry import Registry, UnknownNameError


def _registries():
    import hybridflow.rollout  # noqa: F401  (registers hf and vllm)
    from hybridflow.algorithms import ADV_ESTIMATORS, POLICY_LOSSES
    from hybridflow.controller.dispatch import DISPATCH_MODES
    from hybridflow.rewards import REWARDS
    from hybridflow.rewards.cost import COSTS
    from hybridflow.rollout.base import ROLLOUTS

    return {"advantage estimator": ADV_ESTIMATORS, "policy loss": POLICY_LOSSES, "rollout backend": ROLLOUTS,
            "reward": REWARDS, "rule cost": COSTS, "dispatch mode": DISPATCH_MODES}


@pytest.mark.parametrize("kind", ["advantage estimator", "policy loss", "rollout backend", "reward", "rule cost",
                                  "dispatch mode"])
def test_unknown_name_lists_every_known_name(kind):
    registry = _registries()[kind]
    assert isinstance(registry, Registry) and len(registry) >= 1
    with pytest.raises(UnknownNameError) as err:
        registry.get("no-such-entry")
    assert isinstance(err.value, UserError) and isinstance(err.value, KeyError) and isinstance(err.value, ValueError)
    message = str(err.value)
    assert "'no-such-entry'" in message
    listed = message.split("; known: ", 1)[1]
    assert listed.split(" (did you mean")[0].split(", ") == registry.names()


@pytest.mark.parametrize("lookup,misspelt,nearest", [
    ("hybridflow.algorithms:get_adv_estimator_fn", "grpoo", "grpo"),
    ("hybridflow.algorithms:get_policy_loss_fn", "gspoo", "gspo"),
    ("hybridflow.rollout:get_rollout_class", "vlm", "vllm"),
    ("hybridflow.rewards:get_reward_fn", "openai/gsm8", "openai/gsm8k"),
    ("hybridflow.rewards.cost:get_cost_fn", "subtraction_before_last", "subtraction_before_last_step"),
    ("hybridflow.controller.dispatch:get_dispatch_mode", "ONE_TO_AL", "ONE_TO_ALL"),
])
def test_the_public_lookups_name_the_nearest(lookup, misspelt, nearest):
    import importlib

    module, name = lookup.split(":")
    with pytest.raises(UnknownNameError, match=f"did you mean {nearest!r}"):
        getattr(importlib.import_module(module), name)(misspelt)


def test_metadata_replaces_the_names():
    from hybridflow.algorithms import importance_weight_cap, needs_critic, needs_reward_baselines
    from hybridflow.rollout import registered_rollouts, rollout_meta, uses_hybrid_engine
    from types import SimpleNamespace

    assert [needs_critic(e) for e in ("gae", "grpo", "rloo", "remax")] == [True, False, False, False]
    assert needs_reward_baselines("remax") and not needs_reward_baselines("gae")
    assert uses_hybrid_engine("hf") and not uses_hybrid_engine("vllm")
    assert rollout_meta("vllm", "requires_package") == "vllm" and registered_rollouts(requires_package=None) == ["hf"]
    actor = SimpleNamespace(policy_loss="aipo", aipo_rho=4.0, tis_imp_ratio_cap=2.0)
    assert importance_weight_cap(actor) == 4.0  # AIPO's own cap wins over TIS
    actor.policy_loss = "vanilla"
    assert importance_weight_cap(actor) == 2.0
    actor.tis_imp_ratio_cap = -1
    assert importance_weight_cap(actor) is None


def test_config_checks_read_a_user_backends_metadata():
    """A backend registered in user code with ``requires_package`` is refused at load when that package is missing,
    with its own install hint (and the alternatives are the backends that need no package). No name of a built-in
    backend is involved."""
    from hybridflow.config import ConfigError, load_config
    from hybridflow.rollout import HFRollout, register_rollout
    from hybridflow.rollout.base import ROLLOUTS

    needs_pkg = register_rollout("test-needs-pkg", requires_package="hybridflow_no_such_package",
                                 install_hint={None: "pip install it-yourself"})(type("NeedsPkg", (HFRollout,), {}))
    try:
        with pytest.raises(ConfigError) as err:
            load_config("quickstart", ["actor_rollout_ref.rollout.name=test-needs-pkg"])
        assert err.value.problems == ["actor_rollout_ref.rollout.name: 'test-needs-pkg' is not installed "
                                      "(pip install it-yourself), or use actor_rollout_ref.rollout.name=hf"]
    finally:
        ROLLOUTS.unregister("test-needs-pkg")
    assert ROLLOUTS.names() == ["hf", "vllm"] and needs_pkg.__name__ == "NeedsPkg"


def test_declared_reads_an_unknown_name_as_the_default():
    """``Registry.declared`` is ``meta`` for checks that run beside the name check: an unknown (or unhashable) name
    gives the default instead of raising; ``need_critic_for`` (the trainer's and the config's one answer to "is a
    critic trained") builds on it."""
    from hybridflow.algorithms import ADV_ESTIMATORS, need_critic_for

    assert ADV_ESTIMATORS.declared("gae", "needs_values") is True
    assert ADV_ESTIMATORS.declared("nope", "needs_values", "dflt") == "dflt"
    assert ADV_ESTIMATORS.declared(["unhashable"], "needs_values") is None
    assert (need_critic_for(None, "gae"), need_critic_for(None, "grpo"), need_critic_for(None, "nope")) == \
        (True, False, False)
    assert (need_critic_for(False, "gae"), need_critic_for(True, "grpo")) == (False, True)
