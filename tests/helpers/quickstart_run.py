"""One 2-step ``hybridflow train quickstart`` run that several end-to-end tests read, instead of one run each
(tests/trainer/test_ppo_e2e.py: metrics, checkpoint, export; tests/trainer/test_run_output.py: the piped output;
tests/utils/test_trackers.py: every tracker reads back metrics.jsonl). It is what a user runs: a fresh
interpreter with its own Ray cluster (2 ranks for the actor and the critic), stdout and stderr piped to a file.

The run is the union of what those tests asked of their own runs: 8 prompts per step, validation on 8 prompts
before training and at step 2 (greedy, plus a sampled pass with n=2 at temperature 1), a checkpoint at step 2,
every tracker backend whose package is installed (wandb and swanlab offline, MLflow in a file store in the
run's folder), and Ulysses sequence parallelism (sp=2: the actor, reference and critic split each sequence over
the 2 ranks).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRACKERS = ("tensorboard", "wandb", "mlflow", "swanlab")
ARGS = ["trainer.total_training_steps=2", "trainer.test_freq=2", "trainer.save_freq=2",
        "data.train_batch_size=8", "data.builtin_val_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "critic.ppo_mini_batch_size=4", "critic.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true", "actor_rollout_ref.rollout.val_kwargs.n=2",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        # Ulysses sequence parallelism end to end: actor, reference and critic split each sequence over both ranks
        # (one dp group of 2 sp ranks); the rollout reshards from that layout
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2", "critic.ulysses_sequence_parallel_size=2"]


@dataclass(frozen=True)
class QuickstartRun:
    """The finished run: its ``trainer.default_local_dir``, the command's exit code and combined output, the
    tracker backends it logged to and the MLflow tracking URI (a file store)."""

    run_dir: Path
    returncode: int
    output: str
    trackers: tuple[str, ...]
    mlflow_uri: str


def tracker_env(root: Path) -> dict[str, str]:
    """The environment that keeps the trackers local: wandb and swanlab offline, MLflow in ``root/mlruns``."""
    return {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "SWANLAB_MODE": "offline",
            "MLFLOW_TRACKING_URI": (root / "mlruns").as_uri(), "MLFLOW_ALLOW_FILE_STORE": "true"}


def run_quickstart(root: Path) -> QuickstartRun:
    """Run ``python -m hybridflow train quickstart`` (:data:`ARGS`) into ``root/run``, output to
    ``root/output.txt``; a failed run is returned, not raised (each test shows its output)."""
    trackers = tuple(t for t in TRACKERS if importlib.util.find_spec(t) is not None)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(tracker_env(root))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    run_dir, log = root / "run", root / "output.txt"
    cmd = [sys.executable, "-m", "hybridflow", "train", "quickstart", *ARGS, f"trainer.default_local_dir={run_dir}",
           f"trainer.logger=[{','.join(('console', 'jsonl') + trackers)}]"]
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=900)
    return QuickstartRun(run_dir, proc.returncode, log.read_text(), trackers, tracker_env(root)["MLFLOW_TRACKING_URI"])
