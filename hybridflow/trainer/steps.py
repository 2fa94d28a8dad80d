"""Driver-side steps of the PPO family that are light tensor math over the whole batch.

They run on the driver because they need the whole batch (advantage whitening and GRPO groups span all dp
chunks) and cost O(B x R), far less than moving the batch to a worker and back.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Iterable, Optional

import torch

from hybridflow.algorithms import get_adv_estimator_fn, kl_penalty, masked_mean, overlong_reward_penalty
from hybridflow.protocol import DataProto
from hybridflow.rollout.multi_turn import multi_turn_metrics
from hybridflow.workers.timing import WORKER_SPAN_PREFIX, WORKER_TIME_PREFIX

if TYPE_CHECKING:
    from hybridflow.algorithms.kl import KLController

logger = logging.getLogger(__name__)


def apply_kl_penalty(data: DataProto, kl_ctrl: KLController, kl_penalty_type: str = "kl") -> dict[str, float]:
    """In-reward KL (Ziegler et al. 2019, eq. 2; Ouyang et al. 2022, eq. 2): ``token_level_rewards`` (B, R) =
    ``token_level_scores`` - beta * KL(old_log_probs || ref_log_prob) on valid tokens. Updates ``kl_ctrl`` with
    the batch's mean per-sequence KL and returns metrics. Adds ``token_level_rewards`` to ``data`` in place."""
    mask = data.batch["response_mask"].float()
    kld = kl_penalty(data.batch["old_log_probs"], data.batch["ref_log_prob"], kl_penalty_type) * mask
    beta = kl_ctrl.value
    data.batch["token_level_rewards"] = data.batch["token_level_scores"] - beta * kld
    current_kl = masked_mean(kld, mask, axis=-1).mean().item()
    kl_ctrl.update(current_kl=current_kl, n_steps=len(data))
    return {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}


def apply_overlong_penalty(data: DataProto, max_response_length: int, buffer_len: int, penalty_factor: float) -> None:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13; :func:`~hybridflow.algorithms.overlong_reward_penalty`)
    of each response's length (the valid tokens of ``response_mask`` (B, R), never the prompt), added to
    ``token_level_scores`` (B, R) on the response's last valid token; the penalties are kept as
    ``overlong_penalty`` (B,) fp32. In place."""
    mask = data.batch["response_mask"]
    penalty = overlong_reward_penalty(mask.sum(-1), max_response_length, buffer_len, penalty_factor)
    data.batch["overlong_penalty"] = penalty
    from hybridflow.workers.reward_worker import place_scores  # the workers import Ray: not at config load

    data.batch["token_level_scores"] = data.batch["token_level_scores"] + place_scores(penalty, mask).to(
        data.batch["token_level_scores"].device)


def compute_advantage(data: DataProto, algorithm_config: Any) -> None:
    """Adds ``advantages`` and ``returns`` (B, R) fp32 to ``data`` with the estimator named by
    ``algorithm_config.adv_estimator`` (see :mod:`hybridflow.algorithms.advantage` for the calling convention).
    Passes what the batch has: ``values`` (B, R), the group ids ``uid`` (B,) and, from the ReMax driver,
    ``reward_baselines`` (B,)."""
    b = data.batch
    fn = get_adv_estimator_fn(algorithm_config.adv_estimator)
    advantages, returns = fn(
        token_level_rewards=b["token_level_rewards"],
        response_mask=b["response_mask"],
        values=b.get("values"),
        index=data.non_tensor_batch.get("uid"),
        reward_baselines=b.get("reward_baselines"),
        config=algorithm_config,
    )
    b["advantages"], b["returns"] = advantages, returns


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/max": values.max().item(),
            f"{prefix}/min": values.min().item()}


def compute_data_metrics(data: DataProto) -> dict[str, float]:
    """Batch statistics logged every step: scores, rewards, advantages, returns, values, lengths, the fraction of
    truncated responses (``response_length/clip_ratio``), DAPO's overlong penalty (mean, fraction penalised), KL
    to the reference, entropy and ``rollout/logprob_diff_max`` (max |sampling logprob - recomputed old logprob| over
    valid tokens: 0 up to numerics when the rollout and the actor compute the same distribution)."""
    b = data.batch
    mask = b["response_mask"].bool()
    maskf = mask.float()
    metrics: dict[str, float] = {}
    metrics.update(_stats("critic/score", b["token_level_scores"].sum(-1)))
    metrics.update(_stats("critic/rewards", b["token_level_rewards"].sum(-1)))
    metrics.update(_stats("critic/advantages", b["advantages"][mask]))
    metrics.update(_stats("critic/returns", b["returns"][mask]))
    if "values" in b:
        metrics.update(_stats("critic/values", b["values"][mask]))
    metrics.update(_stats("response_length", maskf.sum(-1)))
    metrics.update(_stats("prompt_length", b["attention_mask"][:, : -mask.shape[1]].float().sum(-1)))
    if "reward_error" in b:  # rows scored reward_model.error_score (raised or timed out)
        metrics["reward/errors"] = float(b["reward_error"].sum())
    if "reward_timeout" in b:  # of those, the rows whose call ran past reward_model.timeout_s
        metrics["reward/timeouts"] = float(b["reward_timeout"].sum())
    # responses cut by the length limit: the rollout's flag (eos-aware), else those that filled every slot
    truncated = b["truncated"] if "truncated" in b else maskf.sum(-1) >= mask.shape[1]
    metrics["response_length/clip_ratio"] = truncated.float().mean().item()
    if "overlong_penalty" in b:
        metrics["dapo/overlong_penalty_mean"] = b["overlong_penalty"].mean().item()
        metrics["dapo/overlong_penalised_frac"] = (b["overlong_penalty"] < 0).float().mean().item()
    if "ref_log_prob" in b and "old_log_probs" in b:  # without old_log_probs the actor update logs these
        kl = b["old_log_probs"] - b["ref_log_prob"]
        metrics["rollout/kl"] = masked_mean(kl, maskf).item()
    if "entropys" in b:
        metrics["actor/entropy"] = masked_mean(b["entropys"], maskf).item()
    if "rollout_log_probs" in b and "old_log_probs" in b:
        diff = (b["rollout_log_probs"] - b["old_log_probs"]).abs()[mask]
        metrics["rollout/logprob_diff_max"] = diff.max().item() if diff.numel() else 0.0
    metrics.update(multi_turn_metrics(data))  # turns, tool calls/errors/latency, finish reasons (multi-turn only)
    return metrics


def add_worker_time(meta_info: dict, other_meta: dict) -> None:
    """Add the worker seconds (``worker_s/*`` keys) of ``other_meta`` to ``meta_info``, summing a method that ran
    more than once in the step (e.g. ``update_critic`` of a reward and a cost critic), and its wall-clock spans
    (``worker_span/*``: lists of ``(start, end)``), concatenated."""
    for key, value in other_meta.items():
        if key.startswith(WORKER_TIME_PREFIX):
            meta_info[key] = meta_info.get(key, 0.0) + value
        elif key.startswith(WORKER_SPAN_PREFIX):
            meta_info[key] = [*meta_info.get(key, []), *value]


def covered_seconds(spans: Iterable[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of ``[start, end]`` inside at least one of ``spans`` (``(start, end)`` pairs, any order, overlapping
    or not): the length of their union clipped to the window."""
    total, reach = 0.0, start
    for a, b in sorted((max(a, start), min(b, end)) for a, b in spans):
        counted_from = max(a, reach)  # the part before reach is counted already
        if b > counted_from:
            total += b - counted_from
            reach = b
    return total


def compute_timing_metrics(meta_info: dict, step_seconds: float, step_end: Optional[float] = None) -> dict[str, float]:
    """Worker-side seconds per step (``timing_worker_s/<method>``, from the ``worker_s/*`` meta_info keys the
    worker steps add) and the controller's own share of the step, ``timing_s/controller_overhead_frac``: the
    fraction of the step (the ``step_seconds`` up to ``step_end``, a ``time.time()``; default now) in which no worker
    method ran, from the methods' wall-clock spans (``worker_span/*``, each over all ranks of its call: rank
    imbalance is not overhead; calls that overlap, on other resource pools, count once). Without spans (workers
    that do not report them): (step - sum of worker seconds) / step."""
    worker = {k[len(WORKER_TIME_PREFIX):]: v for k, v in meta_info.items() if k.startswith(WORKER_TIME_PREFIX)}
    metrics = {f"timing_worker_s/{k}": v for k, v in worker.items()}
    spans = [span for k, v in meta_info.items() if k.startswith(WORKER_SPAN_PREFIX) for span in v]
    if spans:
        end = time.time() if step_end is None else step_end
        busy = covered_seconds(spans, end - step_seconds, end)
    else:
        busy = sum(worker.values())
    metrics["timing_s/controller_overhead_frac"] = max(0.0, step_seconds - busy) / step_seconds
    return metrics


def step_metrics(batch: DataProto, metrics: dict[str, float], times: dict[str, float]) -> dict[str, float]:
    """End a step: ``metrics`` (changed in place and returned) plus the batch statistics, the phase seconds
    ``times`` (with ``step``) as ``timing_s/*``, the worker/controller time split and the throughput (tokens of
    ``attention_mask`` per second)."""
    metrics.update(compute_data_metrics(batch), **{f"timing_s/{k}": v for k, v in times.items()})
    metrics.update(compute_timing_metrics(batch.meta_info, times["step"]))
    tokens = int(batch.batch["attention_mask"].sum())
    metrics.update({"perf/total_num_tokens": tokens, "perf/throughput": tokens / times["step"]})
    return metrics


def read(out: Any) -> DataProto:
    """``out`` itself, or, for a call's future (``__dataproto_future__``), its ``get()`` (waits for the call)."""
    return out.get() if getattr(type(out), "__dataproto_future__", False) else out


def absorb_metrics(update_out: Any, batch: DataProto) -> dict[str, float]:
    """Return an update call's ``meta_info["metrics"]`` (waits for the call); add its worker seconds to
    ``batch.meta_info``."""
    meta = dict(read(update_out).meta_info)
    metrics = meta.pop("metrics")
    add_worker_time(batch.meta_info, meta)
    return metrics


def warn_single_sample_groups(config: Any) -> None:
    """Warn once when a group-baseline estimator (GRPO, RLOO, REINFORCE++ with baseline) gets one sample per
    prompt: every advantage is then 0 and only a KL or entropy term moves the policy."""
    from hybridflow.algorithms import ADV_ESTIMATORS

    estimator = config.algorithm.adv_estimator
    if config.actor_rollout_ref.rollout.n == 1 and ADV_ESTIMATORS.declared(estimator, "needs_groups"):
        logger.warning("algorithm.adv_estimator=%s compares the samples of each prompt, but "
                       "actor_rollout_ref.rollout.n=1: every advantage is 0 (set rollout.n > 1)", estimator)
