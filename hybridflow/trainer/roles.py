"""The worker-group roles of the PPO family of drivers (PPO, ReMax, Safe-RLHF, async): which worker class each role
runs and which inputs it is built from."""

from __future__ import annotations

from typing import Any

from hybridflow.trainer.driver import Role
from hybridflow.trainer.worker_inputs import actor_args, critic_args, rule_reward_args, score_model_args

__all__ = ["ACTOR", "CRITIC", "RULE_REWARD", "SCORE_MODEL", "common_roles"]

ACTOR = "hybridflow.workers.actor_worker:ActorRolloutRefWorker"
CRITIC = "hybridflow.workers.critic_worker:CriticWorker"
RULE_REWARD = "hybridflow.workers.reward_worker:RuleRewardWorker"
SCORE_MODEL = "hybridflow.workers.rm_worker:RewardModelWorker"


def common_roles(config: Any, actor_role: str = "actor_rollout_ref") -> dict[str, Role]:
    """The roles of the PPO family: ``actor`` (its worker role ``actor_role``: with the rollout, or ``actor_ref``
    when generators sample), ``reward`` (rule reward and rule cost), ``critic`` when
    :func:`~hybridflow.algorithms.need_critic_for` (``critic.enable``, ``algorithm.adv_estimator``),
    ``reward_model`` with ``reward_model.enable``."""
    from hybridflow.algorithms import need_critic_for

    roles = {"actor": Role(ACTOR, actor_args, (actor_role,), checkpointed=True,
                           strategy_key="actor_rollout_ref.actor.strategy"),
             "reward": Role(RULE_REWARD, rule_reward_args)}
    if need_critic_for(config.critic.enable, config.algorithm.adv_estimator):
        roles["critic"] = Role(CRITIC, critic_args, checkpointed=True, strategy_key="critic.strategy")
    if config.reward_model.enable:
        roles["reward_model"] = Role(SCORE_MODEL, score_model_args, ("reward_model",),
                                     strategy_key="reward_model.strategy")
    return roles
