"""Synchronous versus async RL (LlamaRL) on the same recipe, the same placement and the same number of samples.

Both modes run ``recipes/async_grpo_quickstart.yaml`` (the generator on one rank, the trainer on another: on a
2-core machine, one core each) for the same steps:

- ``sync``: ``async_training.max_staleness=0``: the generator waits for each update's weights before it samples
  the next batch, and the trainer waits for the samples (LlamaRL's synchronous baseline on the same devices);
- ``async``: ``max_staleness=1``: the generator samples the next batch while the trainer trains on this one.

Also reported, as a reference that is not part of the ratio: ``sync_colocated``, the synchronous PPO driver with
generation and training on the same 2 ranks (``algorithm.driver=ppo``, both cores take turns on every phase).

Worker processes are pinned to cores (``--no-pin`` to leave them to the OS): the generator rank on the last core,
the trainer's actor rank on core 0 (in ``sync_colocated``, actor rank r on core r); the driver, the reward worker
and Ray's own processes float.

Seconds per sample = the sum of the steps' wall time (``timing_s/iteration``, steps after the first; the first
includes warm-up) / the samples those steps trained on. Each mode is one ``hybridflow train`` subprocess with its
own Ray cluster; the modes run in turn, ``--rounds`` times (alternating order), and the median per mode is kept.
The machine's load average is recorded, as other work on the machine distorts every number.

Prints ONE JSON object: per mode seconds per sample (median and all rounds), and
``ratio_sync_over_async`` (> 1: async is faster).

    python benchmarks/async_vs_sync.py [--steps 12] [--rounds 2] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import psutil

from hybridflow.config import load_config

MODES = {
    "sync": ["async_training.max_staleness=0"],
    "async": ["async_training.max_staleness=1"],
    "sync_colocated": ["algorithm.driver=ppo", "resource_pool.pools=null", "resource_pool.mapping={}",
                       "trainer.n_gpus_per_node=2"],
}


def _pin_workers(proc: subprocess.Popen, cores: int) -> None:
    """Pin the run's worker processes to cores as they start: the generator rank(s) from the last core down,
    the trainer's actor ranks from core 0 up (the colocated mode: actor rank r on core r). Ray starts them a
    few seconds after launch; processes that appear later (none here) would stay unpinned."""
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if _ray_pids("ActorRolloutRefWorker"):
            time.sleep(2)  # let every rank of both groups start
            for i, pid in enumerate(_ray_pids("ActorRolloutRefWorker")):
                psutil.Process(pid).cpu_affinity([i % cores])
            for i, pid in enumerate(_ray_pids("GeneratorWorker")):
                psutil.Process(pid).cpu_affinity([cores - 1 - i % cores])
            return
        time.sleep(0.2)


def _ray_pids(cls: str) -> list[int]:
    return sorted(p.pid for p in psutil.process_iter(["cmdline"])
                  if " ".join(p.info["cmdline"] or []).startswith(f"ray::{cls}"))


def run(mode: str, steps: int, overrides: list[str], pin: bool) -> float:
    """Seconds per trained sample of one run of ``mode``."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "hybridflow", "train", "async_grpo_quickstart",
               f"trainer.total_training_steps={steps}", "trainer.test_freq=-1", "trainer.val_before_train=false",
               "trainer.logger=[jsonl]", f"trainer.default_local_dir={out}", *MODES[mode], *overrides]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if pin:
            _pin_workers(proc, os.cpu_count() or 1)
        if proc.wait() != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f][1:]
    cfg = load_config("async_grpo_quickstart", overrides)
    per_step = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n  # no batch is dropped at these k
    return sum(r["timing_s/iteration"] for r in rows) / (per_step * len(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-pin", action="store_true", help="leave worker processes to the OS scheduler")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    per_mode: dict[str, list[float]] = {m: [] for m in MODES}
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for mode in (list(MODES) if r % 2 == 0 else list(reversed(MODES))):
            per_mode[mode].append(run(mode, args.steps, args.overrides, not args.no_pin))
            loads.append(os.getloadavg()[0])
    median = {m: statistics.median(v) for m, v in per_mode.items()}
    print(json.dumps({
        "recipe": "async_grpo_quickstart", "steps": args.steps, "rounds": args.rounds, "overrides": args.overrides,
        "pinned": not args.no_pin,
        "seconds_per_sample": median, "seconds_per_sample_rounds": per_mode,
        "ratio_sync_over_async": median["sync"] / median["async"],
        "ratio_sync_colocated_over_async": median["sync_colocated"] / median["async"],
        "load_average_1min": loads,
    }))


if __name__ == "__main__":
    from hybridflow.cli import run_script

    sys.exit(run_script(main))  # a config typo or a bad path: one line, not a traceback
