"""What a search returns and the placements it walks (HybridFlow §6, Algorithm 1): per-phase and per-set
estimates, plans (a placement, its allocation and layouts) and the search result; set partitions, the baseline
placements, allowed set sizes and the packing of sets onto nodes. ``hybridflow.mapping.search`` builds them.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from hybridflow.mapping.cost import Layout
from hybridflow.mapping.dataflow import STAGES
from hybridflow.mapping.specs import ClusterSpec, SpecError, divisors

__all__ = [
    "GB", "PhaseEstimate", "Placement", "Plan", "RoleMemory", "SearchResult", "SetEstimate", "baseline_placements",
    "canonical", "combine_stages", "pack_sets", "set_partitions", "set_sizes",
]

Placement = tuple[tuple[str, ...], ...]
GB = 1e9

@dataclass(frozen=True)
class PhaseEstimate:
    """One work of a role in a plan: ``kind`` (generate | infer | train | reshard) in ``stage`` on ``layout``;
    for generation, the decode ``waves`` and concurrent ``batch`` per replica."""

    role: str
    kind: str
    stage: str
    layout: Layout
    seconds: float
    sequences: int = 0
    waves: int = 0
    batch: int = 0
    greedy: bool = False
    note: str = ""  # why the layout is what it is, where the plan explains it (a chosen sp > 1)

    def to_dict(self) -> dict:
        out = {"role": self.role, "kind": self.kind, "stage": self.stage, "layout": self.layout.as_list(),
               "seconds": round(self.seconds, 4), "sequences": self.sequences}
        if self.layout.sp > 1:
            out.update(sp=self.layout.sp, note=self.note)
        if self.kind == "generate":
            out.update(waves=self.waves, batch_per_replica=self.batch, greedy=self.greedy)
        return out


@dataclass(frozen=True)
class RoleMemory:
    """Bytes per device of one role: persistent states, and the peak transient of its forward/training
    phases (generation is accounted on the set: ``SetEstimate.gen_bytes``)."""

    role: str
    layout: Layout
    weights: float
    grads: float
    optimizer: float
    transient: float

    @property
    def persistent(self) -> float:
        return self.weights + self.grads + self.optimizer


@dataclass(frozen=True)
class SetEstimate:
    """A set of colocated models on ``devices`` devices with their chosen layouts, phase times and memory."""

    roles: tuple[str, ...]
    devices: int
    phases: tuple[PhaseEstimate, ...]
    memory: tuple[RoleMemory, ...]
    gen_bytes: float  # generation's extra weight shard + the KV cache it fills, per device (0 without the actor)
    usable_bytes: float

    @property
    def persistent(self) -> float:
        return sum(m.persistent for m in self.memory)

    @property
    def peak_bytes(self) -> float:
        """Persistent states of every model + the largest transient of any phase, per device."""
        return self.persistent + max([m.transient for m in self.memory] + [self.gen_bytes])

    @functools.cached_property
    def stage_vector(self) -> tuple[float, ...]:
        """Seconds of this set in each of ``STAGES`` (its models take turns, so their times add)."""
        return tuple(sum(p.seconds for p in self.phases if p.stage == stage) for stage in STAGES)

    def stage_seconds(self, stage: str) -> float:
        return self.stage_vector[STAGES.index(stage)]

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases)

    def to_dict(self) -> dict:
        return {
            "roles": list(self.roles), "devices": self.devices,
            "stages": {s: round(self.stage_seconds(s), 4) for s in STAGES},
            "phases": [p.to_dict() for p in self.phases],
            "memory_gb": {"usable": round(self.usable_bytes / GB, 3), "peak": round(self.peak_bytes / GB, 3),
                          "generation": round(self.gen_bytes / GB, 3),
                          "roles": {m.role: {"layout": m.layout.as_list(), "weights": round(m.weights / GB, 3),
                                             "grads": round(m.grads / GB, 3),
                                             "optimizer": round(m.optimizer / GB, 3),
                                             "transient": round(m.transient / GB, 3)} for m in self.memory}},
        }


@dataclass(frozen=True)
class Plan:
    """A placement with its allocation and layouts; ``seconds`` is the estimated iteration time (d_cost).
    ``sequential_driver``: sets take turns (True) or run a stage at the same time (False; see the module
    docstring); ``stage_overhead_s``: fixed seconds added to every stage (``CostParams.stage_overhead_s``)."""

    sets: tuple[SetEstimate, ...]
    sequential_driver: bool = True
    stage_overhead_s: float = 0.0

    @property
    def placement(self) -> Placement:
        return tuple(s.roles for s in self.sets)

    @property
    def allocation(self) -> tuple[int, ...]:
        return tuple(s.devices for s in self.sets)

    @property
    def stage_seconds(self) -> dict[str, float]:
        """Per stage, the sum over sets (sequential driver) or the slowest set (sets run at the same time), plus
        the fixed ``stage_overhead_s``."""
        return dict(zip(STAGES, combine_stages([s.stage_vector for s in self.sets], self.sequential_driver,
                                               self.stage_overhead_s)))

    @property
    def seconds(self) -> float:
        return sum(self.stage_seconds.values())

    def set_of(self, role: str) -> SetEstimate:
        """The set holding ``role`` (KeyError if none)."""
        for s in self.sets:
            if role in s.roles:
                return s
        raise KeyError(f"role {role!r} is not in this plan (roles: {[r for s in self.sets for r in s.roles]})")

    def describe(self) -> str:
        return " | ".join(f"{'+'.join(s.roles)} ({s.devices})" for s in self.sets)

    def to_dict(self) -> dict:
        return {"seconds": round(self.seconds, 4), "stages": {k: round(v, 4) for k, v in self.stage_seconds.items()},
                "placement": [list(r) for r in self.placement], "allocation": list(self.allocation),
                "sets": [s.to_dict() for s in self.sets]}


@dataclass
class SearchResult:
    """Best plan, the ``top`` plans (best first), each placement's best plan, the baselines (colocate,
    standalone, split; None when infeasible) and search statistics."""

    best: Plan | None
    top: list[Plan]
    by_placement: dict[Placement, Plan]
    baselines: dict[str, Plan | None]
    seconds: float
    placements: int
    allocations: int
    set_evaluations: int = 0
    infeasible_placements: list[Placement] = field(default_factory=list)
    excluded: list[dict] = field(default_factory=list)  # what the abilities ruled out: reason, what, count, examples

    def to_dict(self) -> dict:
        return {
            "best": self.best.to_dict() if self.best else None,
            "top": [{"seconds": round(p.seconds, 4), "plan": p.describe(), "allocation": list(p.allocation),
                     "placement": [list(r) for r in p.placement]} for p in self.top],
            "baselines": {k: (None if p is None else {"seconds": round(p.seconds, 4), "plan": p.describe()})
                          for k, p in self.baselines.items()},
            "search": {"seconds": round(self.seconds, 3), "placements": self.placements,
                       "allocations": self.allocations, "set_evaluations": self.set_evaluations,
                       "infeasible_placements": [[list(r) for r in p] for p in self.infeasible_placements],
                       "excluded": self.excluded},
        }


def combine_stages(vectors: Sequence[Sequence[float]], sequential: bool, stage_overhead_s: float = 0.0) -> list[float]:
    """Seconds of each stage of a plan from its sets' per-stage seconds ``vectors`` (one per set, in ``STAGES``
    order): the sum over sets when one worker group runs at a time (``sequential``), else the slowest set
    (HybridFlow §6: models on different devices run a stage at the same time); plus ``stage_overhead_s``."""
    combine = sum if sequential else max
    return [combine(column) + stage_overhead_s for column in zip(*vectors)]


# ---------------------------------------------------------------------------------------------- placements


def set_partitions(items: Sequence[str]) -> Iterator[Placement]:
    """Every partition of ``items`` into non-empty sets (Bell(len) of them), from all-in-one to all-apart;
    sets keep the order of ``items`` and are ordered by their first item."""
    items = list(items)

    def rec(i: int, blocks: list[list[str]]) -> Iterator[Placement]:
        if i == len(items):
            yield tuple(tuple(b) for b in blocks)
            return
        for b in blocks:
            b.append(items[i])
            yield from rec(i + 1, blocks)
            b.pop()
        blocks.append([items[i]])
        yield from rec(i + 1, blocks)
        blocks.pop()

    yield from rec(0, [])


def canonical(placement: Sequence[Sequence[str]], roles: Sequence[str]) -> Placement:
    """``placement`` in ``set_partitions`` order (roles in ``roles`` order, sets by their first role)."""
    order = {r: i for i, r in enumerate(roles)}
    sets = [tuple(sorted(s, key=order.__getitem__)) for s in placement]
    return tuple(sorted(sets, key=lambda s: order[s[0]]))


def baseline_placements(roles: Sequence[str]) -> dict[str, Placement | None]:
    """The placements the paper compares against: ``colocate`` (all models on all devices), ``standalone``
    (every model on its own devices) and ``split`` (actor + reference | the others; None with no others)."""
    roles = list(roles)
    first = [r for r in roles if r in ("actor", "reference")]
    rest = [r for r in roles if r not in first]
    return {"colocate": (tuple(roles),), "standalone": tuple((r,) for r in roles),
            "split": canonical([first, rest], roles) if first and rest else None}


def set_sizes(cluster: ClusterSpec, unit: int | None = None) -> list[int]:
    """Allowed set sizes: divisors of ``unit`` (default devices per node) and its multiples, up to the cluster."""
    unit = unit or cluster.devices_per_node
    if unit < 1:
        raise SpecError(f"set-size unit must be >= 1, got {unit}")
    sizes = set(divisors(unit)) | set(range(unit, cluster.n_devices + 1, unit))
    return sorted(s for s in sizes if s <= cluster.n_devices)


def pack_sets(sizes: Sequence[int], cluster: ClusterSpec) -> list[list[int]] | None:
    """Devices per node of each set (the ``resource_pool.pools`` lists), or None if they do not fit.

    Whole nodes first; the part of each set below a node is packed first-fit-decreasing onto the remaining
    nodes (so a set never straddles more partial nodes than needed).
    """
    dpn = cluster.devices_per_node
    whole = sum(s // dpn for s in sizes)
    if whole > cluster.nodes:
        return None
    free = [dpn] * (cluster.nodes - whole)
    pools = [[dpn] * (s // dpn) for s in sizes]
    for i in sorted(range(len(sizes)), key=lambda i: -(sizes[i] % dpn)):
        rem = sizes[i] % dpn
        if not rem:
            continue
        slot = next((j for j, f in enumerate(free) if f >= rem), None)
        if slot is None:
            return None
        free[slot] -= rem
        pools[i].append(rem)
    return pools
