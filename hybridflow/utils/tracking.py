"""Metrics tracking: one ``Tracking`` object fans each step's metrics out to the configured backends.

Backends (``trainer.logger``):

- ``console``: one compact line per ``log`` call on stdout, built from the well-known metric names below, e.g.
  ``step 12 | reward 0.41 | kl 0.003 | entropy 0.85 | resp_len 14.2 | val/score 0.62 | 3.1s | 812 tok/s``.
  Fields whose metric is absent are left out.
- ``jsonl``: appends one JSON object per ``log`` call (``{"step": 12, "timestamp": <seconds since the epoch>,
  "<metric>": <float>, ...}``; ``timestamp`` is the wall-clock time of the call) to
  ``<default_local_dir>/metrics.jsonl``, flushed on every call, and saves the run's config once to
  ``<default_local_dir>/config.yaml`` with a ``run_info`` section (hybridflow version, git commit of a checkout,
  start time: :mod:`hybridflow.utils.provenance`). Non-finite values are written as ``NaN`` / ``Infinity`` (which Python's
  ``json`` reads back). Before a run starts, :func:`trim_metrics` (resume) or :func:`set_metrics_aside` (fresh
  run) leaves the file with one row per step.
- ``tensorboard``: scalars under ``<default_local_dir>/tensorboard`` (needs the ``tensorboard`` package), and the
  resolved config as the hparams plugin's hyper-parameters.
- ``wandb``: a Weights & Biases run (``project``/``name`` from the trainer's names, files under
  ``<default_local_dir>/wandb``); ``WANDB_MODE=offline`` keeps it on disk (``wandb sync`` uploads it later).
- ``mlflow``: an MLflow run in the experiment ``project_name`` of the tracking server or store named by
  ``MLFLOW_TRACKING_URI`` (e.g. ``sqlite:///mlflow.db``, ``http://host:5000``, ``file:///path/mlruns``);
  characters MLflow refuses (``@`` of ``val/mean@4``) become ``_at_`` / ``_``. Metric names keep their slashes,
  except in a file store (``file:`` URIs, plain paths, MLflow 2's default ``./mlruns``), which keeps each metric
  in a file at that path and so cannot hold ``val/score`` next to ``val/score/<source>``: there ``/`` becomes
  ``.``.
- ``swanlab``: a SwanLab run; ``SWANLAB_MODE=offline`` (or ``local``) writes it under
  ``<default_local_dir>/swanlog``.

The last three (``REMOTE_BACKENDS``) get the resolved config as the run's hyper-parameters (nested for wandb and
swanlab, dotted keys for mlflow) and are optional extras: ``pip install -e ".[wandb]"`` (``mlflow``, ``swanlab``,
``tensorboard`` alike).

The console line reads the metric names defined by the ``METRIC_*`` constants below and ``val/score``, plus the
keys starting with ``VAL_PREFIX`` that fit in ``CONSOLE_LINE_MAX`` characters; producers of metrics should use
these names.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hybridflow.utils.progress import RUN_VAL_METRIC, Progress, write_line

logger = logging.getLogger(__name__)

BACKENDS = ("console", "jsonl", "tensorboard", "wandb", "mlflow", "swanlab")
# backend -> the module it imports (the loader checks it is installed before Ray starts); its extra has its name
BACKEND_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "swanlab": "swanlab"}
METRICS_FILE = "metrics.jsonl"
ROW_KEYS = ("step", "timestamp")  # the fields of a metrics.jsonl row that are no metric

METRIC_REWARD = "critic/rewards/mean"  # mean sequence reward after the KL penalty (when use_kl_in_reward)
METRIC_SCORE = "critic/score/mean"  # mean reward-function score; shown as reward when METRIC_REWARD is absent
METRIC_KL = "rollout/kl"  # mean per-token KL(actor || reference) estimate over response tokens
METRIC_ENTROPY = "actor/entropy"  # mean per-token entropy of the actor policy, nats
METRIC_RESPONSE_LENGTH = "response_length/mean"  # mean response length, tokens
METRIC_STEP_TIME = "timing_s/step"  # wall-clock seconds of the whole training step
METRIC_THROUGHPUT = "perf/throughput"  # tokens (prompt + response) trained on per second of step time
VAL_PREFIX = "val/"  # validation metrics (e.g. ``val/score/<source>``) are shown while the line has room
CONSOLE_LINE_MAX = 200  # characters of the console line; the other val/ metrics that do not fit are counted


class Tracking:
    """Log scalar metrics of each training step to several backends.

    Args:
        project_name: project, shown in the first log line and used as the tensorboard run name's prefix.
        experiment_name: experiment within the project.
        default_local_dir: run directory for the file backends (created when needed).
        backends: names out of ``BACKENDS``.
        config: the run's config (``DictConfig``, dict or dataclass), saved to ``config.yaml`` by ``jsonl``.
        run_info: the ``run_info`` section saved with it (:func:`~hybridflow.utils.provenance.make_run_info`; default:
            made now).

    Raises:
        ValueError: an unknown backend name (the message lists the known ones).
        ImportError: ``tensorboard``, ``wandb``, ``mlflow`` or ``swanlab`` requested but its package is not
            installed.
    """

    def __init__(self, project_name: str, experiment_name: str, default_local_dir: str | Path,
                 backends: Sequence[str] = ("console", "jsonl"), config: Any = None,
                 run_info: dict[str, Any] | None = None):
        unknown = [b for b in backends if b not in BACKENDS]
        if unknown:
            raise ValueError(f"unknown tracking backend(s) {unknown}; known: {', '.join(BACKENDS)}")
        self.backends = tuple(backends)
        self.local_dir = Path(default_local_dir)
        self._jsonl = None
        self._tensorboard = None
        if "jsonl" in self.backends:
            self.local_dir.mkdir(parents=True, exist_ok=True)
            if config is not None:
                from omegaconf import OmegaConf

                from hybridflow.utils.provenance import config_with_run_info, make_run_info

                info = make_run_info() if run_info is None else run_info
                OmegaConf.save(config_with_run_info(config, info), self.local_dir / "config.yaml", resolve=True)
            self._jsonl = open(self.local_dir / METRICS_FILE, "a", encoding="utf-8")
        if "tensorboard" in self.backends:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ImportError("the tensorboard tracking backend needs the tensorboard package "
                                  "(pip install tensorboard)") from exc
            self._tensorboard = SummaryWriter(log_dir=str(self.local_dir / "tensorboard"))
            _log_tensorboard_hparams(self._tensorboard, config)
        self._remote: list[Any] = []  # started REMOTE_BACKENDS objects
        try:
            for name in (b for b in self.backends if b in REMOTE_BACKENDS):
                self._remote.append(REMOTE_BACKENDS[name](project_name, experiment_name, self.local_dir, config))
        except BaseException:  # a tracker that fails to start: end the ones already started, close the files
            self.finish()
            raise
        logger.info("tracking %s/%s with %s in %s", project_name, experiment_name, ", ".join(self.backends),
                    self.local_dir)

    def log(self, data: Mapping[str, Any], step: int) -> None:
        """Record the metrics of one step.

        Args:
            data: metric name -> scalar (float, int, bool, 0-d or one-element numpy array / torch tensor).
            step: training step (the x axis).

        Raises:
            TypeError: a value that is not a scalar number; the message names the metric.
            ValueError: a metric named ``step`` or ``timestamp`` (names ``metrics.jsonl`` gives every row).
        """
        for reserved in ROW_KEYS:
            if reserved in data:
                raise ValueError(f"{reserved!r} is reserved for the metrics.jsonl row's own field; rename that "
                                 "metric")
        metrics = {name: _to_float(name, value) for name, value in data.items()}
        if "console" in self.backends:
            write_line(format_console_line(metrics, step))  # above the progress bars, if any
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, "timestamp": round(time.time(), 3), **metrics}) + "\n")
            self._jsonl.flush()
        if self._tensorboard is not None:
            for name, value in metrics.items():
                self._tensorboard.add_scalar(name, value, step)
            self._tensorboard.flush()
        for backend in self._remote:
            backend.log(metrics, step)

    def finish(self) -> None:
        """Close the file backends and end the tracker runs; later ``log`` calls only reach the console. Safe to
        call twice."""
        for backend in self._remote:
            backend.finish()
        self._remote = []
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None


def trim_metrics(local_dir: str | Path, last_step: int) -> int:
    """Before resuming from the checkpoint of step ``last_step``: drop the rows of ``local_dir/metrics.jsonl`` with
    a step above it (logged after that checkpoint by the interrupted run; the resumed run logs them again) and a
    partly written last line. The file is rewritten atomically (temporary file + ``os.replace``).

    Returns:
        The number of lines dropped (0 also when there is no file).
    """
    path = Path(local_dir) / METRICS_FILE
    if not path.exists():
        return 0
    kept, dropped, line = [], 0, "\n"
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by the interrupt
                row = None
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= last_step:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    if dropped or not line.endswith("\n"):  # (a last row without its newline would run into the next one)
        tmp = path.with_name(METRICS_FILE + ".tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)
        logger.info("resuming at step %d: dropped %d rows after it from %s", last_step, dropped, path)
    return dropped


def set_metrics_aside(local_dir: str | Path) -> Path | None:
    """Before a fresh run (no checkpoint to resume): move a previous run's ``local_dir/metrics.jsonl`` to
    ``metrics.<its last write, UTC, YYYYmmdd-HHMMSS>.jsonl`` so the new run starts a new file. Returns the new path
    of the old file (None when there was none or it was empty)."""
    path = Path(local_dir) / METRICS_FILE
    if not path.exists() or path.stat().st_size == 0:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(path.stat().st_mtime))
    target, n = path.with_name(f"metrics.{stamp}.jsonl"), 1
    while target.exists():
        target, n = path.with_name(f"metrics.{stamp}-{n}.jsonl"), n + 1
    os.replace(path, target)
    logger.warning("%s holds a previous run's metrics and no checkpoint to resume: moved it to %s", local_dir,
                   target.name)
    return target


def format_console_line(metrics: Mapping[str, float], step: int) -> str:
    """The one-line console summary of a step, e.g. ``step 12 | reward 0.41 | kl 0.003 | 3.1s | 812 tok/s``: the
    fixed fields (reward, kl, entropy, resp_len, ``val/score``, step time, throughput) when present, then the
    other ``val/`` metrics in their order while the line stays within :data:`CONSOLE_LINE_MAX` characters; the
    ones left out are counted (``+N val/ metrics``). Every metric goes to the other backends in full."""
    head = [f"step {step}"]
    reward = metrics.get(METRIC_REWARD, metrics.get(METRIC_SCORE))
    for label, value in (("reward", reward), ("kl", metrics.get(METRIC_KL)),
                         ("entropy", metrics.get(METRIC_ENTROPY)),
                         ("resp_len", metrics.get(METRIC_RESPONSE_LENGTH)),
                         (RUN_VAL_METRIC, metrics.get(RUN_VAL_METRIC))):
        if value is not None:
            head.append(f"{label} {_short(value)}")
    tail = []
    if METRIC_STEP_TIME in metrics:
        tail.append(f"{metrics[METRIC_STEP_TIME]:.1f}s")
    if METRIC_THROUGHPUT in metrics:
        tail.append(f"{metrics[METRIC_THROUGHPUT]:.0f} tok/s")
    others = [f"{name} {_short(value)}" for name, value in metrics.items()
              if name.startswith(VAL_PREFIX) and name != RUN_VAL_METRIC]
    shown = len(others)
    while True:  # as many as fit, with the count of the rest
        left = len(others) - shown
        line = " | ".join(head + others[:shown] + tail + ([f"+{left} val/ metrics"] if left else []))
        if len(line) <= CONSOLE_LINE_MAX or shown == 0:
            return line
        shown -= 1


def _short(value: float) -> str:
    """Three significant digits, without switching to exponent notation for large values."""
    return f"{value:.0f}" if math.isfinite(value) and abs(value) >= 1000 else f"{value:.3g}"


def _to_float(name: str, value: Any) -> float:
    if hasattr(value, "item"):  # numpy scalars / arrays and torch tensors with one element
        try:
            value = value.item()
        except (ValueError, RuntimeError) as exc:
            shape = tuple(getattr(value, "shape", ()))
            raise TypeError(f"metric {name!r} must be a scalar, got an array of shape {shape}") from exc
    if isinstance(value, (bool, int, float)):
        return float(value)
    raise TypeError(f"metric {name!r} must be a number, got {type(value).__name__}: {value!r}")


def config_dict(config: Any) -> dict[str, Any]:
    """The run's config as a plain nested dict with interpolations resolved ({} for None)."""
    if config is None:
        return {}
    from omegaconf import OmegaConf

    if not OmegaConf.is_config(config):
        config = OmegaConf.structured(config) if not isinstance(config, Mapping) else OmegaConf.create(config)
    return OmegaConf.to_container(config, resolve=True)


def flatten_config(config: Any) -> dict[str, str | int | float | bool]:
    """The resolved config as dotted keys -> scalars (``{"trainer.seed": 1, ...}``) for trackers whose
    hyper-parameters are flat; lists and None become their ``str``."""
    flat: dict[str, str | int | float | bool] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, Mapping) and node:
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        elif prefix:  # an empty config has no parameters
            flat[prefix[:-1]] = node if isinstance(node, (str, int, float, bool)) else str(node)

    walk(config_dict(config), "")
    return flat


def _log_tensorboard_hparams(writer: Any, config: Any) -> None:
    """The resolved config in the hparams plugin of the writer's own event file (not a sub-run)."""
    if config is None:
        return
    from torch.utils.tensorboard.summary import hparams

    for summary in hparams(flatten_config(config), {}):
        writer.file_writer.add_summary(summary)


def _import_backend(name: str) -> Any:
    import importlib

    try:
        return importlib.import_module(BACKEND_PACKAGES[name])
    except ImportError as exc:
        raise ImportError(f"the {name} tracking backend needs the {name} package "
                          f'(pip install -e ".[{name}]" or pip install {name})') from exc


class WandbBackend:
    """A wandb run: ``wandb.init(project, name, config, dir=<run dir>)``; one ``run.log(metrics, step)`` per step.

    Raises:
        ImportError: wandb is not installed.
    """

    def __init__(self, project_name: str, experiment_name: str, local_dir: Path, config: Any):
        self._wandb = wandb = _import_backend("wandb")
        local_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project_name, name=experiment_name, config=config_dict(config),
                              dir=str(local_dir), reinit="create_new")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def finish(self) -> None:
        """End the run and stop wandb's service process: only then is an offline run's journal complete on disk
        (``run.finish()`` alone returns before it is flushed)."""
        self.run.finish()
        self._wandb.teardown()


_MLFLOW_BAD_CHARS = re.compile(r"[^\w\-. /:]")
MLFLOW_MAX_PARAM_LENGTH = 6000  # MLflow refuses longer parameter values; longer ones are cut there


def mlflow_metric_name(name: str, file_store: bool = False) -> str:
    """``name`` with the characters MLflow refuses replaced (``@`` -> ``_at_``, others -> ``_``), and for a
    file store (metric name = file path) ``/`` -> ``.``, so no metric's file is another's directory."""
    name = _MLFLOW_BAD_CHARS.sub("_", name.replace("@", "_at_"))
    return name.replace("/", ".") if file_store else name


class MlflowBackend:
    """An MLflow run in experiment ``project_name`` (created when missing), named ``experiment_name``, at
    ``MLFLOW_TRACKING_URI``; parameters are the flattened config, metrics go in one ``log_batch`` per step.

    Raises:
        ImportError: mlflow is not installed.
    """

    def __init__(self, project_name: str, experiment_name: str, local_dir: Path, config: Any):
        mlflow = _import_backend("mlflow")
        from mlflow.entities import Param

        self._client = mlflow.tracking.MlflowClient()
        self._file_store = urllib.parse.urlparse(self._client.tracking_uri).scheme in ("", "file")
        experiment = self._client.get_experiment_by_name(project_name)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self._client.create_experiment(project_name))
        self._run_id = self._client.create_run(experiment_id, run_name=experiment_name).info.run_id
        params = [Param(key, str(value)[:MLFLOW_MAX_PARAM_LENGTH]) for key, value in flatten_config(config).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
            self._client.log_batch(self._run_id, params=params[start:start + 100])

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_metric_name(name, self._file_store), value, now, step)
                 for name, value in metrics.items()]
        for start in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics per batch
            self._client.log_batch(self._run_id, metrics=batch[start:start + 1000])

    def finish(self) -> None:
        self._client.set_terminated(self._run_id)


class SwanlabBackend:
    """A SwanLab run: ``swanlab.init(project, experiment_name, config, logdir=<run dir>/swanlog)``.

    Raises:
        ImportError: swanlab is not installed.
    """

    def __init__(self, project_name: str, experiment_name: str, local_dir: Path, config: Any):
        swanlab = _import_backend("swanlab")
        log_dir = local_dir / "swanlog"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.run = swanlab.init(project=project_name, name=experiment_name, config=config_dict(config),
                                log_dir=str(log_dir), reinit=True)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def finish(self) -> None:
        self.run.finish()


# tracker backends that are a class with log(metrics, step) / finish(), built as cls(project, experiment, dir, cfg)
REMOTE_BACKENDS = {"wandb": WandbBackend, "mlflow": MlflowBackend, "swanlab": SwanlabBackend}


class RunProgress:
    """The training run's progress: ``step N/total`` with ETA, the last reward and ``val/score``; it sits between
    the driver and the run's :class:`Tracking` (same ``log``/``finish`` contract) so
    every logged step advances it.

    Args:
        tracker: the run's tracker.
        total: the run's total number of steps.
        start: the step the run starts from (a resumed run's checkpoint step).

    ``last_step`` is the last step logged (``start`` before any), i.e. the last complete step.
    """

    def __init__(self, tracker: Any, total: int, start: int = 0) -> None:
        self._reward_keys = (METRIC_REWARD, METRIC_SCORE)
        self.tracker, self.last_step = tracker, start
        self._progress = Progress("train", total, "steps", initial=start)
        self._shown: dict[str, float] = {}

    def log(self, data: Mapping[str, Any], step: int) -> None:
        """Forward to the tracker, then advance the bar to ``step`` (step 0: the validation before training)."""
        self.tracker.log(data, step)
        reward = data.get(self._reward_keys[0], data.get(self._reward_keys[1]))
        if reward is not None:
            self._shown["reward"] = float(reward)
        if RUN_VAL_METRIC in data:
            self._shown[RUN_VAL_METRIC] = float(data[RUN_VAL_METRIC])
        self.last_step = max(self.last_step, step)
        self._progress.advance_to(self.last_step, self._shown)

    def finish(self) -> None:
        """Close the bar and the tracker."""
        self._progress.close()
        self.tracker.finish()
