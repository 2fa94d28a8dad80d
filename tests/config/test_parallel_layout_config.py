"""Config keys of the actor's training layout and generation layout (3D-HybridEngine), validated at load."""

import pytest

from hybridflow.config import ConfigError, load_config

TP = "actor_rollout_ref.actor.tensor_model_parallel_size"
TP_G = "actor_rollout_ref.rollout.tensor_model_parallel_size"


def _problems(*overrides):
    with pytest.raises(ConfigError) as err:
        load_config("quickstart", list(overrides))
    return err.value.problems


def test_defaults_keep_one_layout():
    cfg = load_config("quickstart")
    assert cfg.actor_rollout_ref.actor.tensor_model_parallel_size == 1
    assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 1
    assert cfg.actor_rollout_ref.rollout.update_weights_bucket_megabytes == 64


@pytest.mark.parametrize("tp,tp_g", [(2, 1), (1, 2), (2, 2)])
def test_layouts_that_fit_two_ranks(tp, tp_g):
    cfg = load_config("quickstart", [f"{TP}={tp}", f"{TP_G}={tp_g}"])
    assert (cfg.actor_rollout_ref.actor.tensor_model_parallel_size,
            cfg.actor_rollout_ref.rollout.tensor_model_parallel_size) == (tp, tp_g)


def test_tp_must_divide_the_actor_ranks():
    problems = _problems(f"{TP}=3", f"{TP_G}=4")
    assert any(p.startswith(f"{TP} (3) must divide the 2 actor ranks") for p in problems), problems
    assert any(p.startswith(f"{TP_G} (4) must divide the 2 actor ranks") for p in problems), problems


def test_tp_sizes_must_divide_one_another():
    problems = _problems("trainer.n_gpus_per_node=6", "data.train_batch_size=48",
                         "actor_rollout_ref.actor.ppo_mini_batch_size=24", "critic.ppo_mini_batch_size=24",
                         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                         "critic.ppo_micro_batch_size_per_gpu=4", f"{TP}=2", f"{TP_G}=3")
    assert problems == [f"{TP} (2) and {TP_G} (3) must divide one another"]


def test_actor_pool_size_counts():
    problems = _problems("resource_pool.pools={actor_pool: [4], other: [2]}",
                         "resource_pool.mapping={actor: actor_pool}", f"{TP}=3")
    assert any("the 4 ranks of resource pool 'actor_pool'" in p for p in problems), problems


@pytest.mark.parametrize("key", [TP, TP_G, "actor_rollout_ref.rollout.update_weights_bucket_megabytes"])
def test_sizes_must_be_positive(key):
    assert _problems(f"{key}=0") == [f"{key}: must be >= 1, got 0"]
