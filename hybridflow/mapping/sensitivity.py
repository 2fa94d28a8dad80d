"""How robust is a recommended placement? Re-run the search with one parameter at each end of its plausible range
(``hybridflow.mapping.presets.KNOBS``) and report which values change the chosen placement.

Only the placement (which models share devices) counts as a flip; a different allocation or layout of the same
placement does not. Each knob costs one search per value (about 0.1-1 s at the paper's scale).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

from hybridflow.mapping.cost import CostParams
from hybridflow.mapping.plans import Placement, Plan, baseline_placements
from hybridflow.mapping.presets import KNOBS, Knob
from hybridflow.mapping.search import MappingSearch
from hybridflow.mapping.specs import ClusterSpec

logger = logging.getLogger(__name__)
SEARCH_LOGGER = logging.getLogger("hybridflow.mapping.search")

__all__ = ["placement_kind", "sensitivity", "vary"]


def placement_kind(placement: Placement, roles: Sequence[str]) -> str:
    """``colocate``, ``standalone`` or ``split`` (actor + reference | the others) when ``placement`` is that
    baseline (HybridFlow §8.4's names), else ``other (k sets)``."""
    for name, base in baseline_placements(roles).items():
        if base is not None and _normal(base) == _normal(placement):
            return name
    return f"other ({len(placement)} sets)"


def _normal(placement: Sequence[Sequence[str]]) -> tuple[tuple[str, ...], ...]:
    return tuple(sorted(tuple(sorted(s)) for s in placement))


def vary(params: CostParams, cluster: ClusterSpec, knob: Knob, value: float | bool) -> tuple[CostParams, ClusterSpec]:
    """``params`` and ``cluster`` with ``knob`` set to ``value`` (a ``CostParams`` field or a field of the
    cluster's device)."""
    if knob.on_device:
        device = dataclasses.replace(cluster.device, **{knob.field: value})
        return params, dataclasses.replace(cluster, device=device)
    return dataclasses.replace(params, **{knob.field: value}), cluster


def sensitivity(build: Callable[[CostParams, ClusterSpec], MappingSearch], params: CostParams,
                cluster: ClusterSpec, best: Plan, knobs: Sequence[Knob] = KNOBS) -> dict:
    """For each knob and each of its values, the placement the search chooses then.

    Args:
        build: a ``MappingSearch`` for given parameters and cluster (the same models, workload and space).
        params, cluster: the baseline the recommendation ``best`` came from.
        best: the recommended plan.
        knobs: the parameters to vary.

    Returns:
        ``{"placement": kind of best, "robust": no knob flips it, "flips": [{"knob", "value", "placement",
        "plan", "speedup_vs_colocate"}...], "checked": [{"knob", "value", "placement"}...]}``.
    """
    roles = [r for s in best.placement for r in s]
    base_kind = placement_kind(best.placement, roles)
    flips, checked = [], []
    start, level = time.perf_counter(), SEARCH_LOGGER.level
    SEARCH_LOGGER.setLevel(max(level, logging.WARNING))  # one line for all the re-searches, not one each
    try:
        _vary_all(build, params, cluster, best, knobs, roles, flips, checked)
    finally:
        SEARCH_LOGGER.setLevel(level)
    logger.info("sensitivity: %d searches in %.2f s, %d flips", len(checked), time.perf_counter() - start, len(flips))
    return {"placement": base_kind, "robust": not flips, "flips": flips, "checked": checked}


def _vary_all(build: Callable[[CostParams, ClusterSpec], MappingSearch], params: CostParams, cluster: ClusterSpec,
              best: Plan, knobs: Sequence[Knob], roles: list[str], flips: list[dict], checked: list[dict]) -> None:
    """The loop of ``sensitivity``: appends to ``flips`` and ``checked``."""
    for knob in knobs:
        for value in knob.values:
            p, c = vary(params, cluster, knob, value)
            result = build(p, c).run(top_k=1)
            if result.best is None:
                checked.append({"knob": knob.name, "value": value, "placement": "infeasible"})
                continue
            kind = placement_kind(result.best.placement, roles)
            checked.append({"knob": knob.name, "value": value, "placement": kind})
            if _normal(result.best.placement) != _normal(best.placement):
                colocate = result.baselines.get("colocate")
                flips.append({"knob": knob.name, "value": value, "placement": kind, "plan": result.best.describe(),
                              "speedup_vs_colocate": (None if colocate is None
                                                      else round(colocate.seconds / result.best.seconds, 3))})
