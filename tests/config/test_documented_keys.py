"""Documented keys do what their doc says, or are gone: ``reward_model.compute_score`` loads a user function
(verl's custom reward function), ``reward_model.reward_manager`` is removed (unknown, with a hint), and
``actor_rollout_ref.actor.strategy`` accepts only the implemented engine."""

import numpy as np
import pytest
import torch

from hybridflow.config import load_config
from hybridflow.config.loader import ConfigError
from hybridflow.protocol import DataProto
from hybridflow.rewards import default_compute_score, load_compute_score
from hybridflow.rewards.batch import score_batch

USER_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str)) + (0.5 if data_source == "mine" else 0.0)

def exact(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip() == ground_truth)
'''


def _problems(*overrides):
    with pytest.raises(ConfigError) as info:
        load_config("quickstart", list(overrides))
    return info.value.problems


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(USER_REWARD)
    return path


def test_compute_score_loads_a_function_from_a_file_or_a_module(reward_file):
    assert load_compute_score("default") is default_compute_score
    fn = load_compute_score(str(reward_file))  # no :name -> compute_score, as verl's default name
    assert fn("mine", "abcd", "x") == 4.5 and fn("other", "ab", "x") == 2.0
    assert load_compute_score(f"{reward_file}:exact")("s", " 42 ", "42") == 1.0
    assert load_compute_score("hybridflow.rewards:default_compute_score") is default_compute_score


@pytest.mark.parametrize("spec, message", [
    ("nowhere/missing.py:fn", "no such file"),
    ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
    ("{file}:nope", "has no function 'nope'"),
])
def test_compute_score_errors_are_one_line_at_load(reward_file, spec, message):
    (problem,) = _problems(f"reward_model.compute_score={spec.format(file=reward_file)}")
    assert problem.startswith("reward_model.compute_score=") and message in problem and "\n" not in problem


def test_compute_score_file_path_is_made_absolute_at_load(reward_file, monkeypatch):
    monkeypatch.chdir(reward_file.parent)
    cfg = load_config("quickstart", ["reward_model.compute_score=my_reward.py:exact"])
    assert cfg.reward_model.compute_score == f"{reward_file}:exact"
    assert load_config("quickstart", ["reward_model.compute_score=my_reward.py"]).reward_model.compute_score \
        == f"{reward_file}:compute_score"


def test_score_batch_uses_the_user_function_for_every_row(reward_file):
    data = DataProto.from_dict(
        tensors={"responses": torch.zeros(3, 2, dtype=torch.long), "response_mask": torch.ones(3, 2)},
        non_tensors={"data_source": np.array(["mine", "unregistered/source", "mine"], dtype=object),
                     "ground_truth": np.array(["a", "b", "c"], dtype=object)})
    texts = ["x", "yy", "zzz"]
    # len(text) + 0.5 for data_source "mine"; an unregistered source is the user function's business
    assert score_batch(None, data, texts, compute_score=load_compute_score(str(reward_file))) == [1.5, 2.0, 3.5]
    with pytest.raises(ValueError, match="no reward registered for data_source"):
        score_batch(None, data, texts)  # the registry path still refuses it


def test_reward_manager_is_removed_with_a_hint():
    (problem,) = _problems("reward_model.reward_manager=naive")
    assert problem.startswith("reward_model.reward_manager: unknown key")
    assert "removed" in problem and "reward_model.compute_score" in problem


@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed", "FSDP2"])  # megatron is registered (issue 16)
def test_strategy_rejects_what_is_not_implemented(strategy):
    (problem,) = _problems(f"actor_rollout_ref.actor.strategy={strategy}")
    assert problem.startswith(f"actor_rollout_ref.actor.strategy: {strategy!r} is not implemented")
    assert "fsdp2" in problem


def test_strategy_fsdp2_loads():
    assert load_config("quickstart", ["actor_rollout_ref.actor.strategy=fsdp2"]).actor_rollout_ref.actor.strategy \
        == "fsdp2"


def test_node_ip_address_must_be_an_ip():
    (problem,) = _problems("trainer.ray_init.node_ip_address=localhost")
    assert problem.startswith("trainer.ray_init.node_ip_address: must be an IP address")
    assert load_config("quickstart", ["trainer.ray_init.node_ip_address=10.0.0.5"]).trainer.ray_init.node_ip_address \
        == "10.0.0.5"
