"""The PPO driver (Ouyang et al. 2022; HybridFlow, Sheng et al. 2025, Fig. 4): one controller walks the RLHF
dataflow and every model is a worker group. The driver holds no weights; it moves DataProto batches.

One step = generate -> reward (+ DAPO's overlong penalty) -> reference logprobs -> old logprobs -> values ->
KL-in-reward -> advantages -> update critic -> update actor. Advantages and the KL penalty run here on the driver
(see :mod:`hybridflow.trainer.steps` for why). With ``algorithm.filter_groups.enable`` (DAPO dynamic sampling) the
first two phases repeat over further prompt batches until the batch holds enough informative groups
(:mod:`hybridflow.trainer.dynamic_sampling`).
"""

from __future__ import annotations

import functools
import logging
import os
import time
import uuid
from typing import Callable, Iterable

import numpy as np

from hybridflow.algorithms import get_kl_controller
from hybridflow.protocol import DataProto
from hybridflow.trainer.dynamic_sampling import collect_informative_groups
from hybridflow.trainer.old_log_prob import old_log_prob_is_current
from hybridflow.trainer.steps import (add_worker_time, apply_kl_penalty, apply_overlong_penalty, compute_advantage,
                                     compute_data_metrics, compute_timing_metrics)
from hybridflow.trainer.checkpoint import CONFIG_FILE, CheckpointManager, load_trainer_state, save_config
from hybridflow.trainer.validate import validate
from hybridflow.utils.timer import timer

logger = logging.getLogger(__name__)


class PPOTrainer:
    """Args:
        config: the validated run config.
        actor: worker group of :class:`~hybridflow.workers.actor_worker.ActorRolloutRefWorker` (actor+rollout+ref).
        critic: worker group of :class:`~hybridflow.workers.critic_worker.CriticWorker`, or None (critic-free).
        reward: anything with ``compute_rm_score(DataProto) -> DataProto`` giving ``token_level_scores`` (B, R): the
            :class:`~hybridflow.workers.reward_worker.RuleRewardWorker` group or a
            :class:`~hybridflow.trainer.scoring.RewardScorer` (rule + reward model).
        tracker: a :class:`~hybridflow.utils.tracking.Tracking` (``log(metrics, step)``).

    Other drivers (:mod:`~hybridflow.trainer.remax`, :mod:`~hybridflow.trainer.safe_rlhf`) hold a PPOTrainer and
    reuse its pieces: :meth:`pop_prompts`, :meth:`rewards_and_advantages`, :meth:`step_metrics`, :meth:`fit`
    (validation, checkpoints, resume) and the two checkpoint tables, to which they add what they train or track:
    ``checkpointed_groups`` (name -> worker group with ``save_checkpoint``/``load_checkpoint``; saved under
    ``<ckpt>/<name>``) and ``checkpointed_state`` (name -> driver object with ``state_dict``/``load_state_dict``;
    saved in ``trainer_state.pt``).

    The data cursor ``data_position`` counts the prompt batches consumed (one per step, more with DAPO dynamic
    sampling, which pulls extra ones through :meth:`next_batch`); it is checkpointed, and :meth:`fit` resumes the
    data from it, so a resumed run sees exactly the prompts of an uninterrupted one.
    """

    def __init__(self, config, actor, critic, reward, tracker) -> None:
        self.config = config
        self.actor, self.critic, self.reward = actor, critic, reward
        self.tracker = tracker
        self.kl_ctrl = get_kl_controller(config.algorithm.kl_ctrl)
        self.global_step = 0
        self.data_position = 0  # prompt batches consumed so far (== global_step without dynamic sampling)
        self.sync_metrics: dict[str, float] = {}  # from the last generation: LoRA weight-sync checks (sync/*)
        self._batches = None  # the iterator of train batches, from data_position on (set by fit)
        self.checkpoints = CheckpointManager(config.trainer.default_local_dir, config.trainer.max_ckpt_to_keep)
        self.checkpointed_groups = {"actor": actor, **({"critic": critic} if critic is not None else {})}
        self.checkpointed_state = {"kl_ctrl": self.kl_ctrl}

    def save_checkpoint(self) -> str:
        """Checkpoint every trained worker group (sharded, per rank), the resolved config and the driver state,
        atomically."""
        writers = {name: group.save_checkpoint for name, group in self.checkpointed_groups.items()}
        writers[CONFIG_FILE] = functools.partial(save_config, self.config)
        state = {"global_step": self.global_step, "data_position": self.data_position,
                 **{name: obj.state_dict() for name, obj in self.checkpointed_state.items()}}
        start = time.perf_counter()
        logger.info("saving the checkpoint of step %d (%s) under %s", self.global_step, ", ".join(writers),
                    self.checkpoints.root)
        path = self.checkpoints.save(self.global_step, writers, state)
        logger.info("saved %s in %.1f s", path, time.perf_counter() - start)
        return path

    def resume(self) -> int:
        """Load the checkpoint chosen by ``trainer.resume_mode`` (if any); returns the step to continue from.

        Raises:
            KeyError: the checkpoint lacks a part this driver checkpoints (it was written by another driver).
        """
        path = self.checkpoints.resolve(self.config.trainer.resume_mode)
        if path is None:
            return 0
        state = load_trainer_state(path)
        missing = [name for name in self.checkpointed_state if name not in state]
        missing += [name for name in self.checkpointed_groups if not os.path.isdir(os.path.join(path, name))]
        if missing:
            raise KeyError(f"checkpoint {path} has no {missing}; it was written by a run with another "
                           f"algorithm.driver (this one is {self.config.algorithm.driver!r})")
        for name, group in self.checkpointed_groups.items():
            group.load_checkpoint(os.path.join(path, name))
        self.global_step = state["global_step"]
        self.data_position = state.get("data_position", self.global_step)  # older checkpoints: one batch per step
        for name, obj in self.checkpointed_state.items():
            obj.load_state_dict(state[name])
        logger.info("resumed from %s at step %d", path, self.global_step)
        return self.global_step

    def pop_prompts(self, batch: DataProto, step: int | None = None, seed_index: int | None = None) -> DataProto:
        """Start a step: give each prompt a ``uid`` (before its n samples are made, so they share it: the groups of
        GRPO/RLOO), put ``global_step`` in ``batch.meta_info``, and pop the prompt tensors (``input_ids``,
        ``attention_mask``, ``position_ids`` (B, P)) with the sampling ``seed`` of index ``seed_index`` (default:
        the step ``step``, itself defaulting to the current ``global_step``) as the rollout's input."""
        step = self.global_step if step is None else step
        seed_index = step if seed_index is None else seed_index
        batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
        batch.meta_info.update(seed=self.config.trainer.seed * 100003 + seed_index, global_step=step)
        return batch.pop(batch_keys=["input_ids", "attention_mask", "position_ids"], meta_info_keys=["seed"])

    def step(self, batch: DataProto) -> dict[str, float]:
        """One PPO iteration on a batch of prompts (with DAPO dynamic sampling: on as many batches as it takes to
        fill the batch with informative groups); returns its metrics."""
        t: dict[str, float] = {}
        with timer("step", t):
            if self.config.algorithm.filter_groups.enable:
                batch, metrics = collect_informative_groups(self, batch, t)
            else:
                batch, metrics = self.generate_and_score(batch, t), {}
            metrics.update(self.train_on(batch, t, scored=True))
            metrics.update(self.sync_metrics)  # LoRA: the rollout's weights checked (sync/verified)
            self.sync_metrics = {}
        return self.step_metrics(batch, metrics, t)

    def set_data(self, train_batches: Callable[[int], Iterable[DataProto]]) -> None:
        """Point the data cursor at ``train_batches(data_position)``: the batches from the current position on."""
        self._batches = iter(train_batches(self.data_position))

    def next_batch(self) -> DataProto:
        """The next batch of prompts from the data cursor (advances ``data_position``)."""
        batch = next(self._batches)
        self.data_position += 1
        return batch

    def generate_and_score(self, batch: DataProto, t: dict[str, float], seed_index: int | None = None) -> DataProto:
        """Sample ``rollout.n`` responses per prompt of ``batch`` (seed of ``seed_index``, see :meth:`pop_prompts`)
        and score them (:meth:`score`); returns the generated rows, a prompt's samples adjacent."""
        prompts = self.pop_prompts(batch, seed_index=seed_index)
        with timer("gen", t):
            gen = self.actor.generate_sequences(prompts)
        self.sync_metrics.update(gen.meta_info.pop("sync_metrics", {}))  # LoRA: the rollout's weights checked
        batch = batch.repeat(self.config.actor_rollout_ref.rollout.n, interleave=True).union(gen)
        self.score(batch, t)
        return batch

    def score(self, batch: DataProto, t: dict[str, float]) -> None:
        """Add ``token_level_scores`` (B, R) (and ``reward_error``) from the reward, plus, with
        ``reward_model.overlong_buffer.enable``, DAPO's overlong penalty (``overlong_penalty`` (B,), on the last
        valid token)."""
        with timer("reward", t):
            batch.union(self.reward.compute_rm_score(batch))
        buffer = self.config.reward_model.overlong_buffer
        if buffer.enable:
            apply_overlong_penalty(batch, self.config.data.max_response_length, buffer.len, buffer.penalty_factor)

    def train_on(self, batch: DataProto, t: dict[str, float], scored: bool = False) -> dict[str, float]:
        """The rest of a step on a batch of generated samples: reward (unless ``scored``: :meth:`score` already
        ran), reference logprobs (when a KL term needs them), old logprobs (unless ``algorithm.bypass_old_log_prob`` or
        they equal the update's own, :mod:`hybridflow.trainer.old_log_prob`),
        values, advantages, critic and actor updates (phase seconds into ``t``); returns the metrics."""
        if not scored:
            self.score(batch, t)
        if self.config.algorithm.use_kl_in_reward or self.config.actor_rollout_ref.actor.use_kl_loss:
            with timer("ref", t):
                batch.union(self.actor.compute_ref_log_prob(batch))
        if self.config.algorithm.bypass_old_log_prob:  # the sampling policy's logprobs are pi_old: no forward
            batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
        elif not old_log_prob_is_current(self.config):  # else the update uses its own detached logprobs
            with timer("old_log_prob", t):
                batch.union(self.actor.compute_log_prob(batch))
        if self.critic is not None:
            with timer("values", t):
                batch.union(self.critic.compute_values(batch))
        with timer("adv", t):
            metrics = self.rewards_and_advantages(batch)
        if self.critic is not None:
            with timer("update_critic", t):
                metrics.update(absorb_metrics(self.critic.update_critic(batch), batch))
        with timer("update_actor", t):
            metrics.update(absorb_metrics(self.actor.update_actor(batch), batch))
        return metrics

    def rewards_and_advantages(self, batch: DataProto) -> dict[str, float]:
        """``token_level_rewards`` (scores minus the in-reward KL when ``use_kl_in_reward``), then ``advantages``
        and ``returns`` with ``algorithm.adv_estimator``; returns the KL metrics."""
        alg = self.config.algorithm
        metrics: dict[str, float] = {}
        if alg.use_kl_in_reward:
            metrics.update(apply_kl_penalty(batch, self.kl_ctrl, alg.kl_penalty))
        else:
            batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
        compute_advantage(batch, alg)
        return metrics

    def step_metrics(self, batch: DataProto, metrics: dict[str, float], times: dict[str, float]) -> dict[str, float]:
        """End a step: ``metrics`` plus the batch statistics, the phase seconds ``times`` (with ``step``), the
        worker/controller time split and the throughput."""
        metrics.update(compute_data_metrics(batch), **{f"timing_s/{k}": v for k, v in times.items()})
        metrics.update(compute_timing_metrics(batch.meta_info, times["step"]))
        tokens = int(batch.batch["attention_mask"].sum())
        metrics.update({"perf/total_num_tokens": tokens, "perf/throughput": tokens / times["step"]})
        return metrics

    def validate(self, val_data: DataProto) -> dict[str, float]:
        """``val/score`` (and per data source) of the current policy on ``val_data`` (see :func:`validate`)."""
        return validate(self.config, self.actor, self.reward, val_data)

    def fit(self, train_batches: Callable[[int], Iterable[DataProto]], val_data: DataProto | None,
            total_steps: int, driver=None) -> dict:
        """Resume if a checkpoint says so, then run steps up to ``total_steps``: ``train_batches(position)``
        yields the batches from data position ``position`` on (batches consumed before: the step, unless dynamic
        sampling consumed extra ones). Validates every ``trainer.test_freq`` steps and at the end (and before
        training with ``val_before_train``, unless resuming); checkpoints every ``trainer.save_freq`` steps and at
        the end. Returns the last validation metrics.

        ``driver``: the object whose ``step(batch) -> metrics`` and ``validate(val_data) -> metrics`` run the
        algorithm (default: this PPO trainer); another driver passes itself and gets this loop."""
        cfg = self.config.trainer
        driver = driver or self
        val_metrics: dict[str, float] = {}
        start = self.resume()
        if val_data is not None and cfg.val_before_train and start == 0:
            val_metrics = driver.validate(val_data)
            self.tracker.log(val_metrics, step=0)
        self.set_data(train_batches)
        while self.global_step < total_steps:
            batch = self.next_batch()
            self.global_step += 1
            step_start = time.perf_counter()
            metrics = driver.step(batch)
            last = self.global_step == total_steps
            if val_data is not None and cfg.test_freq > 0 and (self.global_step % cfg.test_freq == 0 or last):
                val_start = time.perf_counter()
                val_metrics = driver.validate(val_data)
                metrics.update(val_metrics, **{"timing_s/testing": time.perf_counter() - val_start})
            if cfg.save_freq > 0 and (self.global_step % cfg.save_freq == 0 or last):
                save_start = time.perf_counter()
                self.save_checkpoint()
                metrics["timing_s/save_checkpoint"] = time.perf_counter() - save_start
            metrics["timing_s/iteration"] = time.perf_counter() - step_start
            self.tracker.log(metrics, step=self.global_step)
        return val_metrics


def absorb_metrics(update_out: DataProto, batch: DataProto) -> dict[str, float]:
    """Return an update step's ``meta_info["metrics"]``; add its worker seconds to ``batch.meta_info``."""
    meta = dict(update_out.meta_info)
    metrics = meta.pop("metrics")
    add_worker_time(batch.meta_info, meta)
    return metrics
