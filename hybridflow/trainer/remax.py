"""The ReMax driver (Li et al. 2023, arXiv 2310.10505, Algorithm 1): REINFORCE whose baseline is the reward of
the greedy response to the same prompt. No critic.

One step = sample n responses per prompt -> greedy response per prompt -> reward both (the greedy reward is
the baseline) -> reference logprobs -> old logprobs -> KL-in-reward -> advantages (``remax``: return minus
baseline) -> update actor. Checkpoints, validation and resume are the PPO trainer's.
"""

from __future__ import annotations

import torch

from hybridflow.protocol import DataProto
from hybridflow.trainer.ppo import PPOTrainer
from hybridflow.utils.timer import timer


class ReMaxTrainer:
    """Args:
        config: the validated run config (``algorithm.driver=remax``; usually ``adv_estimator=remax``: any
            estimator may read the ``reward_baselines`` this driver adds).
        actor: the actor(+rollout+ref) worker group.
        reward: the reward (rule-reward group or :class:`~hybridflow.trainer.scoring.RewardScorer`).
        tracker: a :class:`~hybridflow.utils.tracking.Tracking`.
    """

    def __init__(self, config, actor, reward, tracker) -> None:
        self.config, self.actor, self.reward = config, actor, reward
        self.ppo = PPOTrainer(config, actor, None, reward, tracker)

    def fit(self, train_batches, val_data, total_steps: int) -> dict:
        """:meth:`PPOTrainer.fit` with this driver's step."""
        return self.ppo.fit(train_batches, val_data, total_steps, driver=self)

    def validate(self, val_data: DataProto) -> dict[str, float]:
        return self.ppo.validate(val_data)

    def step(self, batch: DataProto) -> dict[str, float]:
        """One ReMax iteration on a batch of B prompts; returns its metrics."""
        n, t = self.config.actor_rollout_ref.rollout.n, {}
        prompts = self.ppo.pop_prompts(batch)
        with timer("step", t):
            with timer("gen", t):
                gen = self.actor.generate_sequences(prompts)
            with timer("gen_greedy", t):
                baselines = self.greedy_baselines(prompts, batch)
            sync = gen.meta_info.pop("sync_metrics", {})  # LoRA: the rollout's weights checked (sync/verified)
            batch = batch.repeat(n, interleave=True).union(gen)
            batch.batch["reward_baselines"] = baselines.repeat_interleave(n)
            metrics = self.ppo.train_on(batch, t)  # reward, ref, old logprobs, advantages, actor update
            metrics.update(sync)
        metrics["remax/baseline_score/mean"] = baselines.mean().item()
        return self.ppo.step_metrics(batch, metrics, t)

    def greedy_baselines(self, prompts: DataProto, rows: DataProto) -> torch.Tensor:
        """(B,) fp32: the reward of the greedy response to each of the B ``prompts`` (whose ground truths are
        the non-tensor columns of ``rows``, one row per prompt): ReMax's baseline ``r(x, y_greedy)``."""
        greedy = self.actor.generate_sequences(DataProto(batch=prompts.batch, meta_info={"do_sample": False, "n": 1}))
        scored = DataProto(batch=greedy.batch, non_tensor_batch=rows.non_tensor_batch)
        return self.reward.compute_rm_score(scored).batch["token_level_scores"].sum(-1)
