"""The train loop every driver runs in: resume, the data position, the validation and checkpoint cadence, logging.

:class:`TrainLoop` owns what is the same for every algorithm; the :class:`~hybridflow.trainer.driver.Driver` owns
what a step does. One run::

    resume the checkpoint trainer.resume_mode names (the driver's groups and state, the step, the data position)
    driver.start(cursor at the data position, step)
    validate before training (trainer.val_before_train, fresh runs only)
    until total_steps: step += 1; metrics = driver.step(driver.take_batch())
                       raise the error of a finished worker-group call whose output the step never read
                       validate every trainer.test_freq steps and at the end
                       checkpoint every trainer.save_freq steps and at the end (after every unread call ended well)
                       tracker.log(metrics, step)
    wait for the calls nobody read and raise the first failure

A driver need not read every call's output (e.g. an update's metrics): a call dropped unread that failed raises its
``WorkerError`` after the step (if it has finished by then; else at the next worker-group call, or at the latest
before the next checkpoint or the end of the run), see :func:`hybridflow.controller.unread.raise_unread_errors`.

The data position counts the prompt batches consumed (one per step; more when a step pulls extra ones, as DAPO's
dynamic sampling does; batches a driver holds in flight are not counted, see
:meth:`~hybridflow.trainer.driver.Driver.batches_in_flight`). It is checkpointed and the cursor restarts from it, so
a resumed run sees exactly the prompts of an uninterrupted one.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any, Callable, Iterable, Iterator, Optional

from hybridflow.controller.unread import raise_unread_errors
from hybridflow.protocol import DataProto
from hybridflow.trainer.checkpoint import CONFIG_FILE, CheckpointManager, load_trainer_state, save_config
from hybridflow.trainer.driver import Driver
from hybridflow.utils.provenance import make_run_info

logger = logging.getLogger(__name__)

TrainBatches = Callable[[int], Iterable[DataProto]]  # train_batches(position): the batches from ``position`` on


class DataCursor:
    """The train batches from a data position on; :meth:`next` hands out the next one and counts it.

    Args:
        train_batches: ``train_batches(position)`` yields the batches from data position ``position`` on.
        position: the batches consumed before (the checkpointed data position; 0 for a fresh run).
    """

    def __init__(self, train_batches: TrainBatches, position: int = 0) -> None:
        self.position = position
        self._batches: Iterator[DataProto] = iter(train_batches(position))

    def next(self) -> DataProto:
        """The next batch (advances :attr:`position`).

        Raises:
            StopIteration: ``train_batches`` ran out.
        """
        batch = next(self._batches)
        self.position += 1
        return batch


class TrainLoop:
    """Runs ``driver`` under the config's ``trainer`` cadence (see the module docstring).

    Args:
        config: the validated run config (reads ``trainer.*`` and ``algorithm.driver`` for messages).
        driver: the :class:`~hybridflow.trainer.driver.Driver` to run.
        tracker: ``log(metrics, step)`` sink (a :class:`~hybridflow.utils.tracking.Tracking`), or None.
        run_info: the ``run_info`` section each checkpoint's ``config.yaml`` carries
            (:func:`~hybridflow.utils.provenance.make_run_info`; default: made now).
    """

    def __init__(self, config: Any, driver: Driver, tracker: Any = None,
                 run_info: Optional[dict[str, Any]] = None) -> None:
        self.config, self.driver, self.tracker = config, driver, tracker
        self.run_info = make_run_info() if run_info is None else run_info
        self.global_step = 0
        self.data_position = 0  # batches consumed before this run's cursor started (set by resume)
        self.data: Optional[DataCursor] = None
        self.checkpoints = CheckpointManager(config.trainer.default_local_dir, config.trainer.max_ckpt_to_keep)

    def consumed(self) -> int:
        """Prompt batches consumed so far (the data position a checkpoint records)."""
        if self.data is None:
            return self.data_position
        return self.data.position - self.driver.batches_in_flight()

    def save_checkpoint(self) -> str:
        """Checkpoint the driver's groups (sharded, per rank), the resolved config and the loop and driver state,
        atomically; returns the checkpoint directory. First waits for every call of those groups whose output nobody
        read: a checkpoint is never written after a failed update.

        Raises:
            WorkerError: an unread call failed (names its group, rank and method); nothing is written.
            CallTimeoutError: an unread call did not end within its group's ``call_timeout_s``.
        """
        groups = self.driver.checkpointed_groups()
        raise_unread_errors(wait=True, groups=[getattr(group, "name", role) for role, group in groups.items()])
        writers = {name: group.save_checkpoint for name, group in groups.items()}
        writers[CONFIG_FILE] = functools.partial(save_config, self.config, run_info=self.run_info)
        state = {"global_step": self.global_step, "data_position": self.consumed(),
                 **{name: obj.state_dict() for name, obj in self.driver.checkpointed_state().items()}}
        start = time.perf_counter()
        logger.info("saving the checkpoint of step %d (%s) under %s", self.global_step, ", ".join(writers),
                    self.checkpoints.root)
        path = self.checkpoints.save(self.global_step, writers, state)
        logger.info("saved %s in %.1f s", path, time.perf_counter() - start)
        return path

    def resume(self) -> int:
        """Load the checkpoint chosen by ``trainer.resume_mode`` (if any); returns the step to continue from.

        Raises:
            KeyError: the checkpoint lacks a part this driver checkpoints (it was written by another driver).
        """
        path = self.checkpoints.resolve(self.config.trainer.resume_mode)
        if path is None:
            return 0
        state = load_trainer_state(path)
        groups, objects = self.driver.checkpointed_groups(), self.driver.checkpointed_state()
        missing = [name for name in objects if name not in state]
        missing += [name for name in groups if not os.path.isdir(os.path.join(path, name))]
        if missing:
            raise KeyError(f"checkpoint {path} has no {missing}; it was written by a run with another "
                           f"algorithm.driver (this one is {self.config.algorithm.driver!r})")
        for name, group in groups.items():
            group.load_checkpoint(os.path.join(path, name))
        self.global_step = state["global_step"]
        self.data_position = state.get("data_position", self.global_step)  # older checkpoints: one batch per step
        for name, obj in objects.items():
            obj.load_state_dict(state[name])
        logger.info("resumed from %s at step %d", path, self.global_step)
        return self.global_step

    def fit(self, train_batches: TrainBatches, val_data: Optional[DataProto], total_steps: int) -> dict:
        """Resume, then run steps up to ``total_steps`` (see the module docstring); returns the last validation
        metrics (empty when none ran).

        Raises:
            WorkerError: a worker-group call failed: one the driver read raises where it read it; one it never read
                after its step (once finished), at the next call, before the next checkpoint, or at the end.
        """
        cfg = self.config.trainer
        val_metrics: dict[str, float] = {}
        start = self.resume()
        self.data = DataCursor(train_batches, self.data_position)
        self.driver.global_step = self.global_step
        self.driver.start(self.data, start)
        if val_data is not None and cfg.val_before_train and start == 0:
            val_metrics = self.driver.validate(val_data)
            self._log(val_metrics, 0)
        while self.global_step < total_steps:
            step_start = time.perf_counter()
            self.global_step += 1
            self.driver.global_step = self.global_step
            metrics = self.driver.step(self.driver.take_batch())
            raise_unread_errors(wait=False)  # a look-ahead call still running is not waited for
            last = self.global_step == total_steps
            if val_data is not None and cfg.test_freq > 0 and (self.global_step % cfg.test_freq == 0 or last):
                val_start = time.perf_counter()
                val_metrics = self.driver.validate(val_data)
                metrics.update(val_metrics, **{"timing_s/testing": time.perf_counter() - val_start})
            if cfg.save_freq > 0 and (self.global_step % cfg.save_freq == 0 or last):
                save_start = time.perf_counter()
                self.save_checkpoint()
                metrics["timing_s/save_checkpoint"] = time.perf_counter() - save_start
            metrics["timing_s/iteration"] = time.perf_counter() - step_start
            self._log(metrics, self.global_step)
        raise_unread_errors(wait=True)
        return val_metrics

    def _log(self, metrics: dict[str, float], step: int) -> None:
        if self.tracker is not None:
            self.tracker.log(metrics, step=step)
