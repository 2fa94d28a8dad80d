"""Entry point of ``hybridflow train``: start (or join) Ray, build data and worker groups, run the PPO driver."""

from __future__ import annotations

import logging
import os

from hybridflow.trainer.setup import build_data, init_ray, total_training_steps, worker_groups
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
        with worker_groups(config, total) as groups:
            return _train(config, groups, train_batches, val_data, total)
    finally:
        if started_ray:
            ray.shutdown()


def _train(config, groups, train_batches, val_data, total) -> dict:
    tracker = Tracking(
        project_name=config.trainer.project_name,
        experiment_name=config.trainer.experiment_name,
        default_local_dir=config.trainer.default_local_dir,
        backends=list(config.trainer.logger),
        config=config,
    )
    try:
        trainer = PPOTrainer(config, groups["actor"], groups.get("critic"), groups["reward"], tracker)
        result = trainer.fit(train_batches, val_data, total)
    finally:
        tracker.finish()
    logger.info("metrics in %s", os.path.join(config.trainer.default_local_dir, "metrics.jsonl"))
    return result
