"""Metric values that say how they pool, and the one reduction used wherever metrics are pooled.

A metric that crosses micro-batches, mini-batches, dp ranks or the ranks of a worker-group call is declared where
it is produced as one of these kinds (each carries what pooling needs, not a finished number):

* ``Mean(total, count)``: a token- (or sample-) weighted mean, pooled as ``sum(total) / sum(count)``;
* ``Sum(value)``: a total, pooled as ``sum(value)``;
* ``Max(value)`` / ``Min(value)``: pooled as the largest / smallest value;
* ``Std(total, sq, count)``: the population standard deviation (ddof 0) of all the samples from their pooled
  moments, ``sqrt(sum(sq) / n - (sum(total) / n)^2)`` with ``n = sum(count)``;
* ``Span(start, end)``: a wall-clock interval, pooled as the earliest start and the latest end (a worker method's
  interval over the ranks of one call); its result is the list ``[(start, end)]``, not a float.

So a mean of means, a mean of maxima or an average of standard deviations never happens: pooling a dict of them in
any grouping (micro-batches, then ranks) gives the value of all the samples at once. :func:`reduce_metrics` pools
dicts key by key; :func:`accumulate` adds one value to a running dict; :func:`finalize` gives the floats to log
(a metric with no samples, a ``Mean``/``Std`` of count 0 or a ``Max``/``Min`` of nothing, logs 0.0). The dp ranks of
a group pool with :func:`hybridflow.distributed.gather_metrics`; the counted ranks of a worker-group call pool
the kinds in their ``meta_info`` (a kind, or a dict such as ``metrics`` holding kinds: worker seconds ``Max``, the
LoRA probe check ...) when the controller collects them
(:func:`~hybridflow.controller.dispatch.pool_declared_metrics`), and a driver pools a list of the ranks' dicts (e.g.
``send_weights``: seconds ``Max``, bytes ``Sum``) with ``finalize(reduce_metrics(...))``. A plain float stays the
first counted rank's: send one only for a value every rank holds alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Optional, Union

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

__all__ = ["Max", "Mean", "Metric", "Min", "Span", "Std", "Sum", "accumulate", "finalize", "reduce_metrics"]


@dataclass(frozen=True)
class Mean:
    """A weighted mean: ``total`` (the sum of the samples, or of value x weight) over ``count`` (their number or
    total weight, e.g. valid tokens)."""

    total: float = 0.0
    count: float = 0.0

    @classmethod
    def of(cls, values: "torch.Tensor") -> "Mean":
        """The mean of every element of ``values`` (any shape; select the valid ones first, e.g. ``x[mask]``)."""
        return cls(float(values.double().sum()), float(values.numel()))

    def merge(self, other: "Mean") -> "Mean":
        return Mean(self.total + other.total, self.count + other.count)

    def result(self) -> float:
        return self.total / self.count if self.count else 0.0


@dataclass(frozen=True)
class Sum:
    """A total (e.g. tokens computed)."""

    value: float = 0.0

    def merge(self, other: "Sum") -> "Sum":
        return Sum(self.value + other.value)

    def result(self) -> float:
        return self.value


@dataclass(frozen=True)
class Max:
    """The largest sample (``value`` None: no sample yet)."""

    value: Optional[float] = None

    @classmethod
    def of(cls, values: "torch.Tensor") -> "Max":
        """The largest element of ``values`` (none: an empty ``Max``)."""
        return cls(float(values.max()) if values.numel() else None)

    def merge(self, other: "Max") -> "Max":
        return Max(_pick(max, self.value, other.value))

    def result(self) -> float:
        return 0.0 if self.value is None else self.value


@dataclass(frozen=True)
class Min:
    """The smallest sample (``value`` None: no sample yet)."""

    value: Optional[float] = None

    @classmethod
    def of(cls, values: "torch.Tensor") -> "Min":
        """The smallest element of ``values`` (none: an empty ``Min``)."""
        return cls(float(values.min()) if values.numel() else None)

    def merge(self, other: "Min") -> "Min":
        return Min(_pick(min, self.value, other.value))

    def result(self) -> float:
        return 0.0 if self.value is None else self.value


@dataclass(frozen=True)
class Std:
    """A population standard deviation from the pooled moments: ``total`` (sum of the samples), ``sq`` (sum of
    their squares) and ``count`` (their number), in float64."""

    total: float = 0.0
    sq: float = 0.0
    count: float = 0.0

    @classmethod
    def of(cls, values: "torch.Tensor") -> "Std":
        """The moments of every element of ``values`` (any shape)."""
        v = values.double()
        return cls(float(v.sum()), float((v * v).sum()), float(v.numel()))

    def merge(self, other: "Std") -> "Std":
        return Std(self.total + other.total, self.sq + other.sq, self.count + other.count)

    def result(self) -> float:
        if not self.count:
            return 0.0
        mean = self.total / self.count
        return math.sqrt(max(self.sq / self.count - mean * mean, 0.0))


@dataclass(frozen=True)
class Span:
    """The wall-clock interval one call ran over its ranks (``time.time()`` seconds): pooled as the earliest
    ``start`` and the latest ``end``. Its result is a list of ``(start, end)`` pairs (empty: no sample), so the
    driver concatenates the spans of several calls and measures their union
    (:func:`hybridflow.trainer.steps.compute_timing_metrics`)."""

    start: Optional[float] = None
    end: Optional[float] = None

    def merge(self, other: "Span") -> "Span":
        return Span(_pick(min, self.start, other.start), _pick(max, self.end, other.end))

    def result(self) -> list[tuple[float, float]]:  # type: ignore[override]
        return [] if self.start is None or self.end is None else [(self.start, self.end)]


Metric = Union[Mean, Sum, Max, Min, Std, Span]
KINDS = (Mean, Sum, Max, Min, Std, Span)


def _pick(fn: Callable[[float, float], float], a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None:
        return b if a is None else a
    return fn(a, b)


def accumulate(into: dict[str, Metric], key: str, metric: Metric) -> None:
    """Pool ``metric`` into ``into[key]`` (set it when absent).

    Raises:
        TypeError: ``metric`` is not a metric kind, or ``into[key]`` is of another kind.
    """
    if not isinstance(metric, KINDS):
        raise TypeError(f"metric {key!r} is a {type(metric).__name__}; declare its kind where it is produced "
                        f"(one of {', '.join(k.__name__ for k in KINDS)} from hybridflow.utils.metrics)")
    held = into.get(key)
    if held is None:
        into[key] = metric
    elif type(held) is not type(metric):
        raise TypeError(f"metric {key!r} is pooled as {type(held).__name__} and {type(metric).__name__}; a metric "
                        "has one kind everywhere it is produced")
    else:
        into[key] = held.merge(metric)


def reduce_metrics(dicts: Iterable[Mapping[str, Metric]]) -> dict[str, Metric]:
    """Pool metric dicts key by key, each by its kind (a key absent from some dicts pools over the others).

    Raises:
        TypeError: as :func:`accumulate` (a plain number, or one key with two kinds).
    """
    pooled: dict[str, Metric] = {}
    for metrics in dicts:
        for key, metric in metrics.items():
            accumulate(pooled, key, metric)
    return pooled


def finalize(metrics: Mapping[str, Union[Metric, float]]) -> dict[str, float]:
    """The floats to log: each metric's pooled value; a plain number (a value no crossing pools, e.g. the lr every
    rank computes alike) is kept as it is."""
    return {key: m.result() if isinstance(m, KINDS) else float(m) for key, m in metrics.items()}
