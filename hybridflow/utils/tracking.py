"""Metrics tracking: one ``Tracking`` object fans each step's metrics out to the configured backends.

Backends (``trainer.logger``):

- ``console``: one compact line per ``log`` call on stdout, built from the well-known metric names below, e.g.
  ``step 12 | reward 0.41 | kl 0.003 | entropy 0.85 | resp_len 14.2 | val/score 0.62 | 3.1s | 812 tok/s``.
  Fields whose metric is absent are left out.
- ``jsonl``: appends one JSON object per ``log`` call (``{"step": 12, "<metric>": <float>, ...}``) to
  ``<default_local_dir>/metrics.jsonl``, flushed on every call, and saves the run's config once to
  ``<default_local_dir>/config.yaml``. Non-finite values are written as ``NaN`` / ``Infinity`` (which Python's
  ``json`` reads back). Before a run starts, :func:`trim_metrics` (resume) or :func:`set_metrics_aside` (fresh
  run) leaves the file with one row per step.
- ``tensorboard``: scalars under ``<default_local_dir>/tensorboard`` (needs the ``tensorboard`` package).

The console line reads the metric names defined by the ``METRIC_*`` constants below, plus every key starting
with ``VAL_PREFIX``; producers of metrics should use these names.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

BACKENDS = ("console", "jsonl", "tensorboard")
METRICS_FILE = "metrics.jsonl"

METRIC_REWARD = "critic/rewards/mean"  # mean sequence reward after the KL penalty (when use_kl_in_reward)
METRIC_SCORE = "critic/score/mean"  # mean reward-function score; shown as reward when METRIC_REWARD is absent
METRIC_KL = "rollout/kl"  # mean per-token KL(actor || reference) estimate over response tokens
METRIC_ENTROPY = "actor/entropy"  # mean per-token entropy of the actor policy, nats
METRIC_RESPONSE_LENGTH = "response_length/mean"  # mean response length, tokens
METRIC_STEP_TIME = "timing_s/step"  # wall-clock seconds of the whole training step
METRIC_THROUGHPUT = "perf/throughput"  # tokens (prompt + response) trained on per second of step time
VAL_PREFIX = "val/"  # every validation metric (e.g. ``val/score``) is shown when present


class Tracking:
    """Log scalar metrics of each training step to several backends.

    Args:
        project_name: project, shown in the first log line and used as the tensorboard run name's prefix.
        experiment_name: experiment within the project.
        default_local_dir: run directory for the file backends (created when needed).
        backends: names out of ``BACKENDS``.
        config: the run's config (``DictConfig``, dict or dataclass), saved to ``config.yaml`` by ``jsonl``.

    Raises:
        ValueError: an unknown backend name (the message lists the known ones).
        ImportError: ``tensorboard`` requested but the tensorboard package is not installed.
    """

    def __init__(self, project_name: str, experiment_name: str, default_local_dir: str | Path,
                 backends: Sequence[str] = ("console", "jsonl"), config: Any = None):
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

                OmegaConf.save(config, self.local_dir / "config.yaml", resolve=True)
            self._jsonl = open(self.local_dir / METRICS_FILE, "a", encoding="utf-8")
        if "tensorboard" in self.backends:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ImportError("the tensorboard tracking backend needs the tensorboard package "
                                  "(pip install tensorboard)") from exc
            self._tensorboard = SummaryWriter(log_dir=str(self.local_dir / "tensorboard"))
        logger.info("tracking %s/%s with %s in %s", project_name, experiment_name, ", ".join(self.backends),
                    self.local_dir)

    def log(self, data: Mapping[str, Any], step: int) -> None:
        """Record the metrics of one step.

        Args:
            data: metric name -> scalar (float, int, bool, 0-d or one-element numpy array / torch tensor).
            step: training step (the x axis).

        Raises:
            TypeError: a value that is not a scalar number; the message names the metric.
            ValueError: a metric named ``step`` (the name is reserved for the step).
        """
        if "step" in data:
            raise ValueError("'step' is reserved for the step argument; rename that metric")
        metrics = {name: _to_float(name, value) for name, value in data.items()}
        if "console" in self.backends:
            print(format_console_line(metrics, step), file=sys.stdout, flush=True)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
            self._jsonl.flush()
        if self._tensorboard is not None:
            for name, value in metrics.items():
                self._tensorboard.add_scalar(name, value, step)
            self._tensorboard.flush()

    def finish(self) -> None:
        """Close the file backends; later ``log`` calls only reach the console. Safe to call twice."""
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
    """The one-line console summary of a step, e.g. ``step 12 | reward 0.41 | kl 0.003 | 3.1s | 812 tok/s``."""
    fields = [f"step {step}"]
    reward = metrics.get(METRIC_REWARD, metrics.get(METRIC_SCORE))
    for label, value in (("reward", reward), ("kl", metrics.get(METRIC_KL)),
                         ("entropy", metrics.get(METRIC_ENTROPY)),
                         ("resp_len", metrics.get(METRIC_RESPONSE_LENGTH))):
        if value is not None:
            fields.append(f"{label} {_short(value)}")
    fields += [f"{name} {_short(value)}" for name, value in metrics.items() if name.startswith(VAL_PREFIX)]
    if METRIC_STEP_TIME in metrics:
        fields.append(f"{metrics[METRIC_STEP_TIME]:.1f}s")
    if METRIC_THROUGHPUT in metrics:
        fields.append(f"{metrics[METRIC_THROUGHPUT]:.0f} tok/s")
    return " | ".join(fields)


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
