"""The auto-mapper at the HybridFlow paper's scale: Llama 7B/13B/34B/70B PPO on 16..128 A100-80G.

For each (model size, GPUs): the chosen plan's estimated iteration time against the best plan of each baseline
placement (colocate-all, standalone, split = actor+reference | critic+reward), the search's wall time, and
whether the paper's trends (§8.4: colocation best on small clusters; split or standalone for mid-size models on
large clusters) reappear. Nothing is asserted: the trends are reported as found.

Workload (the paper's §8.1): 1024 prompts, 1024 prompt + 1024 response tokens, one PPO epoch, one update.
Prints ONE JSON object.

    python benchmarks/automap_paper_scale.py [--sizes 7B 13B 34B 70B] [--gpus 16 32 64 128]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from hybridflow.mapping.cost import CostParams
from hybridflow.mapping.search import search
from hybridflow.mapping.specs import ClusterSpec, Workload, get_device, get_model

BASELINES = ("colocate", "standalone", "split")


def run_case(size: str, gpus: int, workload: Workload, params: CostParams) -> dict:
    model = get_model(size)
    cluster = ClusterSpec(gpus // 8, 8, get_device("A100-80G"))
    start = time.perf_counter()
    result = search({r: model for r in ("actor", "critic", "reference", "reward")}, workload, cluster, params,
                    top_k=3)
    elapsed = time.perf_counter() - start
    best = result.best
    row = {"model": size, "gpus": gpus, "search_seconds": round(elapsed, 3),
           "allocations": result.allocations, "chosen": None, "baselines": {}}
    if best is None:
        return row
    row["chosen"] = {"plan": best.describe(), "seconds": round(best.seconds, 2),
                     "stages": {k: round(v, 2) for k, v in best.stage_seconds.items()},
                     "placement_kind": _kind(best.placement, result)}
    for name in BASELINES:
        plan = result.baselines.get(name)
        row["baselines"][name] = None if plan is None else {
            "plan": plan.describe(), "seconds": round(plan.seconds, 2),
            "speedup_of_chosen": round(plan.seconds / best.seconds, 3)}
    row["chosen_le_baselines"] = all(p is None or best.seconds <= p.seconds + 1e-9 for p in result.baselines.values())
    return row


def _kind(placement, result) -> str:
    for name in BASELINES:
        plan = result.baselines.get(name)
        if plan is not None and plan.placement == placement:
            return name
    return "other"


def trends(rows: list[dict]) -> dict:
    """The paper's qualitative claims, checked on the rows (true / false / 'n/a' when no row applies)."""
    small = [r for r in rows if r["gpus"] <= 32 and r["chosen"]]
    large_mid = [r for r in rows if r["gpus"] >= 64 and r["model"] in ("13B", "34B") and r["chosen"]]
    large = [r for r in rows if r["gpus"] >= 64 and r["chosen"]]
    return {
        "colocate_best_on_small_clusters": (all(r["chosen"]["placement_kind"] == "colocate" for r in small)
                                            if small else "n/a"),
        "split_or_standalone_for_mid_models_on_large_clusters": (
            any(r["chosen"]["placement_kind"] in ("split", "standalone") for r in large_mid) if large_mid else "n/a"),
        "any_multi_set_placement_on_large_clusters": [f"{r['model']}@{r['gpus']}" for r in large
                                                      if r["chosen"]["placement_kind"] != "colocate"],
        "chosen_placements": {f"{r['model']}@{r['gpus']}": r["chosen"]["plan"] for r in rows if r["chosen"]},
        "infeasible": [f"{r['model']}@{r['gpus']}" for r in rows if not r["chosen"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["7B", "13B", "34B", "70B"])
    parser.add_argument("--gpus", nargs="+", type=int, default=[16, 32, 64, 128])
    parser.add_argument("--ppo-updates", type=int, default=1, help="optimizer steps per epoch")
    parser.add_argument("--call-overhead", type=float, default=0.0, metavar="SECONDS",
                        help="fixed seconds per model call (sensitivity: scaling that is not linear)")
    args = parser.parse_args()
    workload = Workload(ppo_updates=args.ppo_updates)
    params = CostParams(call_overhead_s=args.call_overhead)
    rows = [run_case(size, gpus, workload, params) for size in args.sizes for gpus in args.gpus]
    print(json.dumps({"device": "A100-80G", "workload": dataclasses.asdict(workload),
                      "cost_params": dataclasses.asdict(params), "cases": rows,
                      "max_search_seconds": max(r["search_seconds"] for r in rows), "trends": trends(rows)},
                     indent=1))


if __name__ == "__main__":
    main()
