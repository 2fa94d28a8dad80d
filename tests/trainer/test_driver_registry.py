"""The driver registry and contract without Ray: names, roles, checkpoint tables, features, and the consumers that
derive from it (resource-pool roles, the auto-mapper's emitter)."""

import pytest

from hybridflow.config import load_config
from hybridflow.mapping.abilities import ENGINE_ABILITIES
from hybridflow.mapping.emit import plan_to_config
from hybridflow.mapping.search import MappingSearch
from hybridflow.mapping.specs import Workload, get_model, parse_cluster
from hybridflow.protocol import DataProto
from hybridflow.registry import UnknownNameError
from hybridflow.trainer.driver import (Driver, all_checkpointed_roles, all_roles, driver_for_plan, driver_names,
                                       drivers_with, get_driver, register_driver)
from hybridflow.trainer.ppo import PPOTrainer

RECIPES = {"ppo": "quickstart", "remax": "remax_quickstart", "safe_rlhf": "safe_rlhf_quickstart",
           "async": "async_grpo_quickstart"}


class Stub:
    world_size = 1


def test_builtin_drivers_are_registered_in_order():
    assert driver_names()[:4] == ["ppo", "remax", "safe_rlhf", "async"]
    with pytest.raises(UnknownNameError, match=r"unknown driver 'remx'; known: .*remax.*did you mean 'remax'"):
        get_driver("remx")


def test_register_driver_rejects_a_class_that_is_no_driver():
    with pytest.raises(TypeError, match="subclass of hybridflow.trainer.driver.Driver"):
        register_driver("not_a_driver")(object)


@pytest.mark.parametrize("name", list(RECIPES))
def test_roles_and_checkpoint_tables_agree(name):
    cfg = load_config(RECIPES[name])
    cls = get_driver(name)
    roles = cls.roles(cfg)
    assert set(roles) <= set(cls.ROLES) and set(cls.CHECKPOINTED_ROLES) <= set(cls.ROLES)
    checkpointed = [r for r, spec in roles.items() if spec.checkpointed]
    assert set(checkpointed) <= set(cls.CHECKPOINTED_ROLES)
    driver = cls.build(cfg, {role: Stub() for role in roles})
    assert isinstance(driver, Driver)
    assert sorted(driver.checkpointed_groups()) == sorted(checkpointed)
    for role, spec in roles.items():  # every declared worker class imports and is a Worker
        from hybridflow.controller import Worker

        assert issubclass(spec.worker_class(), Worker), role


def test_role_sets_match_what_each_algorithm_trains():
    def roles(recipe, *extra):
        cfg = load_config(recipe, list(extra))
        return set(get_driver(cfg.algorithm.driver).roles(cfg))

    assert roles("quickstart") == {"actor", "reward", "critic"}
    assert roles("grpo_quickstart") == {"actor", "reward"}
    assert roles("safe_rlhf_quickstart") == {"actor", "reward", "critic", "cost_critic"}
    assert roles("async_grpo_quickstart") == {"actor", "reward", "generator"}
    assert set(all_roles()) >= {"actor", "critic", "reward", "reward_model", "cost_model", "cost_critic", "generator"}
    assert all_checkpointed_roles()[:3] == ("actor", "critic", "cost_critic")
    assert drivers_with("filter_groups") == ["ppo"] and drivers_with("bypass_old_log_prob")[:2] == ["ppo", "async"]


class RecordingActor:
    def __init__(self):
        self.calls = []

    def compute_ref_log_prob(self, batch):
        self.calls.append("ref")
        return DataProto.from_dict(tensors={"ref_log_prob": batch.batch["x"]})

    def compute_log_prob(self, batch):
        self.calls.append("old")
        return DataProto.from_dict(tensors={"old_log_probs": batch.batch["x"]})


@pytest.mark.parametrize("overrides, calls", [
    ([], ["ref", "old"]),  # the recipe subtracts a KL from the reward: both forwards
    (["algorithm.use_kl_in_reward=false"], ["old"]),  # no KL term reads the reference: not computed
    (["algorithm.use_kl_in_reward=false", "actor_rollout_ref.actor.use_kl_loss=true"], ["ref", "old"]),
])
def test_reference_logprobs_only_when_a_kl_term_uses_them(overrides, calls):
    import torch

    cfg = load_config("safe_rlhf_quickstart", overrides)
    actor = RecordingActor()
    driver = get_driver("safe_rlhf")(cfg, actor, None, None, None, None)
    driver.ppo.add_log_probs(DataProto.from_dict(tensors={"x": torch.zeros(2, 3)}))  # the phase its step runs
    assert actor.calls == calls


FSDP2 = ENGINE_ABILITIES["fsdp2"]  # the plans emitted must be within the engine's abilities


def test_emitted_plan_names_the_driver_and_maps_its_roles():
    cluster = parse_cluster("1x8:A100-80G")
    roles = ("actor", "critic", "reference", "reward", "cost", "cost_critic")
    models = {r: get_model("tiny-arith") for r in roles}  # fits on 8 devices within fsdp2's abilities
    workload = Workload(algorithm="safe-rlhf", prompt_len=64, response_len=64)
    plan = MappingSearch(models, workload, cluster, abilities=FSDP2).plan([list(roles)], [8])
    config, notes = plan_to_config(plan, cluster, workload)
    assert driver_for_plan("safe-rlhf") == "safe_rlhf" and config["algorithm"]["driver"] == "safe_rlhf"
    mapping = config["resource_pool"]["mapping"]
    assert mapping["cost_critic"] == mapping["actor"] and mapping["cost_model"] == mapping["actor"]
    assert not any("not mapped" in n for n in notes)
    remax_load = Workload(algorithm="remax", prompt_len=64, response_len=64)
    remax, _ = plan_to_config(MappingSearch({r: get_model("tiny-arith") for r in ("actor", "reference", "reward")},
                                            remax_load, cluster,
                                            abilities=FSDP2).plan([["actor", "reference", "reward"]], [8]),
                              cluster, remax_load)
    assert remax["algorithm"] == {"adv_estimator": "remax", "driver": "remax"}


def test_ppo_trainer_is_the_ppo_driver():
    assert get_driver("ppo") is PPOTrainer


@pytest.mark.parametrize("overrides, calls", [
    ([], ["ref", "old"]),  # KL in the reward and two mini-batches: both forwards
    # GRPO-style: KL loss, one update on fresh samples: pi_old is the update's own logprobs; the KL loss reads the
    # reference logprobs (the call's future goes to the update's ranks without a driver read)
    (["algorithm.use_kl_in_reward=false", "actor_rollout_ref.actor.use_kl_loss=true",
      "actor_rollout_ref.actor.ppo_mini_batch_size=32"], ["ref"]),
    # ... also when pi_old is the rollout's (bypass)
    (["algorithm.use_kl_in_reward=false", "actor_rollout_ref.actor.use_kl_loss=true",
      "actor_rollout_ref.actor.ppo_mini_batch_size=32", "algorithm.bypass_old_log_prob=true"], ["ref"]),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=32", "algorithm.use_kl_in_reward=false",
      "algorithm.recompute_old_log_prob=always"], ["old"]),
])
def test_ppo_driver_runs_the_forwards_a_term_reads(overrides, calls):
    import torch

    from hybridflow.trainer.ppo import PPOTrainer

    cfg = load_config("quickstart", overrides)  # train_batch_size 32
    actor = RecordingActor()
    batch = DataProto.from_dict(tensors={"x": torch.zeros(2, 3), "rollout_log_probs": torch.ones(2, 3)})
    PPOTrainer(cfg, actor, None, None).add_log_probs(batch)
    assert actor.calls == calls
    if cfg.algorithm.bypass_old_log_prob:  # pi_old is the sampling policy's
        assert torch.equal(batch.batch["old_log_probs"], torch.ones(2, 3))
