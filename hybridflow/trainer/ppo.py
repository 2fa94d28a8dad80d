"""The PPO driver (Ouyang et al. 2022; HybridFlow, Sheng et al. 2025, Fig. 4): one controller walks the RLHF
dataflow and every model is a worker group. The driver holds no weights; it moves DataProto batches.

One step = generate -> reward -> reference logprobs -> old logprobs -> values -> KL-in-reward -> advantages
-> update critic -> update actor. Advantages and the KL penalty run here on the driver (see
:mod:`hybridflow.trainer.steps` for why).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Callable, Iterable

import numpy as np

from hybridflow.algorithms import get_kl_controller
from hybridflow.protocol import DataProto
from hybridflow.trainer.steps import apply_kl_penalty, compute_advantage, compute_data_metrics, compute_timing_metrics
from hybridflow.trainer.checkpoint import CheckpointManager, load_trainer_state
from hybridflow.trainer.validate import validate
from hybridflow.utils.timer import timer

logger = logging.getLogger(__name__)


class PPOTrainer:
    """Args:
        config: the validated run config.
        actor: worker group of :class:`~hybridflow.workers.actor_worker.ActorRolloutRefWorker` (actor+rollout+ref).
        critic: worker group of :class:`~hybridflow.workers.critic_worker.CriticWorker`, or None (critic-free).
        reward: worker group of :class:`~hybridflow.workers.reward_worker.RuleRewardWorker`.
        tracker: a :class:`~hybridflow.utils.tracking.Tracking` (``log(metrics, step)``).
    """

    def __init__(self, config, actor, critic, reward, tracker) -> None:
        self.config = config
        self.actor, self.critic, self.reward = actor, critic, reward
        self.tracker = tracker
        self.kl_ctrl = get_kl_controller(config.algorithm.kl_ctrl)
        self.global_step = 0
        self.checkpoints = CheckpointManager(config.trainer.default_local_dir, config.trainer.max_ckpt_to_keep)

    def _trained_groups(self) -> dict:
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}

    def save_checkpoint(self) -> str:
        """Checkpoint every trained worker group (sharded, per rank) and the driver state, atomically."""
        writers = {name: group.save_checkpoint for name, group in self._trained_groups().items()}
        state = {"global_step": self.global_step, "kl_ctrl": self.kl_ctrl.state_dict()}
        return self.checkpoints.save(self.global_step, writers, state)

    def resume(self) -> int:
        """Load the checkpoint chosen by ``trainer.resume_mode`` (if any); returns the step to continue from."""
        path = self.checkpoints.resolve(self.config.trainer.resume_mode)
        if path is None:
            return 0
        for name, group in self._trained_groups().items():
            group.load_checkpoint(os.path.join(path, name))
        state = load_trainer_state(path)
        self.global_step = state["global_step"]
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        logger.info("resumed from %s at step %d", path, self.global_step)
        return self.global_step

    def step(self, batch: DataProto) -> dict[str, float]:
        """One PPO iteration on a batch of prompts; returns its metrics."""
        cfg, t = self.config, {}
        n = cfg.actor_rollout_ref.rollout.n
        batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
        batch.meta_info.update(seed=cfg.trainer.seed * 100003 + self.global_step, global_step=self.global_step)
        prompts = batch.pop(batch_keys=["input_ids", "attention_mask", "position_ids"], meta_info_keys=["seed"])
        with timer("step", t):
            with timer("gen", t):
                gen = self.actor.generate_sequences(prompts)
            batch = batch.repeat(n, interleave=True).union(gen)
            with timer("reward", t):
                batch.union(self.reward.compute_rm_score(batch))
            with timer("ref", t):
                batch.union(self.actor.compute_ref_log_prob(batch))
            with timer("old_log_prob", t):
                batch.union(self.actor.compute_log_prob(batch))
            if self.critic is not None:
                with timer("values", t):
                    batch.union(self.critic.compute_values(batch))
            with timer("adv", t):
                metrics = self._rewards_and_advantages(batch)
            if self.critic is not None:
                with timer("update_critic", t):
                    metrics.update(_absorb(self.critic.update_critic(batch), batch))
            with timer("update_actor", t):
                metrics.update(_absorb(self.actor.update_actor(batch), batch))
        metrics.update(compute_data_metrics(batch), **{f"timing_s/{k}": v for k, v in t.items()})
        metrics.update(compute_timing_metrics(batch.meta_info, t["step"]))
        tokens = int(batch.batch["attention_mask"].sum())
        metrics.update({"perf/total_num_tokens": tokens, "perf/throughput": tokens / t["step"]})
        return metrics

    def _rewards_and_advantages(self, batch: DataProto) -> dict[str, float]:
        alg = self.config.algorithm
        metrics: dict[str, float] = {}
        if alg.use_kl_in_reward:
            metrics.update(apply_kl_penalty(batch, self.kl_ctrl, alg.kl_penalty))
        else:
            batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
        compute_advantage(batch, alg)
        return metrics

    def fit(self, train_batches: Callable[[int], Iterable[DataProto]], val_data: DataProto | None,
            total_steps: int) -> dict:
        """Resume if a checkpoint says so, then run PPO steps up to ``total_steps``: ``train_batches(step)``
        yields the batches from global step ``step`` on. Validates every ``trainer.test_freq`` steps and at the
        end (and before training with ``val_before_train``, unless resuming); checkpoints every
        ``trainer.save_freq`` steps and at the end. Returns the last validation metrics."""
        cfg = self.config.trainer
        val_metrics: dict[str, float] = {}
        start = self.resume()
        if val_data is not None and cfg.val_before_train and start == 0:
            val_metrics = validate(self.config, self.actor, self.reward, val_data)
            self.tracker.log(val_metrics, step=0)
        for batch in train_batches(start):
            if self.global_step >= total_steps:
                break
            self.global_step += 1
            step_start = time.perf_counter()
            metrics = self.step(batch)
            last = self.global_step == total_steps
            if val_data is not None and cfg.test_freq > 0 and (self.global_step % cfg.test_freq == 0 or last):
                val_start = time.perf_counter()
                val_metrics = validate(self.config, self.actor, self.reward, val_data)
                metrics.update(val_metrics, **{"timing_s/testing": time.perf_counter() - val_start})
            if cfg.save_freq > 0 and (self.global_step % cfg.save_freq == 0 or last):
                save_start = time.perf_counter()
                self.save_checkpoint()
                metrics["timing_s/save_checkpoint"] = time.perf_counter() - save_start
            metrics["timing_s/iteration"] = time.perf_counter() - step_start
            self.tracker.log(metrics, step=self.global_step)
        return val_metrics


def _absorb(update_out: DataProto, batch: DataProto) -> dict[str, float]:
    """Return an update step's ``meta_info["metrics"]``; keep its other meta (worker timings) on ``batch``."""
    meta = dict(update_out.meta_info)
    metrics = meta.pop("metrics")
    batch.meta_info.update(meta)
    return metrics
