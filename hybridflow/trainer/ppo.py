"""The PPO driver (Ouyang et al. 2022; HybridFlow, Sheng et al. 2025, Fig. 4): one controller walks the RLHF
dataflow and every model is a worker group. The driver holds no weights; it moves DataProto batches.

One step (:meth:`PPOTrainer.step`) = generate -> reward (+ DAPO's overlong penalty) -> reference logprobs (when a KL
term uses them) -> old logprobs -> values -> KL-in-reward -> advantages (GAE, GRPO, RLOO, REINFORCE++ ... by
``algorithm.adv_estimator``) -> update critic -> update actor. Every worker-group call returns its future at once
and ``DataProto.union`` records it unread, so the step is written as the plain sequence and the controller runs
what can run together: the reward scores while the actor computes its logprobs, the critic's values start with
them, and on separate resource pools the critic and actor updates overlap; a batch holding a call's future goes to
the next group's workers without the driver reading it (:mod:`hybridflow.controller.futures`). The driver waits
where it reads: the rows to balance, the columns the advantages need, the metrics. With
``algorithm.filter_groups.enable`` (DAPO dynamic sampling) generation and scoring repeat over further prompt batches
until the batch holds enough informative groups (:mod:`hybridflow.trainer.dynamic_sampling`).

ReMax, Safe-RLHF and async call these phases on a PPOTrainer they hold. Resume, validation/checkpoint cadence,
logging and the data position are the :class:`~hybridflow.trainer.loop.TrainLoop`'s.
"""

from __future__ import annotations

import uuid
from typing import Any, Callable, Optional

import numpy as np

from hybridflow.algorithms import get_kl_controller
from hybridflow.protocol import DataProto
from hybridflow.rollout.vision import prompt_vision_keys, share_vision_columns
from hybridflow.trainer.balance import balance_batch
from hybridflow.trainer.driver import Driver, Role, SharedWithPPO, register_driver
from hybridflow.trainer.driver_config import PPODriverConfig, ppo_config_problems
from hybridflow.trainer.dynamic_sampling import collect_informative_groups
from hybridflow.trainer.old_log_prob import old_log_prob_is_current
from hybridflow.trainer.roles import ACTOR, CRITIC, SCORE_MODEL, common_roles
from hybridflow.trainer.steps import (absorb_metrics, apply_kl_penalty, apply_overlong_penalty, compute_advantage,
                                      read, step_metrics, warn_single_sample_groups)
from hybridflow.trainer.validate import validate
from hybridflow.utils.timer import timer

__all__ = ["ACTOR", "CRITIC", "PPOTrainer", "SCORE_MODEL", "SharedWithPPO", "absorb_metrics", "common_roles",
           "warn_single_sample_groups"]


@register_driver("ppo", features=("bypass_old_log_prob", "filter_groups", "overlong_buffer"),
                 planned_as=("ppo", "grpo"), trains_on_current_samples=True,
                 config=PPODriverConfig, config_checks=ppo_config_problems)
class PPOTrainer(Driver):
    """Args:
        config: the validated run config.
        actor: worker group of :class:`~hybridflow.workers.actor_worker.ActorRolloutRefWorker` (actor+rollout+ref).
        critic: worker group of :class:`~hybridflow.workers.critic_worker.CriticWorker`, or None (critic-free).
        reward: anything with ``compute_rm_score(DataProto) -> DataProto`` giving ``token_level_scores`` (B, R): the
            :class:`~hybridflow.workers.reward_worker.RuleRewardWorker` group or a
            :class:`~hybridflow.trainer.scoring.RewardScorer` (rule + reward model).
    """

    ROLES = ("actor", "reward", "critic", "reward_model")
    CHECKPOINTED_ROLES = ("actor", "critic")

    def __init__(self, config: Any, actor: Any, critic: Any, reward: Any) -> None:
        self.config = config
        self.actor, self.critic, self.reward = actor, critic, reward
        self.kl_ctrl = get_kl_controller(config.algorithm.kl_ctrl)
        alg = config.algorithm
        self.need_ref = alg.use_kl_in_reward or config.actor_rollout_ref.actor.use_kl_loss
        self.need_old = not alg.bypass_old_log_prob and not old_log_prob_is_current(config)
        warn_single_sample_groups(config)

    @classmethod
    def roles(cls, config: Any) -> dict[str, Role]:
        return common_roles(config)

    @classmethod
    def build(cls, config: Any, groups: dict[str, Any]) -> "PPOTrainer":
        from hybridflow.trainer.scoring import build_reward

        return cls(config, groups["actor"], groups.get("critic"), build_reward(groups, config))

    def checkpointed_groups(self) -> dict[str, Any]:
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}

    def checkpointed_state(self) -> dict[str, Any]:
        return {"kl_ctrl": self.kl_ctrl}

    def step(self, batch: DataProto) -> dict[str, float]:
        """One PPO iteration on a batch of prompts (B prompts -> B x ``rollout.n`` rows); returns its metrics."""
        t: dict[str, float] = {}
        with timer("step", t):
            if self.config.algorithm.filter_groups.enable:  # DAPO: the scores pick the groups to train on
                batch, metrics = collect_informative_groups(self, batch, t)
                metrics.update(self.train_on(batch, t, scored=True))
            else:
                batch = self.generate(batch)
                metrics = self.train_on(batch, t)
        return self.step_metrics(batch, metrics, t)

    def train_on(self, batch: DataProto, t: dict[str, float], scored: bool = False) -> dict[str, float]:
        """The rest of a step on generated rows: :meth:`prepare_update`, then :meth:`update`."""
        metrics = self.prepare_update(batch, t, scored)
        return {**metrics, **self.update(batch, t)}

    def prepare_update(self, batch: DataProto, t: dict[str, float], scored: bool = False) -> dict[str, float]:
        """Add the reward's scores (unless ``scored``: already there), the reference and old logprobs and the
        values, all started on the generation's future; then balance the rows and add the advantages (phase
        seconds into ``t``: ``gen`` is the wait for the generation and the forwards on its rows); returns the
        metrics so far."""
        scores = None if scored else self.reward.compute_rm_score(batch)  # token_level_scores (B, R)
        values = self.critic.compute_values(batch) if self.critic is not None else None  # values (B, R)
        self.add_log_probs(batch)
        with timer("gen", t):  # the first reads: the driver waits here
            if values is not None:
                batch.union(values)
            self.add_scores(batch, scores)
            metrics = {**batch.meta_info.pop("sync_metrics", {}), **self.balance(batch)}  # LoRA: sync/*
        with timer("adv", t):
            metrics.update(self.kl_rewards(batch))  # token_level_rewards
            compute_advantage(batch, self.config.algorithm)  # advantages, returns (B, R)
        return metrics

    def add_log_probs(self, batch: DataProto) -> None:
        """Add ``ref_log_prob`` (B, R) when a KL term reads it, and ``old_log_probs`` (B, R): the actor's forward, or
        with ``algorithm.bypass_old_log_prob`` the rollout's ``rollout_log_probs``, or nothing when the update's own
        logprobs serve (:mod:`hybridflow.trainer.old_log_prob`). The calls' futures are added unread."""
        if self.need_ref:
            batch.union(self.actor.compute_ref_log_prob(batch))
        if self.need_old:
            batch.union(self.actor.compute_log_prob(batch))
        elif self.config.algorithm.bypass_old_log_prob:
            batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]

    def pop_prompts(self, batch: DataProto, step: Optional[int] = None, seed_index: Optional[int] = None) -> DataProto:
        """Start a step: give each prompt a ``uid`` (before its n samples are made, so they share it: the groups of
        GRPO/RLOO), put ``global_step`` in ``batch.meta_info``, and pop the prompt tensors (``input_ids``,
        ``attention_mask``, ``position_ids`` (B, P)) with the sampling ``seed`` of index ``seed_index`` (default:
        the step ``step``, itself defaulting to the current ``global_step``) as the rollout's input."""
        step = self.global_step if step is None else step
        seed_index = step if seed_index is None else seed_index
        batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
        batch.meta_info.update(seed=self.config.trainer.seed * 100003 + seed_index, global_step=step)
        keys = ["input_ids", "attention_mask", "position_ids"] + prompt_vision_keys(batch)  # + a VLM's mrope
        return share_vision_columns(batch.pop(batch_keys=keys, meta_info_keys=["seed"]), batch)

    def generate(self, batch: DataProto, seed_index: Optional[int] = None) -> DataProto:
        """``rollout.n`` samples per prompt of ``batch`` (seed of ``seed_index``, see :meth:`pop_prompts`): the
        prompts' rows repeated (a prompt's samples adjacent) with the generation's future unioned (unread)."""
        prompts = self.pop_prompts(batch, seed_index=seed_index)
        n = self.config.actor_rollout_ref.rollout.n
        return batch.repeat(n, interleave=True).union(self.actor.generate_sequences(prompts))

    def generate_and_score(self, batch: DataProto, t: dict[str, float], seed_index: Optional[int] = None) -> DataProto:
        """:meth:`generate`, then the reward's scores added (:meth:`add_scores`; waits for both)."""
        batch = self.generate(batch, seed_index)
        with timer("reward", t):
            self.add_scores(batch, self.reward.compute_rm_score(batch))
        return batch

    def add_scores(self, batch: DataProto, scores: Optional[DataProto]) -> None:
        """Add ``token_level_scores`` (B, R) (and ``reward_error``) from ``scores`` (None: already there), plus, with
        ``reward_model.overlong_buffer.enable``, DAPO's overlong penalty (``overlong_penalty`` (B,), on the last
        valid token)."""
        if scores is None:
            return
        batch.union(read(scores))  # waits for the reward (DAPO reads the scores next)
        buffer = self.config.reward_model.overlong_buffer
        if buffer.enable:
            apply_overlong_penalty(batch, self.config.data.max_response_length, buffer.len, buffer.penalty_factor)

    def balance(self, batch: DataProto) -> dict[str, float]:
        """With ``trainer.balance_batch``, reorder ``batch`` for ~equal tokens per actor dp rank (:mod:`.balance`);
        returns the balance metrics."""
        info = getattr(self.actor, "dispatch_info", None)
        on = self.config.trainer.balance_batch and info is not None
        return balance_batch(batch, info("actor").dp_size) if on else {}

    def kl_rewards(self, batch: DataProto) -> dict[str, float]:
        """``token_level_rewards`` (B, R): ``token_level_scores`` minus beta * KL(actor || ref) with
        ``algorithm.use_kl_in_reward`` (updating the KL controller), else the scores; returns the KL metrics."""
        alg = self.config.algorithm
        if alg.use_kl_in_reward:
            return apply_kl_penalty(batch, self.kl_ctrl, alg.kl_penalty)
        batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
        return {}

    def update(self, batch: DataProto, t: dict[str, float],
               meanwhile: Callable[[], None] = lambda: None) -> dict[str, float]:
        """Update the critic (if any) and the actor on ``batch`` (both calls start at once: on separate resource
        pools they run together); ``meanwhile()`` runs once both have started, before their metrics are read
        (async: the weight push and the next batch); returns their metrics."""
        critic = self.critic.update_critic(batch) if self.critic is not None else None
        actor = self.actor.update_actor(batch)
        meanwhile()
        with timer("update_critic", t):
            metrics = absorb_metrics(critic, batch) if critic is not None else {}
        with timer("update_actor", t):
            return {**metrics, **absorb_metrics(actor, batch)}

    step_metrics = staticmethod(step_metrics)  # (batch, metrics, phase seconds) -> the step's metrics

    def validate(self, val_data: DataProto) -> dict[str, float]:
        """``val/score`` (and per data source) of the current policy on ``val_data`` (see :func:`validate`)."""
        return validate(self.config, self.actor, self.reward, val_data)

