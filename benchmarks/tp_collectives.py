"""The generation tp group's per-layer collectives on CPU: gloo against the shared-memory path, in one run.

Two gloo ranks (one torch thread each) all-reduce a (rows, hidden) fp32 tensor -- a decode step's attention or MLP
output under ``rollout.tensor_model_parallel_size=2`` -- ``--calls`` times through ``dist.all_reduce`` and through
:class:`hybridflow.distributed.shm_comm.ShmGroup`, rounds alternating the order, and all-gather the
(rows, vocab / 2) logit slices the same two ways. Prints ONE JSON line: median microseconds per call of each,
gloo / shared-memory ratios, whether both ranks held the same bits, and the load average.

    python benchmarks/tp_collectives.py [--rows 32] [--hidden 512] [--vocab 512] [--calls 1000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from _gloo import run_gloo_ranks  # benchmarks/_gloo.py (this script's folder is on sys.path)
from hybridflow.distributed.shm_comm import ShmGroup


def _timed(fn, calls: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def _rank(rank: int, args: argparse.Namespace, out: str) -> None:
    shm = ShmGroup.create(None)
    if shm is None:
        raise SystemExit("shared-memory collectives are not available here (Linux x86-64 with /dev/shm only)")
    act = torch.randn(args.rows, args.hidden, generator=torch.Generator().manual_seed(rank))
    logits = torch.randn(args.rows, args.vocab // 2)
    parts = [torch.empty_like(logits) for _ in range(2)]

    def gather_gloo() -> torch.Tensor:
        dist.all_gather(parts, logits)
        return torch.cat(parts, -1)

    ways = {"all_reduce_gloo": lambda: dist.all_reduce(act.clone()),
            "all_reduce_shm": lambda: shm.all_reduce_(act.clone()),
            "all_gather_gloo": gather_gloo,
            "all_gather_shm": lambda: torch.cat(shm.all_gather(logits), -1)}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for round_ in range(args.rounds):
        for name in (list(ways) if round_ % 2 == 0 else list(reversed(ways))):
            _timed(ways[name], 20)  # warm-up
            times[name].append(_timed(ways[name], args.calls))
    summed = shm.all_reduce_(act.clone())
    both = [torch.empty_like(summed) for _ in range(2)]
    dist.all_gather(both, summed)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"us": {k: statistics.median(v) for k, v in times.items()},
                       "same_bits": torch.equal(both[0], both[1])}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    load_before = os.getloadavg()
    result = run_gloo_ranks(_rank, 2, args)
    us = {k: round(v, 1) for k, v in result["us"].items()}
    print(json.dumps({
        "benchmark": "tp_collectives", "rows": args.rows, "hidden": args.hidden, "vocab": args.vocab,
        "ranks": 2, "torch_threads_per_rank": 1, "median_us_per_call": us,
        "ratio_gloo_over_shm": {op: round(us[f"{op}_gloo"] / us[f"{op}_shm"], 2)
                                for op in ("all_reduce", "all_gather")},
        "ranks_same_bits": result["same_bits"], "load_average_before": load_before,
        "load_average_after": os.getloadavg(), "cpu_count": os.cpu_count()}))


if __name__ == "__main__":
    main()
