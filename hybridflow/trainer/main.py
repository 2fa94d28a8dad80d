"""Entry point of ``hybridflow train``: start (or join) Ray, build data and worker groups, run the driver named by
``algorithm.driver`` (``DRIVERS``: ppo, remax, safe_rlhf, async)."""

from __future__ import annotations

import logging
import os

from hybridflow.trainer.async_rl import AsyncTrainer
from hybridflow.trainer.checkpoint import CheckpointManager, check_resume_config, load_trainer_state
from hybridflow.trainer.ppo import PPOTrainer
from hybridflow.trainer.remax import ReMaxTrainer
from hybridflow.trainer.safe_rlhf import SafeRLHFTrainer
from hybridflow.trainer.scoring import build_cost, build_reward
from hybridflow.trainer.setup import build_data, init_ray, total_training_steps, worker_groups
from hybridflow.utils.tracking import Tracking, set_metrics_aside, trim_metrics

logger = logging.getLogger(__name__)

# algorithm.driver -> builder(config, groups, tracker) of an object with fit(train_batches, val_data, total_steps)
DRIVERS = {
    "ppo": lambda cfg, g, tracker: PPOTrainer(cfg, g["actor"], g.get("critic"), build_reward(g, cfg), tracker),
    "remax": lambda cfg, g, tracker: ReMaxTrainer(cfg, g["actor"], build_reward(g, cfg), tracker),
    "safe_rlhf": lambda cfg, g, tracker: SafeRLHFTrainer(cfg, g["actor"], g["critic"], g["cost_critic"],
                                                         build_reward(g, cfg), build_cost(g, cfg), tracker),
    "async": lambda cfg, g, tracker: AsyncTrainer(cfg, g["actor"], g.get("critic"), build_reward(g, cfg),
                                                  g["generator"], tracker),
}


def run_ppo(config) -> dict:
    """Train per ``config`` (a validated config from :func:`hybridflow.config.load_config`) with the driver
    ``algorithm.driver`` (the PPO family by default). Returns the last validation metrics. Shuts down a Ray
    cluster it started itself."""
    import ray

    train_batches, val_data, steps_per_epoch = build_data(config)  # bad data fails before Ray starts
    total = total_training_steps(config, steps_per_epoch)
    if not _prepare_run_dir(config, total):
        return {}
    started_ray = init_ray(config)
    try:
        with worker_groups(config, total) as groups:
            return _train(config, groups, train_batches, val_data, total)
    finally:
        if started_ray:
            ray.shutdown()


def _prepare_run_dir(config, total: int) -> bool:
    """Before Ray starts: find the checkpoint to resume (``trainer.resume_mode``), check that this config can resume
    it, and leave ``metrics.jsonl`` with one row per step: rows after the checkpoint's step are dropped on resume; a
    fresh run moves a previous run's file aside (``metrics.<time>.jsonl``). Returns False when the checkpoint is
    already at ``total`` steps (nothing to do; the directory is left as it is).

    Raises:
        IncompatibleCheckpointError: the checkpoint was written with an incompatible config (names the keys).
        FileNotFoundError: ``resume_mode`` names a path that is not a complete checkpoint.
    """
    run_dir = config.trainer.default_local_dir
    resume_from = CheckpointManager(run_dir).resolve(config.trainer.resume_mode)
    if resume_from is None:
        set_metrics_aside(run_dir)
        return True
    check_resume_config(config, resume_from)
    step = load_trainer_state(resume_from)["global_step"]
    if step >= total:
        logger.info("nothing to do: %s is at step %d of %d (resume_mode=%s)", resume_from, step, total,
                    config.trainer.resume_mode)
        return False
    trim_metrics(run_dir, step)
    return True


def _train(config, groups, train_batches, val_data, total) -> dict:
    tracker = Tracking(
        project_name=config.trainer.project_name,
        experiment_name=config.trainer.experiment_name,
        default_local_dir=config.trainer.default_local_dir,
        backends=list(config.trainer.logger),
        config=config,
    )
    try:
        trainer = DRIVERS[config.algorithm.driver](config, groups, tracker)
        result = trainer.fit(train_batches, val_data, total)
    finally:
        tracker.finish()
    logger.info("metrics in %s", os.path.join(config.trainer.default_local_dir, "metrics.jsonl"))
    return result
