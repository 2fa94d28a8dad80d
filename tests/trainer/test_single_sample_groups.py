"""A group-baseline estimator with one sample per prompt warns (every advantage would be 0); GAE does not."""

from __future__ import annotations

import logging

import pytest
import torch
from omegaconf import OmegaConf

from hybridflow.algorithms.advantage import get_adv_estimator_fn
from hybridflow.trainer.ppo import warn_single_sample_groups


def _config(estimator: str, n: int):
    return OmegaConf.create({"algorithm": {"adv_estimator": estimator}, "actor_rollout_ref": {"rollout": {"n": n}}})


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_group_estimators_warn_at_n_1_and_their_advantages_are_zero(estimator, caplog):
    with caplog.at_level(logging.WARNING, logger="hybridflow.trainer.ppo"):
        warn_single_sample_groups(_config(estimator, 1))
    assert "rollout.n=1" in caplog.text and estimator in caplog.text
    # the reason, computed: groups of one sample (distinct uids) with different scores get advantage 0
    rewards = torch.zeros(3, 4)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 0.5])
    adv, _ = get_adv_estimator_fn(estimator)(token_level_rewards=rewards, response_mask=torch.ones(3, 4),
                                             index=["a", "b", "c"])
    assert torch.all(adv == 0)


@pytest.mark.parametrize("estimator,n", [("grpo", 4), ("gae", 1), ("reinforce_plus_plus", 1)])
def test_no_warning_otherwise(estimator, n, caplog):
    with caplog.at_level(logging.WARNING, logger="hybridflow.trainer.ppo"):
        warn_single_sample_groups(_config(estimator, n))
    assert caplog.text == ""
