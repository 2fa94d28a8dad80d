"""``hybridflow plan``: search device placements and parallel sizes with the cost model (HybridFlow §6).

    hybridflow plan --cluster 16x8:A100-80G --algorithm ppo --actor 7B [--critic 13B --reward rule ...]
                    [--batch 1024 --prompt-len 1024 --response-len 1024 --ppo-epochs 1 --top-k 5]
                    [--cost-preset cpu|a100-paper] [--engine fsdp2|unrestricted] [--explain] [--json]
                    [--emit-config FILE]

Prints the best plan as tables (stage times, per-role layouts and times, memory per set), the baselines and
the top-k; ``--json`` prints one JSON object instead; ``--emit-config FILE`` writes the YAML snippet that
``hybridflow train`` runs (see ``hybridflow.mapping.emit``). The search covers only what the engine (``--engine``,
default fsdp2: ``hybridflow.mapping.abilities``) runs; what it left out is listed with the reason. Exit status: 0 a
plan was found, 1 no plan fits, 2 bad arguments (unknown preset, malformed cluster, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from hybridflow.mapping.abilities import ENGINE_ABILITIES, UNRESTRICTED, get_abilities
from hybridflow.mapping.cost import CostParams
from hybridflow.mapping.dataflow import STAGES
from hybridflow.mapping.emit import write_config
from hybridflow.mapping.presets import COST_PRESETS, get_cost_preset
from hybridflow.mapping.search import MappingSearch, Plan, SearchResult, SearchSpace
from hybridflow.mapping.sensitivity import sensitivity
from hybridflow.mapping.specs import ALGORITHMS, ClusterSpec, SpecError, Workload, get_model, parse_cluster

__all__ = ["HELP", "add_arguments", "run"]

HELP = "choose device placement and parallel sizes with the cost model (HybridFlow §6)"
NO_MODEL = ("rule", "none")  # --reward rule: a rule-based reward, no model on the devices
GB = 1e9


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``hybridflow plan``."""
    parser.add_argument("--cluster", required=True, metavar="NxD:DEVICE[@CORES]",
                        help="NODES x DEVICES per node : device preset (A100-80G, H100, H200, cpu), e.g. "
                             "16x8:A100-80G; @CORES: CPU ranks share that many cores per node, e.g. 1x4:cpu@2")
    parser.add_argument("--algorithm", choices=tuple(ALGORITHMS), default="ppo")
    parser.add_argument("--actor", required=True, metavar="MODEL",
                        help="preset (7B, 13B, 34B, 70B, tiny-arith) or a local HF model directory")
    for role in ("critic", "reference", "cost", "cost-critic"):
        parser.add_argument(f"--{role}", metavar="MODEL", default=None,
                            help=f"model of the {role} (default: the actor's)")
    parser.add_argument("--reward", metavar="MODEL", default="rule",
                        help="model of the reward (a scorer with a trained score head: a preset or a local HF "
                             "directory), or 'rule' (default): a rule-based reward, no model on the devices")
    workload = parser.add_argument_group("workload")
    workload.add_argument("--batch", type=int, default=1024, help="prompts per iteration")
    workload.add_argument("--n", type=int, default=1, help="responses per prompt")
    workload.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens")
    workload.add_argument("--response-len", type=int, default=1024, help="response tokens")
    workload.add_argument("--ppo-epochs", type=int, default=1)
    workload.add_argument("--ppo-updates", type=int, default=1, help="optimizer steps (mini-batches) per epoch")
    workload.add_argument("--micro-batch", type=int, default=1, help="sequences per forward/backward per rank")
    workload.add_argument("--forward-micro-batch", type=int, default=None,
                          help="sequences per forward-only pass per rank (default: --micro-batch)")
    model = parser.add_argument_group("cost model (each flag overrides the preset's value)")
    model.add_argument("--cost-preset", choices=tuple(COST_PRESETS), default="cpu",
                       help="parameter set: cpu (dataclass defaults, no fixed overheads, sequential driver) or "
                            "a100-paper (the HybridFlow paper's testbed and overlapping sets; "
                            "hybridflow/mapping/presets.py lists each value's source)")
    for flag, help_text in (("--train-mfu", "MFU of training"), ("--infer-mfu", "MFU of forward passes"),
                            ("--gen-mbu", "memory-bandwidth use in decoding"),
                            ("--mem-usable", "usable fraction of memory"),
                            ("--decode-step-overhead", "fixed seconds per decode step (launches, sampling, Python)"),
                            ("--call-overhead", "fixed seconds per model call (dispatch, data movement)"),
                            ("--layer-overhead", "fixed seconds per layer per micro-batch pass (kernel launches)"),
                            ("--stage-overhead", "fixed seconds per stage (driver barrier)")):
        model.add_argument(flag, type=float, default=None, help=help_text)
    model.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=None,
                       help="sharding of training states over dp (3: FSDP, as hybridflow's workers)")
    model.add_argument("--no-recompute", action="store_true", help="no activation checkpointing")
    model.add_argument("--overlap-sets", action="store_true",
                       help="the paper's model: sets on different devices run a stage at the same time (default: "
                            "one worker group at a time, as hybridflow's synchronous drivers run; a100-paper "
                            "overlaps already)")
    space = parser.add_argument_group("search")
    space.add_argument("--max-tp", type=int, default=None, help="largest tensor-parallel size (default: node size)")
    space.add_argument("--max-pp", type=int, default=None, help="largest pipeline-parallel size")
    space.add_argument("--max-gen-pp", type=int, default=None,
                       help="largest pipeline-parallel size of generation (1: tp x dp only, as hybridflow's rollouts "
                            "and vLLM generate; default: --max-pp)")
    space.add_argument("--engine", choices=(*ENGINE_ABILITIES, UNRESTRICTED.name), default="fsdp2",
                       help="training engine whose abilities bound the search (declared by its registration, "
                            "hybridflow/training/*_config.py; default fsdp2, what `hybridflow train` runs by "
                            "default); unrestricted: any layout and placement, as the paper's system (cannot be "
                            "emitted as a config)")
    space.add_argument("--unit", type=int, default=None, help="set sizes: divisors and multiples of this "
                                                              "(default: devices per node)")
    parser.add_argument("--top-k", type=int, default=5, help="plans to list")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--explain", action="store_true",
                        help="sensitivity: re-run the search with each cost parameter at the ends of its plausible "
                             "range and list the values that change the chosen placement (JSON: 'sensitivity')")
    parser.add_argument("--emit-config", metavar="FILE", default=None,
                        help="write the config snippet (pools, mapping, layouts) for `hybridflow train`")


def _models(args: argparse.Namespace, roles: tuple[str, ...]):
    actor = get_model(args.actor)
    out = {}
    for role in roles:
        name = args.actor if role == "actor" else getattr(args, role)
        if role == "reward" and name is not None and name.lower() in NO_MODEL:
            out[role] = None
        else:
            out[role] = actor if name is None else get_model(name)
    return out


def _build(args: argparse.Namespace) -> tuple[MappingSearch, Workload]:
    cluster = parse_cluster(args.cluster)
    workload = Workload(args.algorithm, args.batch, args.n, args.prompt_len, args.response_len, args.ppo_epochs,
                        args.ppo_updates, args.micro_batch, forward_micro_batch=args.forward_micro_batch)
    params = _params(args)
    space = SearchSpace(args.max_tp, args.max_pp, args.unit, args.max_gen_pp)
    if args.top_k < 1:
        raise SpecError(f"--top-k must be >= 1, got {args.top_k}")
    if args.emit_config and args.engine == UNRESTRICTED.name:
        raise SpecError(f"--emit-config needs an engine `hybridflow train` runs (--engine "
                        f"{' | '.join(ENGINE_ABILITIES)}), not unrestricted")
    abilities = get_abilities(args.engine)
    return MappingSearch(_models(args, workload.roles), workload, cluster, params, space, abilities), workload


def _params(args: argparse.Namespace) -> CostParams:
    """The preset, with every cost flag the user gave replacing its value."""
    flags = {"train_mfu": args.train_mfu, "infer_mfu": args.infer_mfu, "gen_mbu": args.gen_mbu,
             "mem_usable": args.mem_usable, "decode_step_overhead_s": args.decode_step_overhead,
             "call_overhead_s": args.call_overhead, "layer_overhead_s": args.layer_overhead,
             "stage_overhead_s": args.stage_overhead, "zero_stage": args.zero}
    changes = {k: v for k, v in flags.items() if v is not None}
    if args.no_recompute:
        changes["recompute"] = False
    if args.overlap_sets:
        changes["sequential_driver"] = False
    return dataclasses.replace(get_cost_preset(args.cost_preset), **changes)


def run(args: argparse.Namespace) -> int:
    """Handler of ``hybridflow plan``; returns the exit status."""
    args.cost_critic = getattr(args, "cost_critic", None)
    try:
        searcher, workload = _build(args)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = searcher.run(args.top_k)
    explained = _explain(searcher, result.best) if args.explain and result.best is not None else None
    if args.json:
        print(json.dumps({"cluster": str(searcher.cluster), "devices": searcher.cluster.n_devices,
                          "sequential_driver": searcher.params.sequential_driver,
                          "engine": searcher.abilities.name,
                          "workload": _workload_dict(workload),
                          "models": {r: m.name for r, m in searcher.models.items()}, **result.to_dict(),
                          **({"sensitivity": explained} if explained is not None else {})}))
    else:
        print(format_result(result, searcher))
        if explained is not None:
            print("\n" + format_sensitivity(explained))
    if result.best is None:
        if not args.json:
            print("no plan fits: every placement runs out of device memory; use more devices or smaller models",
                  file=sys.stderr)
        return 1
    if args.emit_config:
        try:
            write_config(args.emit_config, result.best, searcher.cluster, workload, searcher.models,
                         searcher.abilities)
        except (SpecError, OSError) as exc:
            print(f"error: cannot write {args.emit_config}: {exc}", file=sys.stderr)
            return 2
        if not args.json:
            print(f"\nwrote the config snippet to {args.emit_config}")
    return 0


def _explain(searcher: MappingSearch, best: Plan) -> dict:
    """``sensitivity`` of ``best``, re-searching with the searcher's models, workload and space."""
    models = {r: searcher.models.get(r) for r in searcher.workload.roles}

    def build(params: CostParams, cluster: ClusterSpec) -> MappingSearch:
        return MappingSearch(models, searcher.workload, cluster, params, searcher.space, searcher.abilities)

    return sensitivity(build, searcher.params, searcher.cluster, best)


def format_sensitivity(report: dict) -> str:
    """The ``--explain`` report as text."""
    head = (f"sensitivity: chosen placement {report['placement']}; "
            + ("no parameter in its plausible range changes it" if report["robust"] else "it changes with:"))
    rows = [[f["knob"], str(f["value"]), f["placement"], f["plan"], str(f["speedup_vs_colocate"])]
            for f in report["flips"]]
    if not rows:
        return head
    return head + "\n" + _table(["parameter", "value", "placement then", "plan then", "vs colocate"], rows)


def _workload_dict(w: Workload) -> dict:
    return {"algorithm": w.algorithm, "batch": w.batch, "n": w.n, "prompt_len": w.prompt_len,
            "response_len": w.response_len, "ppo_epochs": w.ppo_epochs, "ppo_updates": w.ppo_updates,
            "micro_batch": w.micro_batch, "forward_micro_batch": w.infer_micro_batch}


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    return "\n".join(lines)


def format_plan(plan: Plan) -> str:
    """Stage times, per-role phases and memory per set of one plan, as text tables."""
    stages = " | ".join(f"{s} {plan.stage_seconds[s]:.4g} s" for s in STAGES)
    out = [f"estimated iteration: {plan.seconds:.4g} s  ({stages})", ""]
    rows = []
    for i, est in enumerate(plan.sets):
        for ph in est.phases:
            extra = f"{ph.waves} wave(s) of {ph.batch}/replica" if ph.kind == "generate" else ""
            rows.append([str(i), ph.role, ph.kind, ph.stage, str(ph.layout.pp), str(ph.layout.tp), str(ph.layout.dp),
                         str(ph.layout.sp), f"{ph.seconds:.4g}", extra])
    out.append(_table(["set", "role", "phase", "stage", "pp", "tp", "dp", "sp", "seconds", ""], rows))
    out += [f"why {ph.note}" for est in plan.sets for ph in est.phases if ph.note]
    out.append("")
    rows = []
    for i, est in enumerate(plan.sets):
        states = " + ".join(f"{m.role} {m.persistent / GB:.3g}" for m in est.memory)
        rows.append([str(i), "+".join(est.roles), str(est.devices), states,
                     f"{max([m.transient for m in est.memory] + [est.gen_bytes]) / GB:.3g}",
                     f"{est.peak_bytes / GB:.3g}", f"{est.usable_bytes / GB:.3g}"])
    out.append(_table(["set", "models", "devices", "states GB/device", "transient", "peak", "usable"], rows))
    return "\n".join(out)


def format_result(result: SearchResult, searcher: MappingSearch) -> str:
    """The text report of ``hybridflow plan``."""
    wl, cluster = searcher.workload, searcher.cluster
    out = [f"hybridflow plan: {wl.algorithm} on {cluster} ({cluster.n_devices} devices); "
           f"{wl.batch} prompts x {wl.n}, {wl.prompt_len} + {wl.response_len} tokens; models: "
           + ", ".join(f"{r} {m.name}" for r, m in searcher.models.items()),
           "driver: " + ("one worker group at a time (stage = sum over sets)" if searcher.params.sequential_driver
                         else "sets overlap (stage = slowest set; --overlap-sets)"),
           f"searched {result.placements} placements, {result.allocations} allocations "
           f"({result.set_evaluations} set evaluations) in {result.seconds:.2f} s"]
    out += [f"left out ({e['count']} {e['what']}s): {e['reason']}" for e in result.excluded] + [""]
    if result.best is None:
        return "\n".join(out + ["no feasible plan"])
    out += [f"best plan: {result.best.describe()}", format_plan(result.best), ""]
    rows = [[name, "-" if p is None else f"{p.seconds:.4g}", "infeasible" if p is None else p.describe()]
            for name, p in result.baselines.items()]
    out += ["baselines (best allocation and layouts of each placement):", _table(["placement", "seconds", "plan"],
                                                                                  rows), ""]
    rows = [[str(i + 1), f"{p.seconds:.4g}", p.describe()] for i, p in enumerate(result.top)]
    out += [f"top {len(result.top)}:", _table(["#", "seconds", "plan"], rows)]
    return "\n".join(out)
