"""Entry point of ``hybridflow train``: start (or join) Ray, build data and worker groups, run the driver named by
``algorithm.driver`` (the driver registry, :mod:`hybridflow.trainer.driver`: ppo, remax, safe_rlhf, async and any
a plugin registers) in the :class:`~hybridflow.trainer.loop.TrainLoop`."""

from __future__ import annotations

import logging
import os

from typing import Any, Callable, Iterator, Optional

from hybridflow.controller.futures import CallTimeoutError
from hybridflow.errors import TrainingInterrupted, TrainingTimedOut, UserCodeError, UserError
from hybridflow.protocol import DataProto
from hybridflow.trainer.checkpoint import CheckpointManager, check_resume_config, load_trainer_state
from hybridflow.trainer.driver import get_driver
from hybridflow.trainer.loop import TrainLoop
from hybridflow.trainer.run_lock import run_dir_lock
from hybridflow.trainer.setup import build_data, init_ray, total_training_steps, worker_groups
from hybridflow.utils import startup
from hybridflow.utils.provenance import make_run_info
from hybridflow.utils.tracking import RunProgress, Tracking, set_metrics_aside, trim_metrics

logger = logging.getLogger(__name__)


def run_ppo(config: Any) -> dict:
    """Train per ``config`` (a validated config from :func:`hybridflow.config.load_config`) with the driver
    ``algorithm.driver`` (the PPO family by default). Returns the last validation metrics. Shuts down a Ray
    cluster it started itself. Holds the run directory's lock (:mod:`hybridflow.trainer.run_lock`) throughout.

    Raises:
        DataError: bad data (see :func:`~hybridflow.trainer.setup.build_data`), before Ray starts.
        RunDirInUseError: another live run holds ``trainer.default_local_dir`` (a ``UserError`` naming its pid,
            host, start time and lock file), before Ray starts. The lock is released on every exit.
        TrainingInterrupted: Ctrl-C (SIGINT, ``KeyboardInterrupt``); raised after the worker groups are removed
            and Ray is shut down, naming the last complete step and the latest complete checkpoint. Everything
            already written stays: checkpoints are renamed into place only when complete, and every step's
            metrics row is flushed when logged.
        TrainingTimedOut: (a ``TrainingInterrupted``) a worker-group call, ``init_model`` included, did not finish
            within ``trainer.call_timeout_s``; the same cleanup, and its ``reason`` names the group, the method
            and the ranks that did not answer.
    """
    startup.begin_if_idle()
    train_batches, val_data, steps_per_epoch = build_data(config)  # bad data fails before Ray starts
    _check_start(config)
    with run_dir_lock(config.trainer.default_local_dir):  # a second live run into this directory is refused
        return _run_locked(config, train_batches, val_data, total_training_steps(config, steps_per_epoch))


def _run_locked(config: Any, train_batches: Callable[[int], Iterator[DataProto]], val_data: DataProto,
                total: int) -> dict:
    """:func:`run_ppo` once the run directory's lock is held: resume check, Ray, worker groups, training."""
    import ray

    checkpoints = CheckpointManager(config.trainer.default_local_dir)
    start = _prepare_run_dir(config, checkpoints, total)
    if start is None:
        return {}
    startup.mark("data")
    logger.info("starting Ray (or joining RAY_ADDRESS / trainer.ray_init.address)")
    started_ray = False
    try:
        started_ray = init_ray(config)
        startup.mark("Ray")
        with worker_groups(config, total) as groups:
            return _train(config, groups, train_batches, val_data, total, start)
    except KeyboardInterrupt:  # before training started (Ray, workers); _train reports the steps it ran
        raise TrainingInterrupted(start, total, checkpoints.latest()) from None
    except CallTimeoutError as exc:  # a group's init_model did not finish in time
        raise timed_out(exc, start, total, checkpoints.latest()) from exc
    finally:
        if started_ray:
            ray.shutdown()


def _check_start(config: Any) -> None:
    """What can be checked before Ray starts besides the data: the run directory can be made (and is logged), and
    ``trainer.device=cuda`` has a GPU when the driver starts the cluster itself.

    Raises:
        UserError: the run directory is a file or cannot be created; ``cuda`` on a local machine without GPUs.
    """
    run_dir = config.trainer.default_local_dir
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as exc:
        raise UserError(f"trainer.default_local_dir={run_dir}: cannot create the run directory "
                        f"({exc.strerror or exc})") from None
    _log_run_dir(run_dir)
    joining = os.environ.get("RAY_ADDRESS") or config.trainer.ray_init.address
    if config.trainer.device == "cuda" and not joining:
        import torch

        if torch.cuda.device_count() == 0:
            raise UserError("trainer.device=cuda, but this machine has no GPU (use trainer.device=auto or cpu)")


def _log_run_dir(run_dir: str) -> None:
    """Say where the outputs go (the absolute path resolved at load), and warn when that is inside the temporary
    copy of the working directory that ``ray job submit --working-dir`` gives the driver (deleted with the job)."""
    logger.info("run directory (metrics, config, checkpoints): %s", run_dir)
    if f"{os.sep}runtime_resources{os.sep}" in run_dir and "working_dir_files" in run_dir:
        logger.warning("the run directory is inside Ray's temporary copy of the job's working directory and will "
                       "be lost: set trainer.default_local_dir to an absolute path on storage that outlives the "
                       "job (a shared filesystem on a multi-node cluster)")


def _prepare_run_dir(config: Any, checkpoints: CheckpointManager, total: int) -> Optional[int]:
    """Before Ray starts: find the checkpoint to resume (``trainer.resume_mode``) and check that this config can
    resume it. Returns the step the run starts from (0 for a fresh run), or None when the checkpoint is already at
    ``total`` steps (nothing to do; the directory is left as it is). ``metrics.jsonl`` is left as it is until the
    worker groups are up (:func:`_tidy_metrics`), so a run that fails to start changes nothing.

    Raises:
        IncompatibleCheckpointError: the checkpoint was written with an incompatible config (names the keys).
        FileNotFoundError: ``resume_mode`` names a path that is not a complete checkpoint.
    """
    resume_from = checkpoints.resolve(config.trainer.resume_mode)
    if resume_from is None:
        return 0
    check_resume_config(config, resume_from)
    step = load_trainer_state(resume_from)["global_step"]
    if step >= total:
        logger.info("nothing to do: %s is at step %d of %d (resume_mode=%s)", resume_from, step, total,
                    config.trainer.resume_mode)
        return None
    return step


def _tidy_metrics(run_dir: str, start: int) -> None:
    """Leave ``metrics.jsonl`` with one row per step: on resume (``start`` > 0) the rows after step ``start`` are
    dropped; a fresh run moves a previous run's file aside (``metrics.<time>.jsonl``)."""
    if start:
        trim_metrics(run_dir, start)
    else:
        set_metrics_aside(run_dir)


def _train(config: Any, groups: dict[str, Any], train_batches: Callable[[int], Iterator[DataProto]],
           val_data: DataProto, total: int, start: int) -> dict:
    """Build the driver from the worker groups and run it in a :class:`TrainLoop` (metrics to a tracker with a
    progress line); returns the last validation metrics.

    Raises:
        TrainingInterrupted: Ctrl-C during training (names the last logged step and the latest checkpoint).
        TrainingTimedOut: a worker-group call ran past ``trainer.call_timeout_s`` (:func:`timed_out`).
        UserCodeError: an exception raised in the user's own code on the driver (a driver plugin), as one line
            and the user's frames (:meth:`~hybridflow.errors.UserCodeError.wrap`); hybridflow's own errors and
            the workers' (``WorkerError``) are raised as they are.
    """
    _tidy_metrics(config.trainer.default_local_dir, start)  # the workers are up: the run starts now
    info = make_run_info()  # version, commit, start: in config.yaml and every checkpoint's
    tracker = RunProgress(Tracking(
        project_name=config.trainer.project_name,
        experiment_name=config.trainer.experiment_name,
        default_local_dir=config.trainer.default_local_dir,
        backends=list(config.trainer.logger),
        config=config,
        run_info=info,
    ), total, start)
    try:
        driver = get_driver(config.algorithm.driver).build(config, groups)
        startup.mark("driver")
        logger.info("%s", startup.summary())
        result = TrainLoop(config, driver, tracker, run_info=info).fit(train_batches, val_data, total)
    except KeyboardInterrupt:
        latest = CheckpointManager(config.trainer.default_local_dir).latest()
        raise TrainingInterrupted(tracker.last_step, total, latest) from None
    except CallTimeoutError as exc:  # a worker-group call did not finish within trainer.call_timeout_s
        latest = CheckpointManager(config.trainer.default_local_dir).latest()
        raise timed_out(exc, tracker.last_step, total, latest) from exc
    except UserError:
        raise
    except Exception as exc:  # raised in the user's own code on the driver (a driver plugin, a hook it calls)?
        wrapped = UserCodeError.wrap(exc, f"driver {config.algorithm.driver!r}")
        if wrapped is None:  # hybridflow's own error (a worker's failure included): a bug, with its traceback
            raise
        raise wrapped from exc
    finally:
        tracker.finish()
    logger.info("metrics in %s", os.path.join(config.trainer.default_local_dir, "metrics.jsonl"))
    if config.trainer.plot_curves:
        from hybridflow.utils.plot import write_run_curves  # matplotlib loads only here, at the end

        write_run_curves(config.trainer.default_local_dir)
    logger.info("%s", checkpoint_summary(config.trainer.save_freq, tracker.last_step,
                                         CheckpointManager(config.trainer.default_local_dir).latest()))
    return result


def timed_out(exc: CallTimeoutError, step: int, total: int, latest: Optional[str]) -> TrainingTimedOut:
    """The run's error for a worker-group call that did not finish in time: ``exc``'s line (group, method, ranks
    that did not answer, the limit) naming the key that sets the limit, the last complete step and the latest
    complete checkpoint."""
    return TrainingTimedOut(f"{exc} (trainer.call_timeout_s)", step, total, latest)


def checkpoint_summary(save_freq: int, last_step: int, latest: Optional[str]) -> str:
    """The run's last log line: where its weights are. A run with ``save_freq`` > 0 checkpoints its last step
    (``latest``); with ``save_freq`` <= 0 it saved none, so the trained weights of ``last_step`` are gone with the
    workers (``latest``: an earlier run's checkpoint in the same directory, or None)."""
    if save_freq > 0:
        return f"latest checkpoint: {latest} (hybridflow export {latest} OUT_DIR writes a Hugging Face model)"
    earlier = f"; the run directory's latest checkpoint is the earlier {latest}" if latest else ""
    return (f"no checkpoint saved (trainer.save_freq={save_freq}): the trained weights of step {last_step} were not "
            f"kept{earlier}; set trainer.save_freq=N to checkpoint every N steps and the last")
