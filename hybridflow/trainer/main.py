"""Entry point of ``hybridflow train``: start (or join) Ray, build data and worker groups, run the PPO driver."""

from __future__ import annotations

import logging
import os

from hybridflow.trainer.setup import build_data, build_worker_groups, init_ray, total_training_steps
from hybridflow.trainer.ppo import PPOTrainer
from hybridflow.utils.tracking import Tracking

logger = logging.getLogger(__name__)


def run_ppo(config) -> dict:
    """Train with the PPO family per ``config`` (a validated config from :func:`hybridflow.config.load_config`).
    Returns the last validation metrics. Shuts down a Ray cluster it started itself."""
    import ray

    train_batches, val_data, steps_per_epoch = build_data(config)  # bad data fails before Ray starts
    total = total_training_steps(config, steps_per_epoch)
    started_ray = init_ray(config)
    try:
        groups = build_worker_groups(config, total)
        tracker = Tracking(
            project_name=config.trainer.project_name,
            experiment_name=config.trainer.experiment_name,
            default_local_dir=config.trainer.default_local_dir,
            backends=list(config.trainer.logger),
            config=config,
        )
        trainer = PPOTrainer(config, groups["actor"], groups.get("critic"), groups["reward"], tracker)
        result = trainer.fit(train_batches, val_data, total)
        tracker.finish()
        logger.info("metrics written to %s", os.path.join(config.trainer.default_local_dir, "metrics.jsonl"))
        return result
    finally:
        if started_ray:
            ray.shutdown()
