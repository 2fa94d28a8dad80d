"""Does the auto-mapper's cost model rank placements of the quickstart like their measured step times?

The quickstart's roles (actor + rollout + reference in one process, critic, rule reward) on a 4-slot CPU pool,
in three placements the driver runs:

- ``colocate``: one pool of 4 ranks shared by actor, critic and reward;
- ``split``: actor on 2 ranks | critic + reward on 2 ranks;
- ``standalone``: actor on 2 ranks | critic on 1 rank | reward on 1 rank.

Every run uses the same batch sizes (32 prompts, n=1, mini-batches of 16, micro-batches of 4, so every pool size
divides them) and a local Ray cluster of 4 logical CPUs. Each placement's steady-state seconds per step come from
``benchmarks/step_profile.py`` (one subprocess and one Ray cluster per run). Each round runs the calibration
(below), then the three placements back to back, in the reverse order every other round, with the load average
recorded around each run (the machine may be shared).

The cost model (``hybridflow.mapping``, ``cpu`` device preset) estimates the same three placements for the
quickstart workload: 32 sequences of 32 prompt + 32 response tokens (responses are padded to
``data.max_response_length`` = 32, but the workers' forwards cut the slots after a batch's longest response and
sampling stops when every sequence has ended, so the model uses the calibration run's mean longest response,
about 16 tokens: :func:`effective_workload`), one PPO epoch, 2 mini-batches, micro-batches of 4 in training and of 16 in
forward passes (the schema's log-prob and value micro-batches), no activation recomputation, ZeRO-3 (hybridflow's
workers run FSDP2: per micro-batch and per FSDP unit parameter all-gathers and gradient reduce-scatters; the
rollout's weight sync all-gathers the weights tensor by tensor), data parallel only (tp = pp = 1: FSDP over the
pool, a full copy per rank for generation). The rule reward has no model, so it costs the model nothing; the
reference lives in the actor's ranks.

How the model describes this machine (nothing here is fitted to the three placements):

- the driver calls one worker group at a time (``CostParams.sequential_driver``, the default): a stage is the
  sum over sets, and while one group runs the other groups' ranks sleep in Ray;
- the node's cores are shared (``ClusterSpec.cores_per_node`` = this machine's cores): a running group of g ranks
  gives each rank s = min(1, cores / g) of a core: its FLOP/s, memory and gloo bandwidth are x s, its ring-step
  latency and its per-decode-step and per-collective CPU overheads / s;
- gloo collectives pay a latency on every ring step (``DeviceSpec.hop_latency``), so a collective over more ranks
  costs more.

Calibration, from measurements that are NOT the three compared, made at the start of every round and averaged
over the rounds: (1) gloo 1 KB all-reduces between 2 single-threaded processes: half their time is the latency
of one ring step, which replaces the preset's (the same all-reduce over 4 processes is reported next to the
model's prediction for it, as a check, and not used); (2) the quickstart on a 2-rank colocated pool (same batch
sizes), phase by phase. The model is linear in its overheads, each phase = model + call + K x collective +
D x decode_step, where K (FSDP collectives: 5 per forward, 60 per update on 2 ranks) and D (decode steps) come
from the model itself. Two equations, the mean forward phase (reference, old log-probs, values) and the mean
update phase (actor, critic), fix ``call_overhead_s`` and ``collective_overhead_s`` (FSDP's CPU work around each
unit's all-gather / reduce-scatter); the generate phase then fixes ``decode_step_overhead_s``; the step time
outside the six phases (reward, advantages, the driver) is added to every estimate as ``driver_s``. The three
placements' measurements never enter the estimates. ``by_round`` compares each round's measured order with the
estimates from that round's own calibration.

Also reported, as a diagnostic only: ``estimated_overlap_step_s``, the same calibrated model with the paper's
overlapping sets (``sequential_driver=False``: a stage takes the slowest set, every rank of the node counts as
busy), which is not how hybridflow's driver runs; and ``estimated_call_overhead_only_step_s``, calibrated with
no per-collective overhead (all unexplained time per call, as an earlier version of this benchmark did).

``--reuse FILE`` recomputes the estimates for the measurements of an earlier run's JSON (no new runs).

Prints ONE JSON object. Not part of the test suite (minutes of wall time; timing depends on the machine's load).

    python benchmarks/automap_cpu_ranking.py [--steps 6] [--rounds 2] [--reuse EARLIER.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from hybridflow.mapping import ClusterSpec, CostParams, MappingSearch, SearchSpace, Workload, get_device, get_model
from hybridflow.mapping.cost import allreduce_time

logger = logging.getLogger("automap_cpu_ranking")

SLOTS = 4
MODEL = "builtin:tiny-arith"
#: identical for every run: 4 logical CPUs; micro-batches of 4 divide the per-rank mini-batch of 4, 8 and 16
#: sequences; the batch-size check reads n_gpus_per_node, so it is set to the largest pool
COMMON = ["trainer.ray_init.num_cpus=4", "trainer.n_gpus_per_node=4",
          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4"]
WORKLOAD = Workload("ppo", batch=32, n=1, prompt_len=32, response_len=32, ppo_epochs=1, ppo_updates=2,
                    micro_batch=4, forward_micro_batch=16)
#: hybridflow's workers: FSDP2 (ZeRO-3), no activation checkpointing in the quickstart
BASE_PARAMS = CostParams(recompute=False, zero_stage=3)
GLOO_PROBE_BYTES = 1024  # the gloo latency probe: all-reduces of 256 fp32
#: step_profile's phases -> the cost model's phases they time (generate includes the rollout's weight sync)
#: (the quickstart needs both the reference and the old logprobs: the driver gets them in one call on the actor's
#: group, so the model's two forwards are one measured phase with one call overhead, not two)
PHASES = {"generate": ("actor.reshard", "actor.generate"), "ref_and_old_log_prob": ("reference.infer", "actor.infer"),
          "values": ("critic.infer",), "critic_update": ("critic.train",), "actor_update": ("actor.train",)}
INFER_PHASES = ("ref_and_old_log_prob", "values")
TRAIN_PHASES = ("critic_update", "actor_update")


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


def _gloo_worker(rank: int, world: int, port: int, reps: int, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # as hybridflow's worker ranks
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x = torch.zeros(GLOO_PROBE_BYTES // 4)
    for _ in range(20):
        dist.all_reduce(x)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(x)
    if rank == 0:
        queue.put((time.perf_counter() - start) / reps)
    dist.destroy_process_group()


def gloo_allreduce_s(world: int, reps: int = 200) -> float:
    """Mean seconds of a 1 KB fp32 gloo all-reduce over ``world`` local processes with one thread each."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_gloo_worker, args=(r, world, port, reps, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    seconds = queue.get(timeout=300)
    for proc in procs:
        proc.join(timeout=60)
    return seconds


def measure_calibration(steps: int, timeout_s: float) -> dict:
    """The non-compared measurements: the quickstart on the 2-rank colocated pool, and gloo 1 KB all-reduces
    over 2 ranks (the per-step latency: half of it) and over 4 ranks (a check of the model, not used)."""
    run = measure(CALIBRATION, steps, timeout_s)
    gloo2, gloo4 = gloo_allreduce_s(2), gloo_allreduce_s(SLOTS)
    return {"step_s": round(run["step_s"], 4), "phase_s": {k: round(v, 4) for k, v in run["phase_s"].items()},
            "response_length_max": run.get("response_length_max"),
            "gloo_allreduce_1kb_s": {"2": round(gloo2, 6), str(SLOTS): round(gloo4, 6)},
            "load_1min": [run["load_1min_before"], run["load_1min_after"]]}


# ---------------------------------------------------------------------------------------------- estimating


def cluster(ranks: int, hop_latency_s: float | None = None) -> ClusterSpec:
    """``ranks`` CPU ranks on this machine: one node whose ranks share its cores; ``hop_latency_s`` (measured)
    replaces the preset's gloo latency per ring step."""
    cpu = get_device("cpu")
    if hop_latency_s is not None:
        cpu = dataclasses.replace(cpu, intra_latency_s=hop_latency_s, inter_latency_s=hop_latency_s)
    return ClusterSpec(1, ranks, cpu, cores_per_node=os.cpu_count() or 1)


def model_search(ranks: int, params: CostParams, hop_latency_s: float | None) -> MappingSearch:
    """The cost model of the quickstart on ``ranks`` ranks, limited to the layouts it runs: data parallel only
    (FSDP over every rank of a pool; the hf rollout generates with a full copy on each rank)."""
    model = get_model(MODEL)
    return MappingSearch({"actor": model, "reference": model, "critic": model, "reward": None}, WORKLOAD,
                         cluster(ranks, hop_latency_s), params, SearchSpace(max_tp=1, max_pp=1))


def estimate(placement: Placement, ranks: int, params: CostParams, hop_latency_s: float | None) -> dict:
    plan = model_search(ranks, params, hop_latency_s).plan(placement.sets, placement.devices)
    if plan is None:
        raise RuntimeError(f"the cost model finds no feasible layout for {placement.sets} on {placement.devices}")
    return {"step_s": plan.seconds, "stages_s": plan.stage_seconds,
            "phases_s": {f"{p.role}.{p.kind}": p.seconds for s in plan.sets for p in s.phases},
            "plan": plan.describe()}


def _model_phases(params: CostParams, hop_latency_s: float | None) -> dict[str, float]:
    """The model's seconds of each measured phase (``PHASES``) of the calibration placement."""
    est = estimate(CALIBRATION, sum(CALIBRATION.devices), params, hop_latency_s)["phases_s"]
    return {name: sum(est.get(k, 0.0) for k in keys) for name, keys in PHASES.items()}


def _solve_overheads(r_inf: float, k_inf: float, r_train: float, k_train: float) -> tuple[float, float]:
    """Non-negative (call, collective) overheads with call + k·collective = r for the forward and the training
    phases: the exact solution when it is non-negative, else the best fit with the negative one at zero."""
    coll = (r_train - r_inf) / (k_train - k_inf) if k_train != k_inf else 0.0
    call = r_inf - k_inf * coll
    if coll >= 0 and call >= 0:
        return call, coll
    if coll < 0:
        return max(0.0, (r_inf + r_train) / 2), 0.0
    return 0.0, max(0.0, (k_inf * r_inf + k_train * r_train) / (k_inf ** 2 + k_train ** 2))


def calibrate(cal: dict, per_collective: bool = True) -> tuple[CostParams, float | None, float, dict]:
    """Overheads from the calibration measurements ``cal`` (``measure_calibration``; module docstring).

    The model is linear in its overheads: phase = model + call + K·collective + D·decode_step, with K (FSDP
    collectives) and D (decode steps) read off the model itself. The gloo ring-step latency is half the
    2-rank 1 KB all-reduce. ``call_overhead_s`` and ``collective_overhead_s`` solve the mean forward phase
    (reference, old log-probs, values: few collectives) and the mean training phase (actor and critic updates:
    many); ``per_collective=False`` sets the collective overhead to 0 and fits the call overhead alone (a
    diagnostic). ``decode_step_overhead_s`` closes the generate phase. The step time outside the six phases
    (reward, advantages, the driver) is the ``driver_s`` added to every estimate.

    Returns:
        The parameters, the ring-step latency, driver_s and a report.
    """
    gloo = cal["gloo_allreduce_1kb_s"]
    hop = gloo["2"] / 2
    base = _model_phases(BASE_PARAMS, hop)
    unit = 1e-3

    def coefficient(field: str) -> dict[str, float]:
        bumped = _model_phases(dataclasses.replace(BASE_PARAMS, **{field: unit}), hop)
        return {k: (bumped[k] - base[k]) / unit for k in base}

    k_coll, k_call, k_dec = (coefficient(f) for f in ("collective_overhead_s", "call_overhead_s",
                                                      "decode_step_overhead_s"))
    meas = cal["phase_s"]
    resid = {k: meas[k] - base[k] for k in PHASES}
    r_inf, r_train = (statistics.mean(resid[k] for k in group) for group in (INFER_PHASES, TRAIN_PHASES))
    k_inf, k_train = (statistics.mean(k_coll[k] for k in group) for group in (INFER_PHASES, TRAIN_PHASES))
    if per_collective:
        call, coll = _solve_overheads(r_inf, k_inf, r_train, k_train)
    else:
        call, coll = max(0.0, statistics.mean(resid[k] for k in INFER_PHASES + TRAIN_PHASES)), 0.0
    gen_left = resid["generate"] - k_call["generate"] * call - k_coll["generate"] * coll
    decode = max(0.0, gen_left / k_dec["generate"])
    params = dataclasses.replace(BASE_PARAMS, call_overhead_s=call, collective_overhead_s=coll,
                                 decode_step_overhead_s=decode)
    driver = max(0.0, cal["step_s"] - sum(meas[k] for k in PHASES))
    fitted = _model_phases(params, hop)
    report = {"measured_step_s": round(cal["step_s"], 4), "measured_phase_s": {k: round(meas[k], 4) for k in PHASES},
              "gloo_hop_latency_s": round(hop, 6),
              "fsdp_collectives_per_phase": {k: round(v) for k, v in k_coll.items()},
              "call_overhead_s": round(call, 5), "collective_overhead_s": round(coll, 6),
              "decode_step_overhead_s": round(decode, 6), "driver_s": round(driver, 4),
              "model_phase_s_calibrated": {k: round(v, 4) for k, v in fitted.items()},
              "model_step_s_calibrated": round(estimate(CALIBRATION, sum(CALIBRATION.devices), params, hop)["step_s"]
                                               + driver, 4)}
    # the model's own prediction for the 1 KB all-reduce over 4 ranks sharing the cores, against the measurement
    shared = model_search(SLOTS, params, hop).contended(SLOTS)[0]
    report["gloo_4_ranks_check_s"] = {"measured": gloo[str(SLOTS)],
                                      "model": round(allreduce_time(GLOO_PROBE_BYTES, SLOTS, 1, shared), 6)}
    return params, hop, driver, report


def effective_workload(cals: list[dict]) -> Workload:
    """``WORKLOAD`` with the response length the workers actually compute over: hybridflow's forwards cut the
    response slots after a batch's longest response, and the decode loop stops when every row has ended, so
    the calibration run's mean longest response (rounded up) replaces the padded ``max_response_length``.
    Outputs of this script from before that measurement existed keep the padded length."""
    lengths = [c["response_length_max"] for c in cals if c.get("response_length_max")]
    if not lengths:
        return WORKLOAD
    return dataclasses.replace(WORKLOAD, response_len=math.ceil(statistics.mean(lengths)))


def mean_calibration(cals: list[dict]) -> dict:
    """The calibration measurements averaged over the rounds."""
    return {"step_s": statistics.mean(c["step_s"] for c in cals),
            "phase_s": {k: statistics.mean(c["phase_s"][k] for c in cals) for k in PHASES},
            "gloo_allreduce_1kb_s": {k: statistics.mean(c["gloo_allreduce_1kb_s"][k] for c in cals)
                                     for k in cals[0]["gloo_allreduce_1kb_s"]}}


# ---------------------------------------------------------------------------------------------- main


def order(values: dict[str, float]) -> list[str]:
    return sorted(values, key=values.__getitem__)


def run_measurements(args: argparse.Namespace) -> list[dict]:
    """``args.rounds`` rounds, each a calibration (``measure_calibration``) then the three placements, in
    alternating order: per round its calibration and step_s, phase_s and load_1min per placement."""
    names, rounds = list(PLACEMENTS), []
    for r in range(args.rounds):
        logger.info("round %d: calibration %s", r + 1, CALIBRATION.overrides())
        cal = measure_calibration(args.steps, args.timeout)
        logger.info("  %s", cal)
        run_order = names if r % 2 == 0 else names[::-1]
        runs = {}
        for name in run_order:
            logger.info("round %d: %s", r + 1, name)
            runs[name] = measure(PLACEMENTS[name], args.steps, args.timeout)
            logger.info("  step_s %.3f (load %.1f -> %.1f)", runs[name]["step_s"], runs[name]["load_1min_before"],
                        runs[name]["load_1min_after"])
        rounds.append({"calibration": cal, "order_run": run_order,
                       "step_s": {n: round(runs[n]["step_s"], 4) for n in names},
                       "load_1min": {n: [runs[n]["load_1min_before"], runs[n]["load_1min_after"]] for n in names},
                       "phase_s": {n: {k: round(v, 4) for k, v in runs[n]["phase_s"].items()} for n in names}})
    return rounds


def reuse_measurements(path: str) -> tuple[list[dict], int]:
    """The rounds and steps per run of an earlier output of this script.

    Raises:
        ValueError: a round without its own calibration (an output of an earlier version of this script).
    """
    prev = json.loads(Path(path).read_text())
    if any("phase_s" not in rd.get("calibration", {}) for rd in prev["rounds"]):
        raise ValueError(f"{path}: its rounds carry no calibration phases (an earlier version's output)")
    return prev["rounds"], prev["steps_per_run"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="steps per run; the first (warm-up) is not averaged")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the placements, alternating order")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per run")
    parser.add_argument("--reuse", metavar="FILE", default=None,
                        help="estimate for the measurements in an earlier output of this script (no runs)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)

    if args.reuse:
        rounds, steps = reuse_measurements(args.reuse)
    else:
        rounds, steps = run_measurements(args), args.steps
    names = list(PLACEMENTS)
    global WORKLOAD
    WORKLOAD = effective_workload([rd["calibration"] for rd in rounds])
    params, hop, driver, calibration = calibrate(mean_calibration([rd["calibration"] for rd in rounds]))
    logger.info("calibrated: %s", calibration)
    call_only, _, call_only_driver, call_only_report = calibrate(mean_calibration([rd["calibration"] for rd in rounds]),
                                                                 per_collective=False)
    overlap = dataclasses.replace(params, sequential_driver=False)

    def step(placement: str, p: CostParams, h: float, d: float) -> float:
        return estimate(PLACEMENTS[placement], SLOTS, p, h)["step_s"] + d

    measured = {n: statistics.mean(rd["step_s"][n] for rd in rounds) for n in names}
    estimates = {n: estimate(PLACEMENTS[n], SLOTS, params, hop) for n in names}
    estimated = {n: estimates[n]["step_s"] + driver for n in names}
    estimated_overlap = {n: step(n, overlap, hop, driver) for n in names}
    estimated_call_only = {n: step(n, call_only, hop, call_only_driver) for n in names}
    by_round = []
    for rd in rounds:  # each round against the estimates from its own calibration
        p, h, d, _ = calibrate(rd["calibration"])
        est = {n: round(step(n, p, h, d), 4) for n in names}
        by_round.append({"estimated_step_s": est, "estimated_order": order(est),
                         "measured_order": order(rd["step_s"]), "agree": order(est) == order(rd["step_s"])})
    loads = [x for rd in rounds for pair in rd["load_1min"].values() for x in pair]
    result = {
        "workload": dataclasses.asdict(WORKLOAD), "model": MODEL, "slots": SLOTS, "cores": os.cpu_count(),
        "steps_per_run": steps, "reused_measurements": args.reuse, "calibration": calibration,
        "cost_params": dataclasses.asdict(params),
        "load_1min": {"min": min(loads), "max": max(loads), "mean": round(statistics.mean(loads), 2)},
        "placements": {n: {
            "ranks": PLACEMENTS[n].ranks, "overrides": PLACEMENTS[n].overrides(),
            "measured_step_s": round(measured[n], 4),
            "measured_step_s_by_round": [rd["step_s"][n] for rd in rounds],
            "measured_phase_s": {k: round(statistics.mean(rd["phase_s"][n][k] for rd in rounds), 4)
                                 for k in rounds[0]["phase_s"][n]},
            "estimated_step_s": round(estimated[n], 4),
            "estimated_stages_s": {k: round(v, 4) for k, v in estimates[n]["stages_s"].items()},
            "estimated_phases_s": {k: round(v, 4) for k, v in estimates[n]["phases_s"].items()},
            "estimated_overlap_step_s": round(estimated_overlap[n], 4),
            "estimated_call_overhead_only_step_s": round(estimated_call_only[n], 4),
            "model_plan": estimates[n]["plan"]} for n in names},
        "measured_order": order(measured),
        "estimated_order": order(estimated),
        "estimated_overlap_order": order(estimated_overlap),
        "estimated_call_overhead_only_order": order(estimated_call_only),
        "call_overhead_only_calibration": {k: call_only_report[k] for k in ("call_overhead_s",
                                                                             "decode_step_overhead_s", "driver_s")},
        "by_round": by_round,
        "rounds": rounds,
    }
    result["orders_agree"] = result["measured_order"] == result["estimated_order"]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
