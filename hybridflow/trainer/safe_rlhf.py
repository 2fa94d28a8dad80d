"""The Safe-RLHF driver (Dai et al. 2023, arXiv 2310.12773, sec. 3.3 and appendix eq. 30-31): PPO on the
Lagrangian of "maximize reward subject to mean cost <= threshold", with a reward critic and a cost critic.

One step = generate -> reward -> cost -> reference logprobs -> old logprobs -> reward values and cost values
-> KL subtracted from the reward and added to the cost -> GAE for each -> lambda update on the episode costs
-> advantage (A_r - lambda * A_c) / (1 + lambda) -> update both critics -> update actor.

The two GAE advantages are taken raw (returns minus values, not whitened one by one, so that their ratio keeps
the units lambda is measured in); their combination is whitened over the batch like the PPO driver's GAE
advantages, which rescales the step by a positive factor and shifts it, and keeps the Lagrangian's direction.
Checkpoints carry the cost critic and the multiplier; validation also reports ``val/cost``. Generation, reward,
reference/old logprobs (reference only when a KL term uses them), reward values and the actor update are the PPO
driver's phases.
"""

from __future__ import annotations

from typing import Any

from hybridflow.algorithms import LagrangeMultiplier, compute_safe_rlhf_advantage, get_adv_estimator_fn, masked_whiten
from hybridflow.protocol import DataProto
from hybridflow.trainer.driver import Driver, Get, Role, register_driver
from hybridflow.trainer.driver_config import SafeRLHFDriverConfig, safe_rlhf_config_problems
from hybridflow.trainer.ppo import CRITIC, SCORE_MODEL, PPOTrainer, SharedWithPPO, absorb_metrics, common_roles
from hybridflow.trainer.validate import validate
from hybridflow.trainer.worker_inputs import critic_args, score_model_args
from hybridflow.utils.timer import timer

_CRITIC_INPUTS = ["input_ids", "attention_mask", "position_ids", "responses", "response_mask"]


@register_driver("safe_rlhf", planned_as=("safe-rlhf",), config=SafeRLHFDriverConfig,
                 config_checks=safe_rlhf_config_problems)
class SafeRLHFTrainer(Driver):
    """Args:
        config: the validated run config (``algorithm.driver=safe_rlhf``, ``adv_estimator=gae``; the multiplier
            from ``algorithm.lagrangian``).
        actor: the actor(+rollout+ref) worker group.
        critic: the reward critic group; cost_critic: the cost critic group (both ``CriticWorker``).
        reward: the reward (rule-reward group or :class:`~hybridflow.trainer.scoring.RewardScorer`).
        cost: a :class:`~hybridflow.trainer.scoring.CostScorer`.
    """

    ROLES = ("actor", "reward", "critic", "reward_model", "cost_critic", "cost_model")
    CHECKPOINTED_ROLES = ("actor", "critic", "cost_critic")
    global_step = SharedWithPPO()
    data = SharedWithPPO()

    def __init__(self, config: Any, actor: Any, critic: Any, cost_critic: Any, reward: Any, cost: Any) -> None:
        self.config, self.actor, self.critic, self.cost_critic = config, actor, critic, cost_critic
        self.reward, self.cost = reward, cost
        lag = config.algorithm.lagrangian
        self.lagrange = LagrangeMultiplier(lag.lambda_init, lag.lambda_lr, lag.threshold, lag.lambda_max,
                                           lag.episode_cost_window_size, min_lambda=lag.lambda_min)
        self.ppo = PPOTrainer(config, actor, critic, reward)

    @classmethod
    def roles(cls, config: Any) -> dict[str, Role]:
        """The PPO roles (the config check makes sure the reward critic is among them), a ``cost_critic`` with the
        critic's settings and, with ``cost_model.enable``, a ``cost_model``."""
        roles = common_roles(config)
        roles["cost_critic"] = Role(CRITIC, critic_args, checkpointed=True, strategy_key="critic.strategy")
        if config.cost_model.enable:
            roles["cost_model"] = Role(SCORE_MODEL, score_model_args, ("cost_model",),
                                       strategy_key="cost_model.strategy")
        return roles

    @classmethod
    def config_problems(cls, get: Get) -> list[str]:
        """Safe-RLHF needs GAE (a reward and a cost critic) and a cost (rule, model or both)."""
        from hybridflow.algorithms import ADV_ESTIMATORS, need_critic_for

        estimator, problems = get("algorithm.adv_estimator"), []
        if not ADV_ESTIMATORS.declared(estimator, "needs_values") or not need_critic_for(get("critic.enable"),
                                                                                         estimator):
            problems.append(f"algorithm.driver=safe_rlhf uses a reward critic and a cost critic: set "
                            f"algorithm.adv_estimator to an estimator that reads values "
                            f"({' | '.join(ADV_ESTIMATORS.names(needs_values=True))}) and leave critic.enable "
                            f"unset, got adv_estimator={estimator}, critic.enable={get('critic.enable')}")
        if get("cost_model.rule") is None and not get("cost_model.enable"):
            problems.append("algorithm.driver=safe_rlhf needs a cost: set cost_model.rule (e.g. "
                            "subtraction_before_last_step) and/or cost_model.enable=true with cost_model.model.path")
        return problems

    @classmethod
    def build(cls, config: Any, groups: dict[str, Any]) -> "SafeRLHFTrainer":
        from hybridflow.trainer.scoring import build_cost, build_reward

        return cls(config, groups["actor"], groups["critic"], groups["cost_critic"], build_reward(groups, config),
                   build_cost(groups, config))

    def checkpointed_groups(self) -> dict[str, Any]:
        return {**self.ppo.checkpointed_groups(), "cost_critic": self.cost_critic}

    def checkpointed_state(self) -> dict[str, Any]:
        return {**self.ppo.checkpointed_state(), "lagrange": self.lagrange}

    def validate(self, val_data: DataProto) -> dict[str, float]:
        """``val/score`` and ``val/cost`` of the greedy responses (see :func:`validate`)."""
        return validate(self.config, self.actor, self.reward, val_data, cost=self.cost)

    def step(self, batch: DataProto) -> dict[str, float]:
        """One Safe-RLHF iteration on a batch of prompts; returns its metrics. Every group call returns its future
        at once: the reward, the two critics' values and the actor's logprobs run together where their groups'
        devices allow; the driver waits where it reads (the cost, the advantages, the update metrics)."""
        t: dict[str, float] = {}
        with timer("step", t):
            batch = self.ppo.generate(batch)
            scores = self.reward.compute_rm_score(batch)  # token_level_scores
            values = self.critic.compute_values(batch)
            cost_values = self.cost_critic.compute_values(batch)
            self.ppo.add_log_probs(batch)  # ref_log_prob, old_log_probs
            with timer("adv", t):
                self.ppo.add_scores(batch, scores)
                batch.batch["token_level_cost_scores"] = self.cost.compute_cost(batch)
                batch.union(values)
                batch.batch["cost_values"] = cost_values.batch["values"]
                metrics = {**self.lagrangian_advantages(batch), **batch.meta_info.pop("sync_metrics", {})}
            critic = self.critic.update_critic(batch)
            cost_targets = batch.select(_CRITIC_INPUTS + ["cost_values", "cost_returns"])
            cost_critic = self.cost_critic.update_critic(cost_targets.rename(["cost_values", "cost_returns"],
                                                                             ["values", "returns"]))
            actor = self.actor.update_actor(batch)
            with timer("update", t):
                metrics.update(absorb_metrics(critic, batch), **absorb_metrics(actor, batch))
                metrics.update({"cost_" + k: v for k, v in absorb_metrics(cost_critic, batch).items()})
        return self.ppo.step_metrics(batch, metrics, t)

    def lagrangian_advantages(self, batch: DataProto) -> dict[str, float]:
        """Adds ``token_level_rewards``/``token_level_costs`` (scores -/+ the in-reward KL), ``returns`` and
        ``cost_returns`` (GAE targets of the two critics) and ``advantages`` (B, R) = whitened
        (A_r - lambda * A_c) / (1 + lambda), after stepping lambda on this batch's episode costs (B,).
        Metrics: ``lagrange/lambda`` (after the step), ``lagrange/window_cost`` (the mean episode cost it was
        stepped on), ``lagrange/threshold`` and ``cost/score/mean`` (this batch; the mean reward is
        ``critic/score/mean``)."""
        alg, b = self.config.algorithm, batch.batch
        metrics = self.ppo.kl_rewards(batch)
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
