"""The Safe-RLHF driver (Dai et al. 2023, arXiv 2310.12773, sec. 3.3 and appendix eq. 30-31): PPO on the
Lagrangian of "maximize reward subject to mean cost <= threshold", with a reward critic and a cost critic.

One step = generate -> reward -> cost -> reference logprobs -> old logprobs -> reward values and cost values
-> KL subtracted from the reward and added to the cost -> GAE for each -> lambda update on the episode costs
-> advantage (A_r - lambda * A_c) / (1 + lambda) -> update both critics -> update actor.

The two GAE advantages are taken raw (returns minus values, not whitened one by one, so that their ratio keeps
the units lambda is measured in); their combination is whitened over the batch like the PPO driver's GAE
advantages, which rescales the step by a positive factor and shifts it, and keeps the Lagrangian's direction.
Checkpoints carry the cost critic and the multiplier; validation also reports ``val/cost``.
"""

from __future__ import annotations

from hybridflow.algorithms import LagrangeMultiplier, compute_safe_rlhf_advantage, get_adv_estimator_fn, masked_whiten
from hybridflow.protocol import DataProto
from hybridflow.trainer.ppo import PPOTrainer, absorb_metrics
from hybridflow.trainer.steps import apply_kl_penalty
from hybridflow.trainer.validate import validate
from hybridflow.utils.timer import timer

_CRITIC_INPUTS = ["input_ids", "attention_mask", "position_ids", "responses", "response_mask"]


class SafeRLHFTrainer:
    """Args:
        config: the validated run config (``algorithm.driver=safe_rlhf``, ``adv_estimator=gae``; the multiplier
            from ``algorithm.lagrangian``).
        actor: the actor(+rollout+ref) worker group.
        critic: the reward critic group; cost_critic: the cost critic group (both ``CriticWorker``).
        reward: the reward (rule-reward group or :class:`~hybridflow.trainer.scoring.RewardScorer`).
        cost: a :class:`~hybridflow.trainer.scoring.CostScorer`.
        tracker: a :class:`~hybridflow.utils.tracking.Tracking`.
    """

    def __init__(self, config, actor, critic, cost_critic, reward, cost, tracker) -> None:
        self.config, self.actor, self.critic, self.cost_critic = config, actor, critic, cost_critic
        self.reward, self.cost = reward, cost
        lag = config.algorithm.lagrangian
        self.lagrange = LagrangeMultiplier(lag.lambda_init, lag.lambda_lr, lag.threshold, lag.lambda_max,
                                           lag.episode_cost_window_size, min_lambda=lag.lambda_min)
        self.ppo = PPOTrainer(config, actor, critic, reward, tracker)
        self.ppo.checkpointed_groups["cost_critic"] = cost_critic
        self.ppo.checkpointed_state["lagrange"] = self.lagrange

    def fit(self, train_batches, val_data, total_steps: int) -> dict:
        """:meth:`PPOTrainer.fit` with this driver's step and validation."""
        return self.ppo.fit(train_batches, val_data, total_steps, driver=self)

    def validate(self, val_data: DataProto) -> dict[str, float]:
        """``val/score`` and ``val/cost`` of the greedy responses (see :func:`validate`)."""
        return validate(self.config, self.actor, self.reward, val_data, cost=self.cost)

    def step(self, batch: DataProto) -> dict[str, float]:
        """One Safe-RLHF iteration on a batch of prompts; returns its metrics."""
        n, t = self.config.actor_rollout_ref.rollout.n, {}
        prompts = self.ppo.pop_prompts(batch)
        with timer("step", t):
            with timer("gen", t):
                gen = self.actor.generate_sequences(prompts)
            sync = gen.meta_info.pop("sync_metrics", {})  # LoRA: the rollout's weights checked (sync/verified)
            batch = batch.repeat(n, interleave=True).union(gen)
            with timer("reward", t):
                batch.union(self.reward.compute_rm_score(batch))
            with timer("cost", t):
                batch.batch["token_level_cost_scores"] = self.cost.compute_cost(batch)
            with timer("ref", t):
                batch.union(self.actor.compute_ref_log_prob(batch))
            with timer("old_log_prob", t):
                batch.union(self.actor.compute_log_prob(batch))
            with timer("values", t):
                batch.union(self.critic.compute_values(batch))
                batch.batch["cost_values"] = self.cost_critic.compute_values(batch).batch["values"]
            with timer("adv", t):
                metrics = self.lagrangian_advantages(batch)
            with timer("update_critic", t):
                metrics.update(absorb_metrics(self.critic.update_critic(batch), batch))
                cost_targets = batch.select(_CRITIC_INPUTS + ["cost_values", "cost_returns"])
                cost_targets.rename(["cost_values", "cost_returns"], ["values", "returns"])
                cost_metrics = absorb_metrics(self.cost_critic.update_critic(cost_targets), batch)
                metrics.update({"cost_" + k: v for k, v in cost_metrics.items()})
            with timer("update_actor", t):
                metrics.update(absorb_metrics(self.actor.update_actor(batch), batch))
            metrics.update(sync)
        return self.ppo.step_metrics(batch, metrics, t)

    def lagrangian_advantages(self, batch: DataProto) -> dict[str, float]:
        """Adds ``token_level_rewards``/``token_level_costs`` (scores -/+ the in-reward KL), ``returns`` and
        ``cost_returns`` (GAE targets of the two critics) and ``advantages`` (B, R) = whitened
        (A_r - lambda * A_c) / (1 + lambda), after stepping lambda on this batch's episode costs (B,).
        Metrics: ``lagrange/lambda`` (after the step), ``lagrange/window_cost`` (the mean episode cost it was
        stepped on), ``lagrange/threshold`` and ``cost/score/mean`` (this batch; the mean reward is
        ``critic/score/mean``)."""
        alg, b = self.config.algorithm, batch.batch
        metrics: dict[str, float] = {}
        if alg.use_kl_in_reward:
            metrics.update(apply_kl_penalty(batch, self.ppo.kl_ctrl, alg.kl_penalty))
        else:
            b["token_level_rewards"] = b["token_level_scores"]
        kl_term = b["token_level_scores"] - b["token_level_rewards"]  # beta * KL per token (0 without KL)
        b["token_level_costs"] = b["token_level_cost_scores"] + kl_term
        gae, mask = get_adv_estimator_fn(alg.adv_estimator), b["response_mask"]
        _, b["returns"] = gae(token_level_rewards=b["token_level_rewards"], values=b["values"],
                              response_mask=mask, config=alg)
        _, b["cost_returns"] = gae(token_level_rewards=b["token_level_costs"], values=b["cost_values"],
                                   response_mask=mask, config=alg)
        reward_adv = (b["returns"] - b["values"]) * mask
        cost_adv = (b["cost_returns"] - b["cost_values"]) * mask
        episode_costs = b["token_level_cost_scores"].sum(-1)
        lam = self.lagrange.update(episode_costs)
        b["advantages"] = masked_whiten(compute_safe_rlhf_advantage(reward_adv, cost_adv, lam), mask != 0)
        metrics.update({"lagrange/lambda": lam, "lagrange/window_cost": self.lagrange.mean_cost,
                        "lagrange/threshold": self.lagrange.threshold,
                        "cost/score/mean": episode_costs.mean().item()})
        return metrics
