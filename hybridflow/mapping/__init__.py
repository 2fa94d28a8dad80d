"""Auto-mapping (HybridFlow §6): a cost model and a search over device placements and parallel layouts.

- ``specs``: devices, clusters, model shapes, the RL workload (presets and HF configs).
- ``dataflow``: which role does what work in which stage, per algorithm.
- ``cost``: the simulators (training/inference compute-bound, generation memory-bound) and memory per layout.
- ``search``: Algorithm 1 (placements x allocations x layouts) with pruning and caching.
- ``plans``: plans, set estimates and search results; placements (set partitions, baselines, packing).
- ``presets``: named cost-parameter sets (``cpu``, ``a100-paper``) with sources and plausible ranges;
  ``sensitivity``: which parameter, within its range, changes a recommended placement.
- ``abilities``: what ``hybridflow train`` can run (per engine); the search leaves the rest out, with the reason.
- ``emit``: a plan as a config snippet for ``hybridflow train``; ``plan_cli``: ``hybridflow plan``.

Pure Python: nothing here imports torch or Ray.
"""

from hybridflow.mapping.cost import CostParams, Layout
from hybridflow.mapping.presets import COST_PRESETS, get_cost_preset
from hybridflow.mapping.search import MappingSearch, Plan, SearchResult, SearchSpace, search
from hybridflow.mapping.specs import (
    ClusterSpec,
    DeviceSpec,
    ModelSpec,
    SpecError,
    Workload,
    get_device,
    get_model,
    parse_cluster,
)

__all__ = [
    "COST_PRESETS", "ClusterSpec", "CostParams", "DeviceSpec", "Layout", "MappingSearch", "ModelSpec", "Plan",
    "SearchResult", "SearchSpace", "SpecError", "Workload", "get_cost_preset", "get_device", "get_model",
    "parse_cluster", "search",
]
