"""The PPO driver (Ouyang et al. 2022; HybridFlow, Sheng et al. 2025, Fig. 4): one controller walks the RLHF
dataflow and every model is a worker group. The driver holds no weights; it moves DataProto batches.

One step = generate -> reward (+ DAPO's overlong penalty) -> reference logprobs (when a KL term uses them) -> old
logprobs -> values -> KL-in-reward -> advantages -> update critic -> update actor. The reference and old-logprob
forwards run inside the generation call when the actor's group generates in its training layout (no round trip of
the batch between two calls of one group; :meth:`PPOTrainer.log_probs_in_generation`). Advantages and the KL penalty run
here on the driver (see :mod:`hybridflow.trainer.steps` for why). With ``algorithm.filter_groups.enable`` (DAPO
dynamic sampling) the first two phases repeat over further prompt batches until the batch holds enough informative
groups (:mod:`hybridflow.trainer.dynamic_sampling`).

The phases are methods of :class:`PPOTrainer` that the other drivers (ReMax, Safe-RLHF, async) call on a
PPOTrainer they hold (composition). Resume, validation/checkpoint cadence, logging and the data position are the
:class:`~hybridflow.trainer.loop.TrainLoop`'s.
"""

from __future__ import annotations

import logging
import threading
import uuid
from concurrent.futures import Future
from typing import Any, Optional

import numpy as np
import torch

from hybridflow.algorithms import get_kl_controller
from hybridflow.protocol import WORKER_TIME_PREFIX, DataProto
from hybridflow.trainer.balance import balance_order
from hybridflow.trainer.driver import Driver, Role, register_driver
from hybridflow.trainer.driver_config import PPODriverConfig, ppo_config_problems
from hybridflow.trainer.dynamic_sampling import collect_informative_groups
from hybridflow.trainer.old_log_prob import old_log_prob_is_current
from hybridflow.trainer.steps import (add_worker_time, apply_kl_penalty, apply_overlong_penalty, compute_advantage,
                                     compute_data_metrics, compute_timing_metrics)
from hybridflow.trainer.validate import validate
from hybridflow.trainer.worker_inputs import actor_args, critic_args, rule_reward_args, score_model_args
from hybridflow.workers.inputs import LOG_PROBS_IN_GENERATE, REF_IN_UPDATE
from hybridflow.utils.timer import timer

logger = logging.getLogger(__name__)

ACTOR = "hybridflow.workers.actor_worker:ActorRolloutRefWorker"
CRITIC = "hybridflow.workers.critic_worker:CriticWorker"
RULE_REWARD = "hybridflow.workers.reward_worker:RuleRewardWorker"
SCORE_MODEL = "hybridflow.workers.rm_worker:RewardModelWorker"


def common_roles(config: Any, actor_role: str = "actor_rollout_ref") -> dict[str, Role]:
    """The roles of the PPO family: ``actor`` (its worker role ``actor_role``: with the rollout, or ``actor_ref``
    when generators sample), ``reward`` (rule reward and rule cost), ``critic`` when
    :func:`~hybridflow.config.need_critic`, ``reward_model`` with ``reward_model.enable``."""
    from hybridflow.config import need_critic

    roles = {"actor": Role(ACTOR, actor_args, (actor_role,), checkpointed=True,
                           strategy_key="actor_rollout_ref.actor.strategy"),
             "reward": Role(RULE_REWARD, rule_reward_args)}
    if need_critic(config):
        roles["critic"] = Role(CRITIC, critic_args, checkpointed=True, strategy_key="critic.strategy")
    if config.reward_model.enable:
        roles["reward_model"] = Role(SCORE_MODEL, score_model_args, ("reward_model",),
                                     strategy_key="reward_model.strategy")
    return roles


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

    The phases other drivers reuse: :meth:`pop_prompts`, :meth:`generate`, :meth:`generate_and_score`,
    :meth:`score`, :meth:`log_probs`, :meth:`values`, :meth:`kl_rewards`, :meth:`rewards_and_advantages`,
    :meth:`update_critic`, :meth:`update_actor`, :meth:`train_on`, :meth:`step_metrics`; their checkpoint tables
    start from :meth:`checkpointed_groups` and :meth:`checkpointed_state`.
    """

    ROLES = ("actor", "reward", "critic", "reward_model")
    CHECKPOINTED_ROLES = ("actor", "critic")

    def __init__(self, config: Any, actor: Any, critic: Any, reward: Any) -> None:
        self.config = config
        self.actor, self.critic, self.reward = actor, critic, reward
        self.kl_ctrl = get_kl_controller(config.algorithm.kl_ctrl)
        # from the generations since the last step: LoRA weight-sync checks (sync/*), in-call forward seconds
        self.gen_metrics: dict[str, float] = {}
        self._memo: dict[str, Any] = {}  # answers that depend only on the read-only config and the groups' layouts
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

    @property
    def data_position(self) -> int:
        """Prompt batches consumed so far (the cursor's position)."""
        return self.data.position

    def next_batch(self) -> DataProto:
        """The next batch of prompts from the data cursor (advances the data position): DAPO's extra batches."""
        return self.data.next()

    def pop_prompts(self, batch: DataProto, step: Optional[int] = None, seed_index: Optional[int] = None) -> DataProto:
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
            if self.config.algorithm.filter_groups.enable:  # the scores pick the groups: score before training
                batch, metrics = collect_informative_groups(self, batch, t)
                metrics.update(self.train_on(batch, t, scored=True))
            else:  # the reward runs while the reference/old-logprob and value forwards run (train_on)
                batch, values = self.generate_and_start_values(batch, t)
                metrics = self.train_on(batch, t, values=values)
            metrics.update(self.pop_gen_metrics())  # LoRA: the rollout's weights checked (sync/verified)
        return self.step_metrics(batch, metrics, t)

    def pop_gen_metrics(self) -> dict[str, float]:
        """The metrics of the generations since the last call: the rollout's weight-sync checks (``sync/*``, LoRA)
        and ``timing_worker_s/{ref,old}_log_prob_in_generate`` (the forwards run in the generation call)."""
        metrics, self.gen_metrics = self.gen_metrics, {}
        return metrics

    def generate_and_score(self, batch: DataProto, t: dict[str, float], seed_index: Optional[int] = None,
                           log_probs: tuple[str, ...] = ()) -> DataProto:
        """Sample ``rollout.n`` responses per prompt of ``batch`` (seed of ``seed_index``, see :meth:`pop_prompts`;
        ``log_probs`` as in :meth:`generate`) and score them (:meth:`score`); returns the generated rows, a
        prompt's samples adjacent."""
        batch = self.generate(batch, t, seed_index, log_probs)
        self.score(batch, t)
        return batch

    def generate(self, batch: DataProto, t: dict[str, float], seed_index: Optional[int] = None,
                 log_probs: tuple[str, ...] = ()) -> DataProto:
        """Sample ``rollout.n`` responses per prompt of ``batch`` (seed of ``seed_index``, see :meth:`pop_prompts`);
        returns the generated rows (unscored), a prompt's samples adjacent. ``log_probs`` (from
        :meth:`log_probs_in_generation`): the reference (``"ref"``) and old-logprob (``"old"``) forwards the same
        call runs on the generated rows, whose columns :meth:`log_probs` then finds in the batch."""
        prompts = self._prompts(batch, seed_index, log_probs)
        with timer("gen", t):
            gen = self.actor.generate_sequences(prompts)
        return self._with_generation(batch, gen)

    def generate_and_start_values(self, batch: DataProto, t: dict[str, float]) -> tuple[DataProto, Any]:
        """:meth:`generate` with the step's in-generation forwards (:meth:`log_probs_in_generation`), and, where
        :meth:`values_follow_generation` and no actor forward is left for after the generation (two forwards on
        shared devices would compete), the critic's value forward started on the generation's future: the critic
        reads the generated rows from the actor's workers as soon as they exist, with no driver round trip in
        between. Returns the generated batch and the values' future (rows in generation order; None when not
        started: :meth:`values` runs in :meth:`train_on`)."""
        log_probs = self.log_probs_in_generation()
        if log_probs != self.log_prob_forwards() or not self.values_follow_generation(len(batch)):
            return self.generate(batch, t, log_probs=log_probs), None
        prompts = self._prompts(batch, None, log_probs)
        with timer("gen", t):
            generation = self.actor.generate_sequences.submit(prompts)
            # a rollout returns rollout.n rows per prompt: with as many critic dp ranks as rollout ones, critic
            # rank i reads rollout rank i's rows straight from Ray (DataProtoFuture.split_by_rank)
            values = self.critic.compute_values.submit(generation.split_by_rank())
            gen = generation.get()
        return self._with_generation(batch, gen), values

    def values_follow_generation(self, prompts: int) -> bool:
        """Whether :meth:`generate_and_start_values` can start the value forward on the generation's future: a
        critic group (``submit``), a rule reward (a reward model's forward runs before the values, not alongside
        them), and ``prompts`` x ``rollout.n`` rows that split evenly over the critic's dp ranks (a future's size
        is unknown when it is dispatched, so it cannot be padded)."""
        if self.critic is None or self.config.reward_model.enable:
            return False
        if not hasattr(self.critic.compute_values, "submit") or not hasattr(self.actor.generate_sequences, "submit"):
            return False
        rows = prompts * self.config.actor_rollout_ref.rollout.n
        return rows % self.critic.dispatch_info("critic").dp_size == 0

    def _prompts(self, batch: DataProto, seed_index: Optional[int], log_probs: tuple[str, ...]) -> DataProto:
        """The rollout's input (:meth:`pop_prompts`), asking for the ``log_probs`` forwards in the same call."""
        prompts = self.pop_prompts(batch, seed_index=seed_index)
        if log_probs:
            prompts.meta_info[LOG_PROBS_IN_GENERATE] = list(log_probs)
        return prompts

    def _with_generation(self, batch: DataProto, gen: DataProto) -> DataProto:
        """The prompts' rows repeated ``rollout.n`` times (a prompt's samples adjacent) joined with ``gen``; the
        generation's metrics go to :meth:`pop_gen_metrics`."""
        self.gen_metrics.update(gen.meta_info.pop("sync_metrics", {}))  # LoRA: the rollout's weights checked
        self.gen_metrics.update(gen.meta_info.pop("metrics", {}))  # the seconds of the in-call forwards
        return batch.repeat(self.config.actor_rollout_ref.rollout.n, interleave=True).union(gen)

    def score(self, batch: DataProto, t: dict[str, float]) -> None:
        """Add ``token_level_scores`` (B, R) (and ``reward_error``) from the reward, plus, with
        ``reward_model.overlong_buffer.enable``, DAPO's overlong penalty (``overlong_penalty`` (B,), on the last
        valid token)."""
        with timer("reward", t):
            scores = self.reward.compute_rm_score(batch)
        self._add_scores(batch, scores)

    def score_in_background(self, batch: DataProto) -> Any:
        """Start :meth:`score`'s reward call and return its future (``.get()``); the caller goes on with the actor's
        and critic's forwards and finishes with :meth:`finish_score`. A worker group's call is started without
        waiting (``compute_rm_score.submit``: its arguments are serialized before this returns); any other reward
        runs on a snapshot of ``batch`` (its own column dicts) in a driver thread."""
        submit = getattr(self.reward.compute_rm_score, "submit", None)
        if submit is not None:
            return submit(batch)
        return in_background(self.reward.compute_rm_score, batch.select())

    def finish_score(self, batch: DataProto, pending: Any, t: dict[str, float]) -> None:
        """Wait for :meth:`score_in_background`'s scores and add them as :meth:`score` does. The reward's worker
        seconds ran alongside other calls, so they are not counted in the step's worker time (the controller
        overhead stays step - worker seconds on the critical path); the wait is ``timing_s/reward``."""
        with timer("reward", t):
            scores = pending.get()
        scores.meta_info = {k: v for k, v in scores.meta_info.items() if not k.startswith(WORKER_TIME_PREFIX)}
        self._add_scores(batch, scores)

    def _add_scores(self, batch: DataProto, scores: DataProto) -> None:
        batch.union(scores)
        buffer = self.config.reward_model.overlong_buffer
        if buffer.enable:
            apply_overlong_penalty(batch, self.config.data.max_response_length, buffer.len, buffer.penalty_factor)

    def log_prob_forwards(self) -> tuple[str, ...]:
        """The actor group's forwards whose outputs a step reads on the driver: ``"ref"`` (``ref_log_prob``, when a
        KL term uses it, unless only the update's KL loss reads it: then the update call computes it,
        ``REF_IN_UPDATE``) and ``"old"`` (``old_log_probs``, unless pi_old is the rollout's
        (``algorithm.bypass_old_log_prob``) or the update's own detached logprobs
        (:mod:`hybridflow.trainer.old_log_prob`))."""
        if "log_prob_forwards" not in self._memo:  # the config is read-only: reading it once per run is enough
            self._memo["log_prob_forwards"] = self._log_prob_forwards()
        return self._memo["log_prob_forwards"]

    def _log_prob_forwards(self) -> tuple[str, ...]:
        alg = self.config.algorithm
        need_ref = alg.use_kl_in_reward or self.config.actor_rollout_ref.actor.use_kl_loss
        need_old = not alg.bypass_old_log_prob and not old_log_prob_is_current(self.config)
        ref_in_update = need_ref and not need_old and not alg.use_kl_in_reward and not alg.bypass_old_log_prob
        return tuple(name for name, needed in (("ref", need_ref and not ref_in_update), ("old", need_old)) if needed)

    def log_probs_in_generation(self) -> tuple[str, ...]:
        """The :meth:`log_prob_forwards` to run inside the generation call (:meth:`generate`'s ``log_probs``): all
        of them when the actor group generates in its training layout (the rollout's dp rank and collecting ranks
        are the training mesh's, so each rank's generated rows are rows it may score), else none (e.g. the
        3D-HybridEngine generating with another tp, or a pipeline-parallel actor)."""
        if "log_probs_in_generation" not in self._memo:  # the groups' layouts are fixed for the run
            self._memo["log_probs_in_generation"] = self._log_probs_in_generation()
        return self._memo["log_probs_in_generation"]

    def _log_probs_in_generation(self) -> tuple[str, ...]:
        info = getattr(self.actor, "dispatch_info", None)
        if info is None:
            return ()
        rollout, training = info("rollout"), info("actor")
        if (rollout.dp_rank, rollout.is_collect) != (training.dp_rank, training.is_collect):
            return ()
        return self.log_prob_forwards()

    def log_probs(self, batch: DataProto, t: dict[str, float]) -> None:
        """Add ``ref_log_prob`` (B, R) and ``old_log_probs`` (B, R) as :meth:`log_prob_forwards` asks, in one call
        of the actor's group when both are needed, unless the generation call already added them (:meth:`generate`
        with ``log_probs``); with ``algorithm.bypass_old_log_prob`` ``old_log_probs`` is the sampling policy's
        ``rollout_log_probs`` (no forward). When only the update's KL loss reads the reference logprobs, the update
        call computes them (``REF_IN_UPDATE``) and they never visit the driver."""
        alg = self.config.algorithm
        columns = {"ref": "ref_log_prob", "old": "old_log_probs"}
        wanted = self.log_prob_forwards()
        forwards = [f for f in wanted if columns[f] not in batch.batch]
        if forwards == ["ref", "old"]:  # both forwards run on the actor's group: one call, one transfer
            with timer("ref_and_old_log_prob", t):
                batch.union(self.actor.compute_ref_and_old_log_prob(batch))
        elif forwards == ["ref"]:
            with timer("ref", t):
                batch.union(self.actor.compute_ref_log_prob(batch))
        elif forwards == ["old"]:
            with timer("old_log_prob", t):
                batch.union(self.actor.compute_log_prob(batch))
        needs_ref = alg.use_kl_in_reward or self.config.actor_rollout_ref.actor.use_kl_loss
        if needs_ref and "ref" not in wanted:  # only the update's KL loss reads them (it logs rollout/kl itself)
            batch.meta_info[REF_IN_UPDATE] = True
        if alg.bypass_old_log_prob:
            batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]

    def values(self, batch: DataProto, t: dict[str, float], pending: Any = None,
               order: Optional[torch.Tensor] = None) -> None:
        """Add the critic's ``values`` (B, R) (nothing without a critic): from ``pending`` (the future
        :meth:`generate_and_start_values` started, its rows in generation order, put in the batch's ``order``:
        :func:`~hybridflow.trainer.balance.balance_order`) when given, else from a call on ``batch``."""
        if self.critic is None:
            return
        with timer("values", t):
            values = self.critic.compute_values(batch) if pending is None else pending.get()
        if pending is not None and order is not None:
            values.reorder(order)
        batch.union(values)

    def update_critic(self, batch: DataProto, t: dict[str, float]) -> dict[str, float]:
        """Update the critic (if any) on ``batch``; returns its metrics."""
        if self.critic is None:
            return {}
        with timer("update_critic", t):
            return absorb_metrics(self.critic.update_critic(batch), batch)

    def update_actor(self, batch: DataProto, t: dict[str, float]) -> dict[str, float]:
        """Update the actor on ``batch``; returns its metrics."""
        with timer("update_actor", t):
            return absorb_metrics(self.actor.update_actor(batch), batch)

    def update_critic_and_actor(self, batch: DataProto, t: dict[str, float]) -> dict[str, float]:
        """:meth:`update_critic`, then :meth:`update_actor`, on ``batch``; returns their metrics. Between worker
        groups the actor's call is submitted with the critic's (``submit_after``): it starts when the critic's has
        finished, with no driver round trip in between, and its arguments are sent while the critic trains."""
        critic_submit = getattr(getattr(self.critic, "update_critic", None), "submit", None)
        actor_after = getattr(self.actor.update_actor, "submit_after", None)
        if critic_submit is None or actor_after is None:
            return {**self.update_critic(batch, t), **self.update_actor(batch, t)}
        with timer("update_critic", t):
            critic = critic_submit(batch)
            actor = actor_after(critic, batch)
            metrics = absorb_metrics(critic.get(), batch)  # a critic failure is raised first, naming its rank
        with timer("update_actor", t):
            metrics.update(absorb_metrics(actor.get(), batch))
        return metrics

    def train_on(self, batch: DataProto, t: dict[str, float], scored: bool = False,
                 values: Any = None) -> dict[str, float]:
        """The rest of a step on a batch of generated samples: :meth:`prepare_update`, then the critic and actor
        updates (phase seconds into ``t``); returns the metrics."""
        metrics = self.prepare_update(batch, t, scored, values)
        metrics.update(self.update_critic_and_actor(batch, t))
        return metrics

    def prepare_update(self, batch: DataProto, t: dict[str, float], scored: bool = False,
                       values: Any = None) -> dict[str, float]:
        """Everything a step does to a generated batch before the updates: balancing, reward (unless ``scored``:
        :meth:`score` already ran; a rule reward runs alongside the next two, :meth:`score_in_background`),
        reference and old logprobs (:meth:`log_probs`), values (from ``values``, the future
        :meth:`generate_and_start_values` started, when given), advantages; returns the metrics so far."""
        order, balance = self._balance(batch)  # trainer.balance_batch: ~equal tokens per dp rank (before dispatch)
        pending = None
        if not scored and self.config.reward_model.enable:  # its forward would compete with the ones below
            self.score(batch, t)
        elif not scored:
            pending = self.score_in_background(batch)
        self.log_probs(batch, t)
        self.values(batch, t, values, order)
        if pending is not None:
            self.finish_score(batch, pending, t)
        with timer("adv", t):
            metrics = self.rewards_and_advantages(batch)
        return {**metrics, **balance}

    def _balance(self, batch: DataProto) -> tuple[Optional[torch.Tensor], dict[str, float]]:
        """With ``trainer.balance_batch``, reorder ``batch`` for the actor's dp ranks (:mod:`.balance`); returns
        the order (None: unchanged) and the balance metrics."""
        info = getattr(self.actor, "dispatch_info", None)
        if not self.config.trainer.balance_batch or info is None:
            return None, {}
        order, metrics = balance_order(batch, info("actor").dp_size)
        if order is not None:
            batch.reorder(order)
        return order, metrics

    def rewards_and_advantages(self, batch: DataProto) -> dict[str, float]:
        """``token_level_rewards`` (scores minus the in-reward KL when ``use_kl_in_reward``), then ``advantages``
        and ``returns`` with ``algorithm.adv_estimator``; returns the KL metrics."""
        alg = self.config.algorithm
        metrics = self.kl_rewards(batch)
        compute_advantage(batch, alg)
        return metrics

    def kl_rewards(self, batch: DataProto) -> dict[str, float]:
        """``token_level_rewards`` (B, R): ``token_level_scores`` minus beta * KL(actor || ref) with
        ``algorithm.use_kl_in_reward`` (updating the KL controller), else the scores; returns the KL metrics."""
        alg = self.config.algorithm
        if alg.use_kl_in_reward:
            return apply_kl_penalty(batch, self.kl_ctrl, alg.kl_penalty)
        batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
        return {}

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


class SharedWithPPO:
    """A driver attribute that lives on the :class:`PPOTrainer` the driver holds as ``self.ppo`` (``global_step``,
    ``data``), so the PPO phases it calls see the loop's step and cursor."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: Optional[type] = None) -> Any:
        return self if obj is None else getattr(obj.ppo, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj.ppo, self.name, value)


class _Pending(Future):
    """A thread's result: ``get()`` as a worker group's future has."""

    def get(self) -> Any:
        return self.result()


def warn_single_sample_groups(config: Any) -> None:
    """Warn once when a group-baseline estimator (GRPO, RLOO, REINFORCE++ with baseline) gets one sample per
    prompt: every advantage is then 0 and only a KL or entropy term moves the policy."""
    from hybridflow.config.checks import declared

    estimator = config.algorithm.adv_estimator
    if config.actor_rollout_ref.rollout.n == 1 and declared("adv_estimator", estimator, "needs_groups"):
        logger.warning("algorithm.adv_estimator=%s compares the samples of each prompt, but "
                       "actor_rollout_ref.rollout.n=1: every advantage is 0 (set rollout.n > 1)", estimator)


def in_background(fn: Any, *args: Any) -> _Pending:
    """``fn(*args)`` in a daemon thread (a call stuck at Ctrl-C or on a dead worker never holds up the exit);
    returns the future of its result or exception (``get()``)."""
    future = _Pending()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as err:  # noqa: BLE001 - handed to the waiting caller by future.get()
            future.set_exception(err)

    threading.Thread(target=run, name=f"background-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return future


def absorb_metrics(update_out: DataProto, batch: DataProto) -> dict[str, float]:
    """Return an update step's ``meta_info["metrics"]``; add its worker seconds to ``batch.meta_info``."""
    meta = dict(update_out.meta_info)
    metrics = meta.pop("metrics")
    add_worker_time(batch.meta_info, meta)
    return metrics
