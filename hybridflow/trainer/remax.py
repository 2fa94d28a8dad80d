"""The ReMax driver (Li et al. 2023, arXiv 2310.10505, Algorithm 1): REINFORCE whose baseline is the reward of
the greedy response to the same prompt. No critic.

One step = sample n responses per prompt -> greedy response per prompt -> reward both (the greedy reward is
the baseline) -> reference logprobs -> old logprobs -> KL-in-reward -> advantages (``remax``: return minus
baseline) -> update actor. The phases after generation are the PPO driver's (:meth:`PPOTrainer.train_on`).
"""

from __future__ import annotations

from typing import Any

import torch

from hybridflow.protocol import DataProto
from hybridflow.trainer.driver import Driver, Get, Role, register_driver
from hybridflow.trainer.ppo import PPOTrainer, SharedWithPPO, common_roles
from hybridflow.utils.timer import timer


@register_driver("remax", owns_estimators={"remax": "it generates the greedy baseline"}, planned_as=("remax",),
                 trains_on_current_samples=True)
class ReMaxTrainer(Driver):
    """Args:
        config: the validated run config (``algorithm.driver=remax``; usually ``adv_estimator=remax``: any
            estimator may read the ``reward_baselines`` this driver adds).
        actor: the actor(+rollout+ref) worker group.
        reward: the reward (rule-reward group or :class:`~hybridflow.trainer.scoring.RewardScorer`).
    """

    ROLES = ("actor", "reward", "reward_model")
    CHECKPOINTED_ROLES = ("actor",)
    global_step = SharedWithPPO()
    data = SharedWithPPO()

    def __init__(self, config: Any, actor: Any, reward: Any) -> None:
        self.config, self.actor, self.reward = config, actor, reward
        self.ppo = PPOTrainer(config, actor, None, reward)

    @classmethod
    def roles(cls, config: Any) -> dict[str, Role]:
        return common_roles(config)  # the config check makes sure no critic is asked for

    @classmethod
    def config_problems(cls, get: Get) -> list[str]:
        """ReMax trains no critic."""
        from hybridflow.algorithms import need_critic_for

        estimator = get("algorithm.adv_estimator")
        if not need_critic_for(get("critic.enable"), estimator):
            return []
        return [f"algorithm.driver=remax trains no critic: use a critic-free estimator (remax) and leave "
                f"critic.enable unset, got algorithm.adv_estimator={estimator}, critic.enable={get('critic.enable')}"]

    @classmethod
    def build(cls, config: Any, groups: dict[str, Any]) -> "ReMaxTrainer":
        from hybridflow.trainer.scoring import build_reward

        return cls(config, groups["actor"], build_reward(groups, config))

    def checkpointed_groups(self) -> dict[str, Any]:
        return self.ppo.checkpointed_groups()

    def checkpointed_state(self) -> dict[str, Any]:
        return self.ppo.checkpointed_state()

    def validate(self, val_data: DataProto) -> dict[str, float]:
        return self.ppo.validate(val_data)

    def step(self, batch: DataProto) -> dict[str, float]:
        """One ReMax iteration on a batch of B prompts (Algorithm 1: sample, greedy-decode, reward both, the greedy
        reward is the baseline); returns its metrics."""
        n, t = self.config.actor_rollout_ref.rollout.n, {}
        with timer("step", t):
            prompts = self.ppo.pop_prompts(batch)
            sampled = self.actor.generate_sequences(prompts)  # n responses per prompt
            with timer("gen_greedy", t):
                baselines = self.greedy_baselines(prompts, batch)
            batch = batch.repeat(n, interleave=True).union(sampled)
            batch.batch["reward_baselines"] = baselines.repeat_interleave(n)
            metrics = self.ppo.train_on(batch, t)  # reward, ref, old logprobs, advantages, actor update
        metrics["remax/baseline_score/mean"] = baselines.mean().item()
        return self.ppo.step_metrics(batch, metrics, t)

    def greedy_baselines(self, prompts: DataProto, rows: DataProto) -> torch.Tensor:
        """(B,) fp32: the reward of the greedy response to each of the B ``prompts`` (whose ground truths are
        the non-tensor columns of ``rows``, one row per prompt): ReMax's baseline ``r(x, y_greedy)``."""
        greedy = self.actor.generate_sequences(DataProto(batch=prompts.batch, non_tensor_batch=prompts.non_tensor_batch,
                                                         meta_info={"do_sample": False, "n": 1}))  # + a VLM's images
        scored = DataProto(batch=greedy.batch, non_tensor_batch=rows.non_tensor_batch)
        return self.reward.compute_rm_score(scored).batch["token_level_scores"].sum(-1)
