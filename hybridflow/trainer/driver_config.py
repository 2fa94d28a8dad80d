"""The built-in drivers' own hyper-parameters: the config dataclasses their registrations declare (``config=``, keys of
``algorithm`` or, for ``async``, the top-level ``async_training`` section), the load checks of those keys
(``config_checks=``, run for every registered driver) and the async driver's checks of the run it is chosen for
(:func:`async_problems`, its ``config_problems``). The keys are verl's where verl has them; the schema gets them
from the registrations (:mod:`hybridflow.config.assemble`), so this module imports nothing from the config package.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

Get = Callable[[str], Any]

__all__ = ["AsyncDriverConfig", "AsyncTrainingConfig", "FilterGroupsConfig", "LagrangianConfig", "PPODriverConfig",
           "SafeRLHFDriverConfig", "async_config_problems", "async_problems", "off_policy_problems",
           "ppo_config_problems", "safe_rlhf_config_problems"]


@dataclass
class FilterGroupsConfig:
    # DAPO dynamic sampling (Yu et al. 2025, sec. 3.2): drop groups whose responses all got the same metric and
    # generate from further prompt batches until data.train_batch_size informative groups are gathered
    enable: bool = False
    metric: str = "acc"  # acc | score (the task score before overlong shaping) | seq_reward (after shaping)
    max_num_gen_batches: int = 0  # generation batches allowed per step; <= 0 means no limit (as in verl)
    on_limit: str = "error"  # at the limit with too few groups: error (stop, verl's way) | train (on those found)


@dataclass
class PPODriverConfig:
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)  # DAPO dynamic sampling (ppo)


@dataclass
class LagrangianConfig:
    # Safe-RLHF (Dai et al. 2023) multiplier lambda of the constraint "mean episode cost <= threshold"
    threshold: float = 0.0  # cost limit d: the constraint is mean episode cost <= threshold
    lambda_init: float = 1.0  # initial lambda (> 0; kept as log lambda)
    lambda_lr: float = 0.1  # ascent step on log lambda per unit of constraint violation, per training step
    lambda_max: Optional[float] = None  # upper bound on lambda; None means unbounded
    # lower bound on lambda (0 <= lambda_min <= lambda_init; 0: none): bounds the steps lambda needs to recover
    # after a long stretch below the threshold (not in the paper; its lambda only stays >= 0)
    lambda_min: float = 0.01
    episode_cost_window_size: int = 128  # the latest N episode costs are averaged for the update


@dataclass
class SafeRLHFDriverConfig:
    lagrangian: LagrangianConfig = field(default_factory=LagrangianConfig)  # used by driver safe_rlhf


@dataclass
class AsyncTrainingConfig:
    # algorithm.driver=async (LlamaRL, arXiv 2505.24034): generators on their own pool (resource_pool.mapping.
    # generator) keep sampling while the trainer (the actor's pool) updates; weights are pushed after every update
    max_staleness: int = 1  # k: a sample of policy version v is trained on only while the trainer's version <= v + k
    queue_size: Optional[int] = None  # generation requests (batches) in flight; None means max_staleness + 1
    generator_quantization: str = "none"  # none | int8 (generator weights int8 per output channel; hf backend)
    weight_sync_timeout_s: float = 60.0  # a weight transfer waiting longer (a dead or missing peer) raises


@dataclass
class AsyncDriverConfig:
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)  # driver async


def _one_of(key: str, value: Any, allowed: tuple[str, ...]) -> list[str]:
    if value in allowed:
        return []
    close = difflib.get_close_matches(str(value), allowed, n=1)
    return [f"{key}: {value!r} is not one of {', '.join(allowed)}" + (f"; did you mean {close[0]}?" if close else "")]


def ppo_config_problems(get: Get) -> list[str]:
    """``algorithm.filter_groups``: a known metric and limit behaviour."""
    key = "algorithm.filter_groups"
    return (_one_of(f"{key}.metric", get(f"{key}.metric"), ("acc", "score", "seq_reward"))
            + _one_of(f"{key}.on_limit", get(f"{key}.on_limit"), ("error", "train")))


def safe_rlhf_config_problems(get: Get) -> list[str]:
    """``algorithm.lagrangian``: lambda_init > 0, lambda_lr >= 0, a window >= 1, ordered bounds."""
    lam = "algorithm.lagrangian"
    lam_init, lam_max, lam_min = get(f"{lam}.lambda_init"), get(f"{lam}.lambda_max"), get(f"{lam}.lambda_min")
    problems = []
    if lam_init <= 0:
        return [f"{lam}.lambda_init: must be > 0 (lambda is kept as log lambda), got {lam_init}"]
    if get(f"{lam}.lambda_lr") < 0:
        problems.append(f"{lam}.lambda_lr: must be >= 0, got {get(f'{lam}.lambda_lr')}")
    if get(f"{lam}.episode_cost_window_size") < 1:
        problems.append(f"{lam}.episode_cost_window_size: must be >= 1, got {get(f'{lam}.episode_cost_window_size')}")
    if lam_max is not None and lam_max < lam_init:
        problems.append(f"{lam}.lambda_max ({lam_max}) must be null or >= {lam}.lambda_init ({lam_init})")
    if not 0 <= lam_min <= lam_init:
        problems.append(f"{lam}.lambda_min ({lam_min}) must be in [0, {lam}.lambda_init ({lam_init})] (0: no floor)")
    return problems


def async_config_problems(get: Get) -> list[str]:
    """``async_training.generator_quantization``: none or int8 (the rest is checked when the driver is selected)."""
    key = "async_training.generator_quantization"
    return _one_of(key, get(key), ("none", "int8"))


MAX_QUEUE = 32  # generation requests in flight; the generator worker has MAX_QUEUE + 2 threads


def async_problems(get: Get) -> list[str]:
    """The checks of a run with ``algorithm.driver=async`` (its :meth:`~hybridflow.trainer.driver.Driver.
    config_problems`): the generators on a pool of their own, a non-negative staleness bound, a queue that fits, a
    rollout that generates from int8 weights when asked to, an off-policy correction (:func:`off_policy_problems`).
    Raises nothing: returns the problems."""
    from hybridflow.rollout import ROLLOUTS  # importing the package registers the built-in backends

    problems = []
    mapping = get("resource_pool.mapping") or {}
    generator, actor = mapping.get("generator"), mapping.get("actor", "global_pool")
    if generator is None or generator == actor:
        problems.append("algorithm.driver=async runs the generators on their own devices: set "
                        "resource_pool.pools with a pool for them and resource_pool.mapping.generator to it (not the "
                        f"actor's pool {actor!r}), e.g. resource_pool.pools={{trainer: [1], gen: [1]}} "
                        "resource_pool.mapping={actor: trainer, generator: gen}")
    k, queue = get("async_training.max_staleness"), get("async_training.queue_size")
    if k < 0:
        problems.append(f"async_training.max_staleness must be >= 0, got {k}")
    if queue is not None and queue < 1:
        problems.append(f"async_training.queue_size must be null or >= 1, got {queue}")
    pools = get("resource_pool.pools") or {}
    tp_g = get("actor_rollout_ref.rollout.tensor_model_parallel_size")
    if generator in pools:
        ranks = sum(pools[generator])
        batch = get("data.train_batch_size")
        if ranks % tp_g or batch % (ranks // tp_g):
            problems.append(f"data.train_batch_size ({batch}) must split evenly over the generators' data-parallel "
                            f"ranks: pool {generator!r} has {ranks} ranks / rollout.tensor_model_parallel_size "
                            f"{tp_g}")
    if (queue if queue is not None else k + 1) > MAX_QUEUE:
        problems.append(f"async_training.queue_size (default max_staleness + 1 = {k + 1}) must be <= {MAX_QUEUE}: "
                        "each request in flight holds a generator thread")
    rollout = get("actor_rollout_ref.rollout.name")
    if (get("async_training.generator_quantization") == "int8"
            and not ROLLOUTS.declared(rollout, "supports_int8_quantization", True)):
        problems.append("async_training.generator_quantization=int8 needs a rollout that generates from the quantized "
                        f"module: actor_rollout_ref.rollout.name="
                        f"{' | '.join(ROLLOUTS.names(supports_int8_quantization=True))}, got {rollout}")
    return problems + off_policy_problems(get)


def off_policy_problems(get: Get) -> list[str]:
    """With ``max_staleness >= 1`` the async driver trains on samples of a policy mu up to k versions behind pi.
    Recomputed old logprobs are pi_old (the trainer's current weights), so a PPO-clip loss without a correction
    treats mu's samples as on-policy (a biased gradient; LlamaRL, arXiv 2505.24034). Accepted corrections:
    AIPO (weights by min(pi/mu, rho)), truncated IS (weights by min(pi_old/mu, cap)), or mu as pi_old
    (``bypass_old_log_prob``: the clipped ratio is then pi/mu). Raises nothing: returns the problems."""
    from hybridflow.algorithms import POLICY_LOSSES

    actor = "actor_rollout_ref.actor"
    k = get("async_training.max_staleness")
    corrected = (POLICY_LOSSES.declared(get(f"{actor}.policy_loss"), "corrects_off_policy")
                 or (get(f"{actor}.tis_imp_ratio_cap") or -1) > 0 or get("algorithm.bypass_old_log_prob"))
    if k < 1 or corrected:
        return []
    return [f"algorithm.driver=async with async_training.max_staleness={k} trains on samples up to {k} policy "
            f"version(s) old, but {actor}.policy_loss={get(f'{actor}.policy_loss')} with recomputed old logprobs and "
            f"no truncated IS treats them as on-policy: set {actor}.policy_loss="
            f"{' | '.join(POLICY_LOSSES.names(corrects_off_policy=True))}, or "
            f"{actor}.tis_imp_ratio_cap=<cap > 0> (e.g. 2.0), or algorithm.bypass_old_log_prob=true, "
            "or async_training.max_staleness=0"]
