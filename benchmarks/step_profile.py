"""Where a quickstart PPO step spends its time.

Runs a few quickstart steps through the real Ray worker groups and prints ONE JSON object: seconds per phase
(driver wall time: generate, reward, reference, old logprobs, values, advantages, critic update, actor update),
the same phases measured inside the workers, and the controller's own overhead (step time not spent inside a
worker method: dispatch, serialization, object store, driver math) as a fraction of the step. Steps after the
first are averaged (the first includes warm-up).

    python benchmarks/step_profile.py [--steps 4] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

from hybridflow.config import load_config
from hybridflow.trainer.main import run_ppo

PHASES = {"generate": "gen", "reward": "reward", "reference": "ref", "old_log_prob": "old_log_prob",
          "values": "values", "advantages": "adv", "critic_update": "update_critic", "actor_update": "update_actor"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config("quickstart", [f"trainer.total_training_steps={args.steps}", "trainer.test_freq=-1",
                                         "trainer.val_before_train=false", f"trainer.default_local_dir={out}",
                                         "trainer.logger=[jsonl]", *args.overrides])
        run_ppo(cfg)
        with open(f"{out}/metrics.jsonl") as f:
            rows = [json.loads(line) for line in f]
    steady = rows[1:] or rows

    def avg(key: str) -> float:
        return statistics.mean(r.get(key, 0.0) for r in steady)

    result = {
        "steps_measured": len(steady),
        "step_s": avg("timing_s/step"),
        "phase_s": {name: avg(f"timing_s/{key}") for name, key in PHASES.items()},
        "worker_s": {k.split("/", 1)[1]: avg(k) for k in steady[0] if k.startswith("timing_worker_s/")},
        "controller_overhead_frac": avg("timing_s/controller_overhead_frac"),
        "tokens_per_s": avg("perf/throughput"),
        "response_length_max": avg("response_length/max"),  # tokens: the longest response of a step's batch
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
