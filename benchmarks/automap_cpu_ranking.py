"""Does the auto-mapper's cost model rank placements of the quickstart like their measured step times?

The quickstart's roles (actor + rollout + reference in one process, critic, rule reward) on a 4-slot CPU pool,
in three placements the driver runs:

- ``colocate``: one pool of 4 ranks shared by actor, critic and reward;
- ``split``: actor on 2 ranks | critic + reward on 2 ranks;
- ``standalone``: actor on 2 ranks | critic on 1 rank | reward on 1 rank.

Every run uses the same batch sizes (32 prompts, n=1, mini-batches of 16, micro-batches of 4, so every pool size
divides them) and a local Ray cluster of 4 logical CPUs. Each placement's steady-state seconds per step come from
``benchmarks/step_profile.py`` (one subprocess and one Ray cluster per run); the three are run back to back, then
again in the reverse order, with the load average recorded around each run (the machine may be shared).

The cost model (``hybridflow.mapping``, ``cpu`` device preset) estimates the same three placements for the
quickstart workload: 32 sequences of 32 prompt + 32 response tokens (responses are padded to
``data.max_response_length`` = 32 in every forward/backward; sampling usually stops after ~15 tokens when every
sequence of a rank has ended), one PPO epoch, 2 mini-batches, micro-batch 4, no activation recomputation.
The rule reward has no model, so it costs the model nothing; the reference lives in the actor's ranks. With more
ranks than cores, the preset's per-rank compute and memory bandwidth are divided by ranks / cores, as its
documentation says.

Calibration, done once per invocation from a run that is NOT one of the three compared: the quickstart on a
2-rank colocated pool (same batch sizes). With the model's Python overheads at zero, two equations fix them:

    generate_measured = generate_model + call + R x decode_step       (R = 32 nominal decode steps)
    step_measured     = step_model     + 6 call + R x decode_step      (6 model calls per PPO step)

so ``call_overhead_s`` also absorbs the reward, the advantages and the driver's own time (the model has no other
term for them). The three placements' measurements never enter the estimates.

Also reported, as a diagnostic only: ``estimated_serial_step_s``, the sum of every phase of every set. The cost
model (HybridFlow §6) lets sets on different devices run a stage at the same time; hybridflow's PPO driver calls
one worker group at a time, so on it nothing overlaps.

Prints ONE JSON object. Not part of the test suite (minutes of wall time; timing depends on the machine's load).

    python benchmarks/automap_cpu_ranking.py [--steps 6] [--rounds 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from hybridflow.mapping import ClusterSpec, CostParams, MappingSearch, Workload, get_device, get_model

logger = logging.getLogger("automap_cpu_ranking")

SLOTS = 4
MODEL = "builtin:tiny-arith"
#: identical for every run: 4 logical CPUs; micro-batches of 4 divide the per-rank mini-batch of 4, 8 and 16
#: sequences; the batch-size check reads n_gpus_per_node, so it is set to the largest pool
COMMON = ["trainer.ray_init.num_cpus=4", "trainer.n_gpus_per_node=4",
          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4"]
WORKLOAD = Workload("ppo", batch=32, n=1, prompt_len=32, response_len=32, ppo_epochs=1, ppo_updates=2,
                    micro_batch=4)
MODEL_CALLS = 6  # generate, old log-probs, reference, values, critic update, actor update


@dataclasses.dataclass(frozen=True)
class Placement:
    """A placement as the driver runs it (pools, role -> pool) and as the cost model sees it (sets of models with
    a model, devices per set)."""

    pools: dict[str, list[int]]
    mapping: dict[str, str]
    sets: tuple[tuple[str, ...], ...]
    devices: tuple[int, ...]

    def overrides(self) -> list[str]:
        pools = ", ".join(f"{name}: {sizes}" for name, sizes in self.pools.items())
        mapping = ", ".join(f"{role}: {pool}" for role, pool in self.mapping.items())
        return [f"resource_pool.pools={{{pools}}}", f"resource_pool.mapping={{{mapping}}}"]

    @property
    def ranks(self) -> dict[str, int]:
        return {role: sum(self.pools[pool]) for role, pool in self.mapping.items()}


# The actor's pool is named global_pool: roles a run does not use (reward_model, ...) default to that name.
PLACEMENTS = {
    "colocate": Placement({"global_pool": [4]}, {"actor": "global_pool", "critic": "global_pool",
                                                 "reward": "global_pool"},
                          (("actor", "reference", "critic"),), (4,)),
    "split": Placement({"global_pool": [2], "critic_pool": [2]}, {"actor": "global_pool", "critic": "critic_pool",
                                                                  "reward": "critic_pool"},
                       (("actor", "reference"), ("critic",)), (2, 2)),
    "standalone": Placement({"global_pool": [2], "critic_pool": [1], "reward_pool": [1]},
                            {"actor": "global_pool", "critic": "critic_pool", "reward": "reward_pool"},
                            (("actor", "reference"), ("critic",)), (2, 1)),  # the reward's rank holds no model
}
CALIBRATION = Placement({"global_pool": [2]}, {"actor": "global_pool", "critic": "global_pool",
                                               "reward": "global_pool"},
                        (("actor", "reference", "critic"),), (2,))


# ---------------------------------------------------------------------------------------------- measuring


def measure(placement: Placement, steps: int, timeout_s: float) -> dict:
    """One ``step_profile.py`` run of ``placement`` in a subprocess (its own Ray cluster, shut down at exit):
    its JSON result plus the 1-minute load average before and after and the wall time."""
    cmd = [sys.executable, str(Path(__file__).with_name("step_profile.py")), "--steps", str(steps),
           *COMMON, *placement.overrides()]
    load_before, start = os.getloadavg()[0], time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    out = {"load_1min_before": round(load_before, 2), "load_1min_after": round(os.getloadavg()[0], 2),
           "wall_s": round(time.perf_counter() - start, 1)}
    if proc.returncode != 0:
        raise RuntimeError(f"step_profile failed (rc {proc.returncode}) for {placement.overrides()}:\n"
                           f"{proc.stderr[-3000:]}")
    return {**_last_json(proc.stdout), **out}


def _last_json(text: str) -> dict:
    """The last JSON object in ``text`` that starts on its own line (step_profile prints one at the end)."""
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("{"):
            try:
                return json.JSONDecoder().raw_decode("\n".join(lines[i:]))[0]
            except json.JSONDecodeError:
                continue
    raise ValueError(f"no JSON object in step_profile output: {text[-500:]!r}")


# ---------------------------------------------------------------------------------------------- estimating


def cluster(ranks: int) -> ClusterSpec:
    """``ranks`` CPU ranks on this machine: the ``cpu`` preset, its per-rank compute and memory bandwidth divided
    by the oversubscription ranks / cores when there are more ranks than cores."""
    cpu = get_device("cpu")
    over = max(1.0, ranks / (os.cpu_count() or 1))
    return ClusterSpec(1, ranks, dataclasses.replace(cpu, peak_flops=cpu.peak_flops / over, mem_bw=cpu.mem_bw / over))


def model_search(ranks: int, params: CostParams) -> MappingSearch:
    model = get_model(MODEL)
    return MappingSearch({"actor": model, "reference": model, "critic": model, "reward": None}, WORKLOAD,
                         cluster(ranks), params)


def estimate(placement: Placement, ranks: int, params: CostParams) -> dict:
    plan = model_search(ranks, params).plan(placement.sets, placement.devices)
    if plan is None:
        raise RuntimeError(f"the cost model finds no feasible layout for {placement.sets} on {placement.devices}")
    serial = sum(s.seconds for s in plan.sets)
    return {"step_s": plan.seconds, "serial_step_s": serial, "stages_s": plan.stage_seconds,
            "phases_s": {f"{p.role}.{p.kind}": p.seconds for s in plan.sets for p in s.phases},
            "plan": plan.describe()}


def calibrate(measured: dict) -> tuple[CostParams, dict]:
    """``call_overhead_s`` and ``decode_step_overhead_s`` from the calibration run (module docstring)."""
    base = CostParams(recompute=False)
    est = estimate(CALIBRATION, sum(CALIBRATION.devices), base)
    gen_model = est["phases_s"]["actor.generate"]
    gen_meas, step_meas = measured["phase_s"]["generate"], measured["step_s"]
    call = max(0.0, (step_meas - gen_meas - (est["step_s"] - gen_model)) / (MODEL_CALLS - 1))
    decode = max(0.0, (gen_meas - gen_model - call) / WORKLOAD.response_len)
    params = dataclasses.replace(base, call_overhead_s=call, decode_step_overhead_s=decode)
    check = estimate(CALIBRATION, sum(CALIBRATION.devices), params)["step_s"]
    return params, {"placement": "colocate on 2 ranks", "measured_step_s": round(step_meas, 4),
                    "measured_generate_s": round(gen_meas, 4), "model_step_s_without_overheads": round(est["step_s"], 4),
                    "call_overhead_s": round(call, 5), "decode_step_overhead_s": round(decode, 6),
                    "model_step_s_calibrated": round(check, 4)}


# ---------------------------------------------------------------------------------------------- main


def order(values: dict[str, float]) -> list[str]:
    return sorted(values, key=values.__getitem__)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="steps per run; the first (warm-up) is not averaged")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the placements, alternating order")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per run")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)

    logger.info("calibration run: %s", CALIBRATION.overrides())
    cal_run = measure(CALIBRATION, args.steps, args.timeout)
    params, calibration = calibrate(cal_run)
    calibration["load_1min"] = [cal_run["load_1min_before"], cal_run["load_1min_after"]]
    logger.info("calibrated: %s", calibration)

    names = list(PLACEMENTS)
    rounds = []
    for r in range(args.rounds):
        run_order = names if r % 2 == 0 else names[::-1]
        runs = {}
        for name in run_order:
            logger.info("round %d: %s", r + 1, name)
            runs[name] = measure(PLACEMENTS[name], args.steps, args.timeout)
            logger.info("  step_s %.3f (load %.1f -> %.1f)", runs[name]["step_s"], runs[name]["load_1min_before"],
                        runs[name]["load_1min_after"])
        rounds.append({"order_run": run_order, "step_s": {n: round(runs[n]["step_s"], 4) for n in names},
                       "load_1min": {n: [runs[n]["load_1min_before"], runs[n]["load_1min_after"]] for n in names},
                       "runs": runs})

    measured = {n: statistics.mean(rd["step_s"][n] for rd in rounds) for n in names}
    estimates = {n: estimate(PLACEMENTS[n], SLOTS, params) for n in names}
    estimated = {n: estimates[n]["step_s"] for n in names}
    result = {
        "workload": dataclasses.asdict(WORKLOAD), "model": MODEL, "slots": SLOTS, "cores": os.cpu_count(),
        "steps_per_run": args.steps, "calibration": calibration,
        "placements": {n: {
            "ranks": PLACEMENTS[n].ranks, "overrides": PLACEMENTS[n].overrides(),
            "measured_step_s": round(measured[n], 4),
            "measured_step_s_by_round": [rd["step_s"][n] for rd in rounds],
            "measured_phase_s": {k: round(statistics.mean(rd["runs"][n]["phase_s"][k] for rd in rounds), 4)
                                 for k in rounds[0]["runs"][n]["phase_s"]},
            "estimated_step_s": round(estimated[n], 4),
            "estimated_stages_s": {k: round(v, 4) for k, v in estimates[n]["stages_s"].items()},
            "estimated_phases_s": {k: round(v, 4) for k, v in estimates[n]["phases_s"].items()},
            "estimated_serial_step_s": round(estimates[n]["serial_step_s"], 4),
            "model_plan": estimates[n]["plan"]} for n in names},
        "measured_order": order(measured),
        "measured_order_by_round": [order(rd["step_s"]) for rd in rounds],
        "estimated_order": order(estimated),
        "estimated_serial_order": order({n: estimates[n]["serial_step_s"] for n in names}),
        "rounds": [{**{k: v for k, v in rd.items() if k != "runs"},
                    "phase_s": {n: {k: round(v, 4) for k, v in rd["runs"][n]["phase_s"].items()} for n in names}}
                   for rd in rounds],
    }
    result["orders_agree"] = result["measured_order"] == result["estimated_order"]
    result["orders_agree_by_round"] = [o == result["estimated_order"] for o in result["measured_order_by_round"]]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
