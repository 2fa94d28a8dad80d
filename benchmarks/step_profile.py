"""Where a quickstart PPO step spends its time, and how close each phase runs to the machine's matmul rate.

Runs a few quickstart steps through the real Ray worker groups and prints ONE JSON line: seconds per phase (driver
wall time: generate, reward, reference, old logprobs (or both in one call), values, advantages, critic update, actor
update; reference and old logprobs run inside the generation call are its worker seconds, taken out of generate's),
the same phases measured inside the workers (the slowest rank's), the controller's own overhead (step time in which
no worker method ran, from the methods' wall-clock spans over all ranks: dispatch, serialization, object store,
driver math) as a fraction of the step, and per phase the FLOPs, the achieved GFLOP/s and its fraction of a plain
fp32 matmul loop measured in the same run with the same process/thread layout (the run's ranks as processes, one
thread each, all at once, 2 s): the loop runs before the workers start and again after every step (in the driver,
while the workers wait), and each step's fraction is against the mean of the loops just before and just after it,
because the machine drifts (on a 2-core EPYC the loop measured 113-162 GFLOP/s within minutes);
``matmul_gflop_per_s_by_step`` and ``phase_matmul_fraction_by_step`` show both. Steps after the first ``--warmup``
are averaged. One warm-up step covers start-up; the medium model needs about three: each worker's heap grows during
its first updates (the activations of a fwd+bwd, around generation's buffers), and every new page faults once
(measured on a 2-core EPYC, medium GRPO shape: 360k, 260k and 25k minor page faults in a worker's first three
updates, the update taking 13.7, 11.0, 11.7, then 9.3-10.1 s); ``update_s_by_step`` shows the trend.

FLOPs (Kaplan et al. 2020): 2N per token for a forward, 6N for forward + backward, N the model's parameters
(attention scores not counted). Forward and update phases count the tokens they compute (valid tokens, plus the
padding the padded path computes: ``padding_frac`` of the computed tokens, from the actor/critic updates'
``perf/*_computed_tokens``; negative when packed forwards compute a prompt shared by several samples once,
:mod:`hybridflow.training.shared_prompt`: then FLOPs count the tokens computed); generation counts the valid prompt
and response tokens (useful FLOPs).

    python benchmarks/step_profile.py [--steps 4] [--warmup 1] [--recipe quickstart]
                                      [--model builtin:tiny-arith|medium|DIR]
                                      [key=value ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
from typing import Iterator

PHASES = {"generate": "gen", "reward": "reward", "reference": "ref", "old_log_prob": "old_log_prob",
          "ref_and_old_log_prob": "ref_and_old_log_prob",  # both forwards in one call (when a step needs both)
          "values": "values", "advantages": "adv", "critic_update": "update_critic", "actor_update": "update_actor"}
# phase -> (FLOPs per token in units of N, whose padding fraction applies: actor, critic or None = valid tokens)
PHASE_FLOPS = {"generate": (2, None), "reference": (2, "actor"), "old_log_prob": (2, "actor"),
               "ref_and_old_log_prob": (4, "actor"),
               "values": (2, "critic"), "critic_update": (6, "critic"), "actor_update": (6, "actor")}
MATMUL_SIZE = 1024  # the fp32 matmul of the reference rate
LOOP_SECONDS = 2.0  # each timing of the matmul loop


def padding_fraction(rows: list[dict], role: str) -> float | None:
    """1 - valid / computed tokens of ``role``'s training forwards over ``rows`` (None when not logged)."""
    computed = sum(r.get(f"perf/{role}_computed_tokens", 0.0) for r in rows)
    valid = sum(r.get(f"perf/{role}_valid_tokens", 0.0) for r in rows)
    return 1.0 - valid / computed if computed else None


def phase_flops(params: int, sequences: int, tokens_per_sequence: float, epochs: int,
                padding: dict[str, float | None], ref_in_update: bool = False) -> dict[str, float]:
    """FLOPs per step of each phase of :data:`PHASE_FLOPS` for ``sequences`` sequences of ``tokens_per_sequence``
    valid tokens (updates: ``epochs`` passes), computed tokens = valid / (1 - padding fraction of the role).
    ``ref_in_update``: the actor update's call also ran the reference forward (2N per token, once)."""
    flops = {}
    for phase, (per_token, role) in PHASE_FLOPS.items():
        frac = padding.get(role) if role else 0.0
        if frac is None:
            continue
        passes = epochs if phase.endswith("update") else 1
        flops[phase] = per_token * params * sequences * tokens_per_sequence * passes / (1.0 - frac)
    if ref_in_update and "actor_update" in flops:
        flops["actor_update"] += 2 * params * sequences * tokens_per_sequence / (1.0 - padding["actor"])
    return flops


def _ranks(cfg) -> int:
    return cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes


@contextlib.contextmanager
def _loop_after_each_step(ranks: int) -> Iterator[dict[int, float]]:
    """Time the matmul loop (``ranks`` processes, FLOP/s) in the driver right after each step's metrics are logged,
    while the workers wait for the next step: yields ``{step: rate}``, filled as the run goes."""
    from hybridflow.distributed.precision import matmul_rate
    from hybridflow.utils.tracking import Tracking

    rates: dict[int, float] = {}
    log = Tracking.log

    def log_then_time(self, data, step: int) -> None:
        log(self, data, step)
        rates[step] = matmul_rate(ranks, seconds=LOOP_SECONDS, size=MATMUL_SIZE)

    Tracking.log = log_then_time
    try:
        yield rates
    finally:
        Tracking.log = log


def _run(args) -> tuple[list[dict], object, int, dict[int, float]]:
    """Train ``args.steps`` steps; returns the metrics rows, the config, the parameter count and the matmul loop's
    rates (FLOP/s) by step: ``0`` just before the workers start, ``s`` right after step ``s``."""
    from hybridflow.config import load_config
    from hybridflow.models.presets import parameter_count, resolve_benchmark_model

    with tempfile.TemporaryDirectory() as out:
        model = [f"actor_rollout_ref.model.path={resolve_benchmark_model(args.model, out)}"] if args.model else []
        cfg = load_config(args.recipe, [f"trainer.total_training_steps={args.steps}", "trainer.test_freq=-1",
                                         "trainer.val_before_train=false", f"trainer.default_local_dir={out}",
                                         "trainer.logger=[jsonl]", "trainer.plot_curves=false", *model,
                                         *args.overrides])
        params = parameter_count(cfg.actor_rollout_ref.model.path)
        from hybridflow.distributed.precision import matmul_rate  # torch: only once the arguments are good
        from hybridflow.trainer.main import run_ppo

        before = matmul_rate(_ranks(cfg), seconds=LOOP_SECONDS, size=MATMUL_SIZE)
        with _loop_after_each_step(_ranks(cfg)) as rates:
            run_ppo(cfg)
        with open(f"{out}/metrics.jsonl") as f:
            rows = [json.loads(line) for line in f]
    return rows, cfg, params, {0: before, **rates}


#: phase -> the worker method whose seconds (``timing_worker_s/<method>``) time it when logged: the driver's calls
#: return futures and overlap, so its wall-clock phases (``timing_s/*``) are waits, not the phases' work
WORKER_METHODS = {"generate": "generate_sequences", "reference": "compute_ref_log_prob",
                  "old_log_prob": "compute_log_prob", "values": "compute_values", "critic_update": "update_critic",
                  "actor_update": "update_actor"}


def phase_seconds(rows: list[dict]) -> dict[str, float]:
    """Mean seconds per phase over ``rows``: the worker seconds of its method when logged, else driver wall time;
    reference and old-logprob forwards run inside the generation call (older runs) are their worker seconds, taken
    out of generate's."""
    def avg(key: str) -> float:
        return statistics.mean(r.get(key, 0.0) for r in rows)

    def logged(key: str) -> bool:
        return any(key in r for r in rows)

    phase_s = {name: avg(f"timing_worker_s/{WORKER_METHODS[name]}")
               if name in WORKER_METHODS and logged(f"timing_worker_s/{WORKER_METHODS[name]}")
               else avg(f"timing_s/{key}") for name, key in PHASES.items()}
    for phase, name in (("reference", "ref"), ("old_log_prob", "old")):
        seconds = avg(f"timing_worker_s/{name}_log_prob_in_generate")
        if seconds:
            phase_s[phase] = seconds
            phase_s["generate"] -= seconds
    return phase_s


def step_flops(row: dict, cfg, params: int) -> dict[str, float]:
    """:func:`phase_flops` of one metrics row (its prompt and response lengths and padding fractions)."""
    sequences = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
    tokens = row.get("prompt_length/mean", 0.0) + row.get("response_length/mean", 0.0)
    padding = {role: padding_fraction([row], role) for role in ("actor", "critic")}
    return phase_flops(params, sequences, tokens, cfg.actor_rollout_ref.actor.ppo_epochs, padding,
                       "timing_worker_s/ref_log_prob_in_update" in row)


def matmul_fractions(rows: list[dict], cfg, params: int, rates: dict[int, float]) -> dict[str, list[float]]:
    """Per phase, each row's achieved FLOP/s over the mean of the matmul loop's rates just before and just after
    that step (``rates[step - 1]``, ``rates[step]``), row by row."""
    fractions: dict[str, list[float]] = {}
    for row in rows:
        loop = statistics.mean((rates[row["step"] - 1], rates[row["step"]]))
        phase_s = phase_seconds([row])
        for phase, flops in step_flops(row, cfg, params).items():
            if phase_s.get(phase):
                fractions.setdefault(phase, []).append(flops / phase_s[phase] / loop)
    return fractions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1, help="first steps not averaged (default 1)")
    parser.add_argument("--recipe", default="quickstart", help="a shipped recipe name or a YAML path")
    parser.add_argument("--model", default=None, help="a preset (medium), builtin:NAME or a local HF directory")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.warmup < 1 or args.steps <= args.warmup:  # the first step is start-up; at least one step is timed
        parser.error(f"--steps must exceed --warmup >= 1 (warm-up steps are not timed), got --steps {args.steps} "
                     f"--warmup {args.warmup}")
    load_before = os.getloadavg()
    rows, cfg, params, rates = _run(args)
    steady = rows[args.warmup:] or rows

    def avg(key: str) -> float:
        return statistics.mean(r.get(key, 0.0) for r in steady)

    phase_s = phase_seconds(steady)
    per_step = [step_flops(r, cfg, params) for r in steady]
    flops = {k: statistics.mean(f.get(k, 0.0) for f in per_step) for k in per_step[0]}
    fractions = matmul_fractions(steady, cfg, params, rates)
    print(json.dumps({
        "benchmark": "step_profile", "model": cfg.actor_rollout_ref.model.path, "parameters": params,
        "overrides": args.overrides, "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()], "ranks": _ranks(cfg),
        "steps_measured": len(steady), "step_s": avg("timing_s/step"), "phase_s": phase_s,
        "worker_s": {k.split("/", 1)[1]: avg(k) for k in steady[0] if k.startswith("timing_worker_s/")},
        "controller_overhead_frac": avg("timing_s/controller_overhead_frac"),
        # the same, from summed worker seconds (the definition before worker spans): overlapping calls count twice
        "controller_overhead_frac_summed": statistics.mean(
            max(0.0, r["timing_s/step"] - sum(v for k, v in r.items() if k.startswith("timing_worker_s/")))
            / r["timing_s/step"] for r in steady),
        "ref_log_prob_in_update_s": avg("timing_worker_s/ref_log_prob_in_update") or None,
        "tokens_per_s": avg("perf/throughput"),
        "response_length_max": avg("response_length/max"),  # tokens: the longest response of a step's batch
        "padding_frac": {role: padding_fraction(steady, role) for role in ("actor", "critic")},
        "update_s_by_step": {name: [r.get(f"timing_s/{PHASES[name]}", 0.0) for r in rows]  # warm-up shows here
                             for name in ("actor_update", "critic_update") if phase_s[name]},
        "phase_gflop": {k: v / 1e9 for k, v in flops.items()},
        "phase_gflop_per_s": {k: v / phase_s[k] / 1e9 for k, v in flops.items() if phase_s.get(k)},
        "matmul_size": MATMUL_SIZE, "matmul_gflop_per_s_by_step": [rates[s] / 1e9 for s in sorted(rates)],
        "phase_matmul_fraction": {k: statistics.mean(v) for k, v in fractions.items()},
        "phase_matmul_fraction_by_step": fractions,
    }))


if __name__ == "__main__":
    import sys

    from hybridflow.cli import run_script

    sys.exit(run_script(main))  # a config typo or a bad path: one line, not a traceback
