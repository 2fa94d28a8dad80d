"""The ``layouts`` section is live config (issue 15 item 3): applied at load to the tp keys the workers read,
checked against the role's pool and the engine's abilities, and logged per role at start."""

import logging

import pytest

from hybridflow.config import ConfigError, load_config
from hybridflow.trainer.layouts import log_layouts, run_layouts

TP = "actor_rollout_ref.actor.tensor_model_parallel_size"
TP_G = "actor_rollout_ref.rollout.tensor_model_parallel_size"
FOUR = ["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "critic.ppo_micro_batch_size_per_gpu=4"]  # quickstart's mini-batches of 16 split over 4 ranks


def _problems(*overrides):
    with pytest.raises(ConfigError) as err:
        load_config("quickstart", list(overrides))
    return err.value.problems


def test_actor_layouts_set_the_tp_keys_the_workers_read():
    cfg = load_config("quickstart", FOUR + ["layouts.actor={train: [1,2,2], generate: [1,4,1]}",
                                            "layouts.reference.infer=[1,2,2]"])
    assert cfg.actor_rollout_ref.actor.tensor_model_parallel_size == 2
    assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 4
    # dp = ranks / tp on the actor's 4 ranks; the reference runs on the actor's training mesh
    assert run_layouts(cfg)["actor"] == {"train": (2, 2, 1), "generate": (1, 4, 1)}
    assert run_layouts(cfg)["reference"] == {"infer": (2, 2, 1)}


def test_without_layouts_nothing_changes():
    cfg = load_config("quickstart")
    assert (cfg.actor_rollout_ref.actor.tensor_model_parallel_size,
            cfg.actor_rollout_ref.rollout.tensor_model_parallel_size) == (1, 1)
    assert run_layouts(cfg) == {"actor": {"train": (2, 1, 1), "generate": (2, 1, 1)},
                                "reference": {"infer": (2, 1, 1)}, "critic": {"train": (2, 1, 1)}}


def test_layout_must_be_its_pools_ranks():
    pools = ["resource_pool.pools={a: [2], c: [2]}", "resource_pool.mapping={actor: a, critic: c, reward: a}"]
    problems = _problems(*FOUR, *pools, "layouts.actor.train=[1,1,4]", "layouts.critic.train=[1,1,2]")
    assert problems == ["layouts.actor.train: [1, 1, 4] is 4 ranks, but the actor runs on 2"], problems
    load_config("quickstart", FOUR + pools + ["layouts.actor.train=[1,1,2]", "layouts.critic.train=[1,1,2]"])


@pytest.mark.parametrize("override, message", [
    ("layouts.critic.train=[2,1,1]", "layouts.critic.train: [2, 1, 1] cannot run: pp > 1: fsdp2 has no pipeline"),
    ("layouts.actor.train=[2,1,1]", "layouts.actor.train: [2, 1, 1] cannot run: pp > 1"),
    ("layouts.actor.generate=[2,1,1]", "layouts.actor.generate: [2, 1, 1] cannot run: pp > 1: fsdp2 has no "
                                       "pipeline parallelism for generation"),
    ("layouts.critic.train=[1,2,1]", "layouts.critic.train: [1, 2, 1] cannot run: tp > 1 for critic"),
    ("layouts.actor.infer=[1,1,2]", "layouts.actor.infer: actor has no phase 'infer'"),
    ("layouts.actor.train=[1,2]", "layouts.actor.train: expected [pp, tp, dp]"),
    ("layouts.reward.infer=[1,1,2]", "layouts.reward.infer: given, but reward_model.enable is false"),
])
def test_layouts_beyond_the_engine_or_malformed_are_refused(override, message):
    problems = _problems(override)
    assert any(p.startswith(message) for p in problems), problems


def test_reference_must_follow_the_actor_and_tp_keys_must_agree():
    problems = _problems("layouts.actor.train=[1,2,1]", "layouts.reference.infer=[1,1,2]")
    assert any(p.startswith("layouts.reference.infer: [1, 1, 2] differs from layouts.actor.train [1, 2, 1]")
               for p in problems), problems
    problems = _problems(f"{TP}=1", f"{TP_G}=2", "layouts.actor={train: [1,2,1], generate: [1,1,2]}")
    assert any(p.startswith(f"layouts.actor.generate: tp 1 contradicts {TP_G}=2") for p in problems), problems
    cfg = load_config("quickstart", ["layouts.actor.train=[1,2,1]", f"{TP}=2"])  # agreeing is fine
    assert cfg.actor_rollout_ref.actor.tensor_model_parallel_size == 2


def test_log_names_every_role_and_marks_the_planned_ones(caplog):
    cfg = load_config("quickstart", FOUR + ["layouts.actor.train=[1,2,2]"])
    with caplog.at_level(logging.INFO, logger="hybridflow.trainer.layouts"):
        line = log_layouts(cfg)
    assert line == ("parallel layouts: actor train (dp=2, tp=2, pp=1) planned; actor generate (dp=4, tp=1, pp=1); "
                    "reference infer (dp=2, tp=2, pp=1); critic train (dp=4, tp=1, pp=1)")
    assert line in caplog.text


def test_log_shows_ulysses_sp_where_a_role_splits_sequences():
    # 4 ranks: the actor (and the reference on its layout) as dp=2 x sp=2, the critic as dp=1 x sp=4; generation
    # never splits sequences
    cfg = load_config("quickstart", FOUR + ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                                            "critic.ulysses_sequence_parallel_size=4"])
    assert log_layouts(cfg) == ("parallel layouts: actor train (dp=2, tp=1, pp=1, sp=2); actor generate (dp=4, tp=1, "
                                "pp=1); reference infer (dp=2, tp=1, pp=1, sp=2); critic train (dp=1, tp=1, pp=1, "
                                "sp=4)")
