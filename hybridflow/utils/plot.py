"""Training curves as a picture: ``hybridflow plot RUN_DIR [RUN_DIR ...]`` and the ``curves.png`` a run leaves.

Reads each run's ``metrics.jsonl`` (one JSON object per :meth:`~hybridflow.utils.tracking.Tracking.log` call:
``{"step": N, "timestamp": seconds, "<metric>": float, ...}``; the timestamp is not drawn) and draws one panel per entry of ``PANELS`` whose metrics any run has
(score/reward with the validation points, KL, entropy, response length, step time, throughput, Safe-RLHF cost
and lambda, async staleness), or one panel per metric named with ``metrics``. Several runs go into the same
panels, one colour per run (line style per metric), with a legend naming them; one run gets a colour per metric.

matplotlib draws through its Agg canvas on a :class:`~matplotlib.figure.Figure` (no pyplot, no display, no
global figure state), so this works on headless machines and inside a running trainer.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from matplotlib.figure import Figure

from hybridflow.utils.tracking import (METRIC_ENTROPY, METRIC_KL, METRIC_RESPONSE_LENGTH, METRIC_REWARD,
                                       METRIC_SCORE, METRIC_STEP_TIME, METRIC_THROUGHPUT, VAL_PREFIX)

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"  # what a run writes into its directory at the end (trainer.plot_curves)


class Panel(NamedTuple):
    """One axis of the figure: its title and the metrics drawn on it (``val/*`` ones as points)."""

    title: str
    metrics: tuple[str, ...]


PANELS: tuple[Panel, ...] = (
    Panel("score / reward", (METRIC_SCORE, METRIC_REWARD, f"{VAL_PREFIX}score")),
    Panel("KL(actor || reference)", (METRIC_KL,)),
    Panel("entropy (nats / token)", (METRIC_ENTROPY,)),
    Panel("response length (tokens)", (METRIC_RESPONSE_LENGTH,)),
    Panel("step time (s)", (METRIC_STEP_TIME,)),
    Panel("throughput (tokens / s)", (METRIC_THROUGHPUT,)),
    Panel("Safe-RLHF cost", ("cost/score/mean", "lagrange/window_cost", "lagrange/threshold", f"{VAL_PREFIX}cost")),
    Panel("Safe-RLHF lambda", ("lagrange/lambda",)),
    Panel("async staleness (policy versions)", ("async/staleness_mean", "async/staleness_max")),
)

Series = dict[str, list[tuple[int, float]]]  # metric -> [(step, value)] sorted by step


def read_metrics(run_dir: str | Path) -> Series:
    """The curves of one run: metric -> ``[(step, value), ...]`` sorted by step.

    A step logged twice (a resumed run that re-did steps) keeps its last value; non-finite values are dropped.

    Raises:
        FileNotFoundError: ``run_dir`` does not exist, or has no ``metrics.jsonl`` (a run that has logged no step
            yet, or one without the ``jsonl`` logger); one line naming the file.
        ValueError: a line that is not a JSON object with an integer ``step`` (the message gives file and line);
            a ``metrics.jsonl`` without a step (one line naming the file).
    """
    path = Path(run_dir) / METRICS_FILE
    if not Path(run_dir).is_dir():
        raise FileNotFoundError(f"{path} not found: there is no directory {run_dir} (a run's "
                                "trainer.default_local_dir)")
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the run in {run_dir} has logged no step yet, or it runs "
                                "without the jsonl logger (trainer.logger)")
    by_metric = _read_rows(path)
    if by_metric is None:
        raise ValueError(f"{path} has no step: the run in {run_dir} has logged no step yet")
    return {name: sorted(points.items()) for name, points in by_metric.items()}


def _read_rows(path: Path) -> dict[str, dict[int, float]] | None:
    """metric -> {step: value} of the rows of ``path`` (None when it has no row); raises as :func:`read_metrics`."""
    by_metric: dict[str, dict[int, float]] | None = None
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                step = int(row.pop("step"))
                row.pop("timestamp", None)  # the row's wall-clock time, not a metric
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ValueError(f"{path}:{number}: not a metrics line with a step ({exc})") from exc
            by_metric = {} if by_metric is None else by_metric
            for name, value in row.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    by_metric.setdefault(name, {})[step] = float(value)
    return by_metric


def plot_runs(run_dirs: Sequence[str | Path], metrics: Sequence[str] | None = None,
              out: str | Path | None = None) -> Figure:
    """Draw the curves of one or more runs into one figure (and save it as PNG when ``out`` is given).

    Args:
        run_dirs: run directories, each with a ``metrics.jsonl``; each run gets one colour.
        metrics: draw exactly these metrics, one panel each, in this order; None draws the ``PANELS`` whose
            metrics at least one run has.
        out: PNG path to write (parent directories are created).

    Returns:
        The figure; its axes (``fig.axes``) are the panels, in order.

    Raises:
        FileNotFoundError / ValueError: from :func:`read_metrics`.
        ValueError: no run directory given; a requested metric that no run has (with close names); runs that
            have none of the standard panels' metrics.
    """
    if not run_dirs:
        raise ValueError("plot_runs needs at least one run directory")
    runs = {_label(Path(d), run_dirs): read_metrics(d) for d in run_dirs}
    present = set().union(*runs.values())
    if metrics:
        missing = [m for m in metrics if m not in present]
        if missing:
            hints = {m: difflib.get_close_matches(m, sorted(present), n=3) for m in missing}
            raise ValueError("no run has " + "; ".join(f"{m!r} (close: {', '.join(h) or 'none'})"
                                                       for m, h in hints.items()))
        panels = [Panel(m, (m,)) for m in metrics]
    else:
        panels = [Panel(p.title, tuple(m for m in p.metrics if m in present)) for p in PANELS]
        panels = [p for p in panels if p.metrics]
        if not panels:
            raise ValueError(f"the runs have none of the standard metrics; pass metrics=... from: "
                             f"{', '.join(sorted(present)[:20])}")
    fig = _draw(panels, runs)
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100)
    return fig


def write_run_curves(run_dir: str | Path) -> Path | None:
    """At the end of a run (``trainer.plot_curves``): the standard panels into ``<run_dir>/curves.png``.

    Returns the path written, or None (with one log line) when the run logged no ``metrics.jsonl`` or no
    standard metric (nothing to draw)."""
    run_dir = Path(run_dir)
    if not (run_dir / METRICS_FILE).is_file():
        logger.info("trainer.plot_curves: no %s in %s (add jsonl to trainer.logger); no %s written",
                    METRICS_FILE, run_dir, CURVES_FILE)
        return None
    try:
        plot_runs([run_dir], out=run_dir / CURVES_FILE)
    except ValueError as exc:
        logger.info("trainer.plot_curves: nothing drawn (%s)", exc)
        return None
    logger.info("curves in %s", run_dir / CURVES_FILE)
    return run_dir / CURVES_FILE


def _draw(panels: Sequence[Panel], runs: dict[str, Series]) -> Figure:
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(5.0 * ncols, 3.4 * nrows), layout="constrained")
    multi_run = len(runs) > 1
    for index, panel in enumerate(panels):
        ax = fig.add_subplot(nrows, ncols, index + 1)
        for run_index, (run, series) in enumerate(runs.items()):
            for metric_index, (style, metric) in enumerate(zip(("-", "--", ":", "-."), panel.metrics)):
                if metric not in series:
                    continue
                # one run: a colour per metric; several: a colour per run, a line style per metric
                colour = f"C{(run_index if multi_run else metric_index) % 10}"
                steps, values = zip(*series[metric])
                label = _series_label(run, metric, multi_run=multi_run, multi_metric=len(panel.metrics) > 1)
                if metric.startswith(VAL_PREFIX):  # validation: a few points, at the steps it ran
                    ax.plot(steps, values, "o" + style, color=colour, label=label, markersize=5, linewidth=1)
                else:
                    ax.plot(steps, values, style, color=colour, label=label, linewidth=1.5)
        ax.set_title(panel.title, fontsize=11)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def _series_label(run: str, metric: str, multi_run: bool, multi_metric: bool) -> str:
    if not multi_run:
        return metric
    return f"{run}: {metric}" if multi_metric else run


def _label(run_dir: Path, run_dirs: Sequence[str | Path]) -> str:
    """The run's directory name, or its full path when another run has the same name."""
    same_name = [d for d in run_dirs if Path(d).name == run_dir.name]
    return run_dir.name if len(same_name) == 1 else str(run_dir)
