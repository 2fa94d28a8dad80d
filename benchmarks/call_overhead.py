"""What one worker-group call costs on this machine, against bare Ray actor calls in the same run.

``worker_group``: ``group.first_column(batch)`` through hybridflow's dispatch (split the ``DataProto`` over 2 ranks,
call each rank's Ray actor, wait, concatenate the outputs). ``bare_ray``: the same two chunks passed straight to the
same actors' Ray method and ``ray.get`` (the chunks are made before timing: no dispatch, no collect). The ratio is
hybridflow's own share of a call on top of Ray. Rounds alternate the order. Prints ONE JSON line with the median
and minimum milliseconds per call of each, the ratio and the load average.

The batch is a PPO update's shape at the quickstart: ``--rows`` x ``--cols`` (32 x 96) for six int64/fp32 tensors.

    python benchmarks/call_overhead.py [--calls 20] [--rounds 5] [--rows 32] [--cols 96]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable

import ray
import torch

from hybridflow.controller import Dispatch, RayClassWithInitArgs, RayWorkerGroup, ResourcePool, Worker, register
from hybridflow.protocol import DataProto

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the worker class below, shipped by value
KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "advantages")


class EchoWorker(Worker):
    @register(Dispatch.DP_COMPUTE_PROTO)
    def first_column(self, data: DataProto) -> DataProto:
        """A (rows, 1) result (the work itself is negligible)."""
        return DataProto.from_dict({"y": data.batch["input_ids"][:, :1].float()})


def _batch(rows: int, cols: int) -> DataProto:
    g = torch.Generator().manual_seed(0)
    tensors = {k: torch.randint(0, 500, (rows, cols), generator=g) for k in KEYS[:-1]}
    tensors["advantages"] = torch.randn(rows, cols, generator=g)
    return DataProto.from_dict(tensors)


def _time(call: Callable[[], object], calls: int) -> list[float]:
    for _ in range(3):  # warm-up
        call()
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20, help="timed calls per variant and round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; each times both variants, in turn")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--cols", type=int, default=96)
    args = parser.parse_args()
    load_before = os.getloadavg()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    group = RayWorkerGroup(ResourcePool([2], use_gpu=False), RayClassWithInitArgs(EchoWorker))
    data = _batch(args.rows, args.cols)
    chunks = data.chunk(2)
    variants = {
        "worker_group": lambda: group.first_column(data),
        "bare_ray": lambda: ray.get([w.first_column.remote(c) for w, c in zip(group.workers, chunks)]),
    }
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(args.rounds):  # alternate which goes first, so drift in the machine hits both alike
        for name in (list(variants) if round_ % 2 == 0 else list(variants)[::-1]):
            seconds[name] += _time(variants[name], args.calls)
    ray.shutdown()
    result = {name: {"median_ms": round(statistics.median(s) * 1e3, 2), "min_ms": round(min(s) * 1e3, 2)}
              for name, s in seconds.items()}
    print(json.dumps({
        "benchmark": "call_overhead", "rows": args.rows, "cols": args.cols, "tensors": len(KEYS), "ranks": 2,
        "calls_per_variant": args.calls * args.rounds, **result,
        "ratio_worker_group_over_bare_ray_median": round(result["worker_group"]["median_ms"]
                                                         / result["bare_ray"]["median_ms"], 3),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()], "cpu_count": os.cpu_count()}))


if __name__ == "__main__":
    main()
