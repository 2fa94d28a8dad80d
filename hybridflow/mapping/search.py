"""Auto-mapping: HybridFlow's Algorithm 1 (Sheng et al. 2024, arXiv 2409.19256, §6).

For every placement (a partition of the models into sets; models of one set share devices and take turns), for
every allocation of the cluster's devices to the sets, and for each model its best parallel layouts on its
set's devices (``auto_parallel``), estimate the iteration time (``d_cost``): in each stage, models of one set
add up; the iteration is the sum of its stages. How sets on different devices combine depends on the driver
(``CostParams.sequential_driver``):

- sequential (the default; hybridflow's synchronous drivers call one worker group at a time and wait): sets
  never overlap, a stage takes the sum of its sets' times, and while a set runs only its own ranks are busy;
- overlapping (the paper's model, ``sequential_driver=False``): sets run a stage at the same time, the stage
  takes the slowest set, and every device of a node may be busy at once.

On CPU clusters whose ranks share cores (``ClusterSpec.cores_per_node``) the busy ranks per node set each
rank's share of a core (``hybridflow.mapping.cost.contended``): min(set size, node size) for the sequential
driver, the whole node for the overlapping one. Return the best plan and the runners-up.

Search space and pruning:

- set sizes are divisors of ``unit`` devices (default: one node) or multiples of it, and the sets must pack
  onto the nodes (a set's part below a whole node shares one node with others);
- a layout's tp divides both the set size and the node size (tp stays inside a node), divides the number of
  heads, and pp divides the number of layers; generation layouts reshard from the training layout (their
  tp·pp divides, or is a multiple of, the training tp·pp: the 3D-HybridEngine's micro-dp groups);
- a model's layouts whose states and activations do not fit alone are dropped, and so are layouts that are
  slower *and* need more memory than another (Pareto front on time, persistent and transient bytes; not for
  the actor, whose training layout also decides its generation options);
- colocated models' layouts are chosen together (their states share the devices' memory; the actor's KV cache
  takes what is left), by branch and bound on the set's summed time;
- caching: a role's layouts per set size, and a set's best layouts per (models, size), are computed once and
  shared by every placement and allocation; ``get_min_alloc`` is the smallest size a set fits on.

Choosing each set's layouts by its own summed time (not by the stage maxima across sets) is the paper's
``auto_parallel`` simplification; with memory-coupled colocated models it is a heuristic, not exact.
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from hybridflow.mapping.abilities import UNRESTRICTED, Abilities
from hybridflow.mapping.cost import (
    CostParams,
    GenerateEstimate,
    Layout,
    activation_bytes_infer,
    activation_bytes_train,
    contended,
    gen_extra_weight_bytes,
    generate_kv_bytes_per_sequence,
    generate_time,
    infer_time,
    model_state_bytes,
    reshard_time,
    train_time,
)
from hybridflow.mapping.dataflow import VALUE_ROLES, Work, works
from hybridflow.mapping.plans import (
    PhaseEstimate,
    Placement,
    Plan,
    RoleMemory,
    SearchResult,
    SetEstimate,
    baseline_placements,
    canonical,
    combine_stages,
    pack_sets,
    set_partitions,
    set_sizes,
)
from hybridflow.mapping.expert_parallel import ep_layouts, ep_phase_note
from hybridflow.mapping.sequence_parallel import sp_layouts, sp_note
from hybridflow.mapping.specs import ClusterSpec, ModelSpec, SpecError, Workload, ceil_div, divisors

logger = logging.getLogger(__name__)

__all__ = [
    "MappingSearch", "PhaseEstimate", "Placement", "Plan", "RoleMemory", "SearchResult", "SearchSpace",
    "SetEstimate", "baseline_placements", "pack_sets", "search", "set_partitions", "set_sizes",
]


@dataclass(frozen=True)
class SearchSpace:
    """Limits of the search: the largest tp and pp (default: devices per node, and layers), the set-size ``unit``
    (default: devices per node) and the largest pp of the actor's generation layouts (``max_gen_pp``; default: as
    ``max_pp``; 1: the rollout engine generates with tensor and data parallelism only, as vLLM did in the paper and
    as hybridflow's hf and vllm rollouts do)."""

    max_tp: int | None = None
    max_pp: int | None = None
    unit: int | None = None
    max_gen_pp: int | None = None




# ---------------------------------------------------------------------------------------------- the search


@dataclass(frozen=True)
class _Candidate:
    """One layout of one role on n devices (generation excluded): its phases, time and memory."""

    layout: Layout
    phases: tuple[PhaseEstimate, ...]
    seconds: float
    memory: RoleMemory


class MappingSearch:
    """Holds the specs and the caches of one search (placements, allocations and layouts of one workload).

    Args:
        models: role -> model spec; None for a role without a model (a rule reward, no device work). Every role
            of the workload's algorithm must be present. Value roles (critic, reward, cost, cost_critic) get a
            scalar head.
        workload, cluster, params, space: what to plan for and how.
        abilities: what the training system can run (``hybridflow.mapping.abilities``); layouts and placements
            beyond them are left out of the search and counted with their reason (``excluded``). Default:
            unrestricted (the paper's system); ``hybridflow plan`` passes the registered engine's.

    Raises:
        SpecError: a role of the algorithm is missing from ``models``, there is no actor model, or a sequence
            (prompt + response) is longer than a model's ``max_positions``.
    """

    def __init__(self, models: dict[str, ModelSpec | None], workload: Workload, cluster: ClusterSpec,
                 params: CostParams | None = None, space: SearchSpace | None = None,
                 abilities: Abilities | None = None) -> None:
        missing = [r for r in workload.roles if r not in models]
        if missing:
            raise SpecError(f"algorithm {workload.algorithm} needs models for roles {list(workload.roles)}; "
                            f"missing {missing} (use None for a rule-based reward)")
        if models.get("actor") is None:
            raise SpecError("the actor needs a model")
        tokens = workload.prompt_len + workload.response_len
        short = sorted({f"{r} {m.name} ({m.max_positions})" for r, m in models.items()
                        if m is not None and m.max_positions is not None and m.max_positions < tokens})
        if short:
            raise SpecError(f"prompt + response = {tokens} tokens exceed the positions of {', '.join(short)}; "
                            "use --prompt-len / --response-len that fit")
        self.models = {r: (m.as_value_model() if r in VALUE_ROLES else m)
                       for r, m in models.items() if m is not None and r in workload.roles}
        self.roles = tuple(r for r in workload.roles if r in self.models)
        self.workload, self.cluster = workload, cluster
        self.params, self.space = params or CostParams(), space or SearchSpace()
        self.abilities = abilities or UNRESTRICTED
        self.excluded: dict[str, dict] = {}  # reason -> {"what", "count", "examples"}
        self.usable = cluster.device.mem_bytes * self.params.mem_usable
        self.works = works(workload, set(self.models))
        self.sizes = set_sizes(cluster, self.space.unit)
        self._gen_works = [w for w in self.works if w.role == "actor" and w.kind == "generate"]
        self._candidates: dict[tuple[str, int], list[_Candidate]] = {}
        self._sets: dict[tuple[tuple[str, ...], int], SetEstimate | None] = {}
        self._layouts: dict[tuple[str, int], list[Layout]] = {}
        self._gen_opts: dict[tuple[Layout, int], list[tuple[float, Layout, float, float]]] = {}
        self._gen_cache: dict[tuple[Layout, Work, int], GenerateEstimate] = {}
        self._kv_seq: dict[Layout, float] = {}
        self._contended: dict[int, tuple[ClusterSpec, CostParams]] = {}

    def busy_ranks(self, n: int) -> int:
        """Busy ranks per node while a set of ``n`` devices runs: its own ranks on a node (min(n, node size)) with
        the sequential driver; every device of the node when sets may run at the same time."""
        dpn = self.cluster.devices_per_node
        return min(n, dpn) if self.params.sequential_driver else dpn

    def contended(self, n: int) -> tuple[ClusterSpec, CostParams]:
        """The cluster and cost parameters as a set of ``n`` devices sees them (``cost.contended``; cached)."""
        if n not in self._contended:
            self._contended[n] = contended(self.cluster, self.params, self.busy_ranks(n))
        return self._contended[n]

    # ------------------------------------------------------------------ layouts (auto_parallel)

    def layouts(self, role: str, n: int) -> list[Layout]:
        """Valid (pp, tp, dp) of ``role`` on ``n`` devices (see the module docstring; cached)."""
        if (role, n) in self._layouts:
            return self._layouts[(role, n)]
        model, dpn = self.models[role], self.cluster.devices_per_node
        tp_cap = min(self.space.max_tp or dpn, math.gcd(n, dpn))
        pp_cap = self.space.max_pp or model.layers
        out = []
        for tp in divisors(n):
            if tp > tp_cap or math.gcd(n, dpn) % tp or model.heads % tp:
                continue
            for pp in divisors(n // tp):
                if pp <= pp_cap and model.layers % pp == 0:
                    out.append(Layout(pp, tp, n // (tp * pp)))
        kept = self._able(role, out, generate=False)
        self._layouts[(role, n)] = (kept + sp_layouts(role, model, kept, self.abilities)  # long sequences: sp > 1
                                    + ep_layouts(role, model, kept, self.abilities))  # MoE: experts over ep ranks
        if role == "actor":
            self._layouts[("actor:generate", n)] = self._able(role, out, generate=True)
        return self._layouts[(role, n)]

    def _able(self, role: str, layouts: list[Layout], generate: bool) -> list[Layout]:
        """``layouts`` the abilities allow for ``role`` (its generation with ``generate``); the others are counted
        in ``excluded`` under their reason."""
        kept = []
        for lay in layouts:
            reason = self.abilities.layout_reason(role, lay, generate)
            if reason is None:
                kept.append(lay)
            else:
                phase = "generate" if generate else "train/infer"
                self._exclude(reason, "layout", {"role": role, "phase": phase, "layout": lay.as_list()})
        return kept

    def _exclude(self, reason: str, what: str, example: dict) -> None:
        entry = self.excluded.setdefault(reason, {"what": what, "count": 0, "examples": []})
        entry["count"] += 1
        if len(entry["examples"]) < 3:
            entry["examples"].append(example)

    def _role_works(self, role: str) -> list[Work]:
        return [w for w in self.works if w.role == role]

    def role_candidates(self, role: str, n: int, prune: bool = True) -> list[_Candidate]:
        """Layouts of ``role`` on ``n`` devices that fit alone, fastest first (cached). With ``prune``, a layout
        that another beats or ties on time, persistent and transient bytes is dropped, except for the actor
        when it generates (its layout also decides which generation layouts it can reshard to, and how)."""
        key = (role, n)
        if prune and key in self._candidates:
            return self._candidates[key]
        model, dev, wl = self.models[role], self.cluster.device, self.workload
        cluster, p = self.contended(n)
        role_works = [w for w in self._role_works(role) if w.kind != "generate"]
        trained = any(w.kind == "train" for w in role_works)
        out = []
        for layout in self.layouts(role, n):
            states = model_state_bytes(model, layout, trained, dev.dtype_bytes, p)
            phases, transient = [], 0.0
            for w in role_works:
                if w.kind == "train":
                    t = train_time(model, layout, w.sequences, wl.seq_len, cluster, p, epochs=wl.ppo_epochs,
                                   updates=wl.ppo_updates, micro_batch=wl.micro_batch)
                    micro_per_step = max(1, ceil_div(ceil_div(w.sequences, layout.dp),
                                                     wl.ppo_updates * wl.micro_batch))
                    act, act1 = (activation_bytes_train(model, lay, wl.micro_batch, wl.seq_len, dev.dtype_bytes, p,
                                                        micro_per_step) for lay in (layout, replace(layout, sp=1)))
                else:
                    t = infer_time(model, layout, w.sequences, wl.seq_len, cluster, p,
                                   micro_batch=wl.infer_micro_batch)
                    act, act1 = (activation_bytes_infer(model, lay, wl.infer_micro_batch, wl.seq_len, dev.dtype_bytes)
                                 for lay in (layout, replace(layout, sp=1)))
                tokens = (wl.micro_batch if w.kind == "train" else wl.infer_micro_batch) * wl.seq_len
                note = "" if layout.sp == 1 else sp_note(role, w.kind, layout, tokens, act1, act,
                                                         sum(states.values()), self.usable)
                note = note or ep_phase_note(role, w.kind, model, layout, w.sequences, wl, cluster, p, trained,
                                             self.usable)  # MoE: why ep > 1
                phases.append(PhaseEstimate(role, w.kind, w.stage, layout, t, w.sequences, note=note))
                transient = max(transient, act)
            memory = RoleMemory(role, layout, states["weights"], states["grads"], states["optimizer"], transient)
            if memory.persistent + transient <= self.usable:
                out.append(_Candidate(layout, tuple(phases), sum(ph.seconds for ph in phases), memory))
        out.sort(key=lambda c: (c.seconds, c.memory.persistent, c.memory.transient))
        if not prune:
            return out
        if not (role == "actor" and self._gen_works):
            out = _pareto(out)
        self._candidates[key] = out
        return out

    def _gen_options(self, train: Layout, n: int) -> list[tuple[float, Layout, float, float]]:
        """Generation layouts the actor trained on ``train`` can reshard to (cached): (lower bound seconds with
        the whole usable memory, layout, extra weight bytes, reshard seconds), fastest bound first."""
        key = (train, n)
        if key not in self._gen_opts:
            model, dev = self.models["actor"], self.cluster.device
            shards, out = train.tp * train.pp, []
            self.layouts("actor", n)
            for g in self._layouts[("actor:generate", n)]:
                if self.space.max_gen_pp is not None and g.pp > self.space.max_gen_pp:
                    continue
                gs = g.tp * g.pp
                if shards % gs and gs % shards:
                    continue
                extra = gen_extra_weight_bytes(model, train, g, dev.dtype_bytes, self.params.zero_stage)
                reshard = reshard_time(model, train, g, *self.contended(n))
                bound = self._gen_phases(g, self.usable - extra)
                if bound is not None:
                    out.append((sum(ph.seconds for ph in bound[0]) + reshard, g, extra, reshard))
            self._gen_opts[key] = sorted(out, key=lambda o: o[0])
        return self._gen_opts[key]

    def _gen_phases(self, g: Layout, budget: float) -> tuple[list[PhaseEstimate], float] | None:
        """The actor's generation works on layout ``g`` with ``budget`` KV-cache bytes per device: their phases
        and the KV bytes they fill, or None if a sequence does not fit. Cached per (layout, work, waves): the
        time depends on the budget only through the number of waves."""
        wl, out, kv_used = self.workload, [], 0.0
        kv_seq = self._kv_seq.get(g)
        if kv_seq is None:
            kv_seq = self._kv_seq[g] = generate_kv_bytes_per_sequence(self.models["actor"], g, wl, self.cluster)
        capacity = int(budget // kv_seq) if budget > 0 else 0
        if capacity < 1:
            return None
        for w in self._gen_works:
            waves = ceil_div(ceil_div(w.sequences, g.dp), capacity)
            key = (g, w, waves)
            est = self._gen_cache.get(key)
            if est is None:
                cluster, params = self.contended(g.size)
                est = generate_time(self.models["actor"], g, w.sequences, wl.prompt_len, wl.response_len,
                                    kv_seq * ceil_div(ceil_div(w.sequences, g.dp), waves), cluster, params)
                self._gen_cache[key] = est
            out.append(PhaseEstimate("actor", "generate", w.stage, g, est.seconds, w.sequences, est.waves, est.batch,
                                     w.greedy))
            kv_used = max(kv_used, est.kv_bytes)
        return out, kv_used

    def _generation(self, train: Layout, n: int, free: float,
                    bound: float = math.inf) -> tuple[float, tuple[PhaseEstimate, ...], float] | None:
        """Best generation of the actor trained on ``train`` with ``free`` bytes per device left by the set's
        persistent states: (seconds incl. the reshard, phases, bytes used per device), or None if nothing fits
        or nothing beats ``bound``."""
        if not self._gen_works:
            return 0.0, (), 0.0
        best = None
        for lower, g, extra, reshard in self._gen_options(train, n):
            if lower >= min(bound, best[0] if best else math.inf):
                break
            found = self._gen_phases(g, free - extra)
            if found is None:
                continue
            phases, kv_used = found
            if reshard > 0:
                phases = [PhaseEstimate("actor", "reshard", "generate", g, reshard)] + phases
            total = sum(ph.seconds for ph in phases)
            if best is None or total < best[0]:
                best = (total, tuple(phases), extra + kv_used)
        return best

    # ------------------------------------------------------------------ sets (memory-coupled layouts)

    def set_estimate(self, roles: tuple[str, ...], n: int) -> SetEstimate | None:
        """Best layouts of the colocated ``roles`` on ``n`` devices (cached); None if they cannot fit."""
        key = (roles, n)
        if key in self._sets:
            return self._sets[key]
        tied = self._reference_tied(roles)
        lists = [self.role_candidates(r, n, prune=not (tied and r == "reference")) for r in roles]
        result = None
        if all(lists):
            result = self._best_combination(roles, n, lists)
        self._sets[key] = result
        return result

    def _best_combination(self, roles: tuple[str, ...], n: int, lists: list[list[_Candidate]]) -> SetEstimate | None:
        """Branch and bound over the roles' candidates (the actor first), minimising the set's summed time under
        the memory limit; the actor's generation gets the memory the chosen states leave."""
        has_gen = "actor" in roles and bool(self._gen_works)
        tied = self._reference_tied(roles)
        first = has_gen or tied
        order = sorted(range(len(roles)), key=lambda i: roles[i] != "actor") if first else list(range(len(roles)))
        ordered = [lists[i] for i in order]
        ref_at = [roles[i] for i in order].index("reference") if tied else -1
        ref_by_layout = {c.layout: c for c in ordered[ref_at]} if tied else {}
        rest_lb = [sum(lst[0].seconds for lst in ordered[i:]) for i in range(len(ordered))] + [0.0]
        rest_mem = [sum(min(c.memory.persistent for c in lst) for lst in ordered[i:]) for i in range(len(ordered))]
        rest_mem.append(0.0)
        best: list = [math.inf, None]

        def dfs(i: int, chosen: list[_Candidate], persistent: float, transient: float, seconds: float,
                gen_lb: float) -> None:
            if i == len(ordered):
                gen = (0.0, (), 0.0)
                if has_gen:
                    gen = self._generation(chosen[0].layout, n, self.usable - persistent, best[0] - seconds)
                    if gen is None:
                        return
                if seconds + gen[0] < best[0]:
                    best[0], best[1] = seconds + gen[0], (tuple(chosen), gen)
                return
            options = ordered[i]
            if i == ref_at:  # in the actor's process, on the actor's training layout
                options = [ref_by_layout[chosen[0].layout]] if chosen[0].layout in ref_by_layout else []
            for c in options:  # fastest first
                lb = gen_lb
                if has_gen and i == 0:  # the actor: its generation with all the memory left by the others
                    found = self._generation(c.layout, n, self.usable - c.memory.persistent - rest_mem[1])
                    if found is None:
                        continue
                    lb = found[0]
                if seconds + c.seconds + rest_lb[i + 1] + lb >= best[0]:
                    if has_gen and i == 0:
                        continue
                    break  # later candidates are no faster
                p = persistent + c.memory.persistent
                t = max(transient, c.memory.transient)
                if p + t + rest_mem[i + 1] > self.usable:
                    continue
                chosen.append(c)
                dfs(i + 1, chosen, p, t, seconds + c.seconds, lb)
                chosen.pop()

        dfs(0, [], 0.0, 0.0, 0.0, 0.0)
        if best[1] is None:
            return None
        chosen, (_, gen_phases, gen_bytes) = best[1]
        by_role = {c.memory.role: c for c in chosen}
        picked = [by_role[r] for r in roles]
        phases = tuple(gen_phases) + tuple(ph for c in picked for ph in c.phases)
        return SetEstimate(roles, n, phases, tuple(c.memory for c in picked), gen_bytes, self.usable)

    def _reference_tied(self, roles: tuple[str, ...]) -> bool:
        """The reference of ``roles`` must run on the actor's training layout (``Abilities.reference_with_actor``)."""
        return self.abilities.reference_with_actor and "reference" in roles and "actor" in roles

    def placement_reason(self, placement: Sequence[Sequence[str]]) -> str | None:
        """Why the abilities rule ``placement`` out (counted in ``excluded``), or None."""
        reason = self.abilities.placement_reason(placement)
        if reason is not None:
            self._exclude(reason, "placement", {"placement": [list(s) for s in placement]})
        return reason

    def min_alloc(self, roles: tuple[str, ...]) -> int | None:
        """``get_min_alloc``: the smallest allowed size on which ``roles`` fit together, or None."""
        return next((n for n in self.sizes if self.set_estimate(roles, n) is not None), None)

    # ------------------------------------------------------------------ allocations and d_cost

    def allocations(self, placement: Placement) -> Iterator[tuple[int, ...]]:
        """``enum_alloc``: sizes per set that sum to the cluster, fit each set, and pack onto the nodes (none for
        a placement the abilities rule out)."""
        if self.abilities.placement_reason(placement) is not None:
            return
        mins = [self.min_alloc(s) for s in placement]
        if any(m is None for m in mins):
            return
        total = self.cluster.n_devices
        tail_min = [sum(mins[i:]) for i in range(len(mins))] + [0]

        def rec(i: int, left: int, chosen: list[int]) -> Iterator[tuple[int, ...]]:
            if i == len(placement):
                if left == 0 and pack_sets(chosen, self.cluster) is not None:
                    yield tuple(chosen)
                return
            options = [left] if i == len(placement) - 1 else self.sizes
            for n in options:
                if n < mins[i] or n > left - tail_min[i + 1]:
                    continue
                if n not in self.sizes or self.set_estimate(placement[i], n) is None:
                    continue
                chosen.append(n)
                yield from rec(i + 1, left - n, chosen)
                chosen.pop()

        yield from rec(0, total, [])

    def plan(self, placement: Sequence[Sequence[str]], allocation: Sequence[int]) -> Plan | None:
        """The plan of a given placement and allocation with each set's best layouts (None if a set does not
        fit). ``placement`` may list its sets and roles in any order."""
        if len(placement) != len(allocation):
            raise SpecError(f"placement has {len(placement)} sets but allocation {list(allocation)} has "
                            f"{len(allocation)} sizes")
        roles = sorted(r for s in placement for r in s)
        if roles != sorted(self.roles):
            raise SpecError(f"placement {[list(s) for s in placement]} must hold each of {list(self.roles)} once")
        if self.abilities.placement_reason(placement) is not None:
            return None
        order = {r: i for i, r in enumerate(self.roles)}
        sets = []
        for s, n in zip(placement, allocation):
            est = self.set_estimate(tuple(sorted(s, key=order.__getitem__)), n)
            if est is None:
                return None
            sets.append(est)
        return Plan(tuple(sets), self.params.sequential_driver, self.params.stage_overhead_s)

    def best_for_placement(self, placement: Sequence[Sequence[str]]) -> Plan | None:
        """The best allocation and layouts of one placement (None if it fits in no allocation)."""
        placement = canonical(placement, self.roles)
        best = None
        for alloc in self.allocations(placement):
            plan = self.plan(placement, alloc)
            if plan is not None and (best is None or plan.seconds < best.seconds):
                best = plan
        return best

    def run(self, top_k: int = 5) -> SearchResult:
        """Algorithm 1 over every placement; the best plan, the ``top_k`` best, and the baselines."""
        start = time.perf_counter()
        heap: list[tuple[float, int, Placement, tuple[int, ...]]] = []  # max-heap of the top_k (negated)
        by_placement: dict[Placement, tuple[float, tuple[int, ...]]] = {}
        n_placements = n_allocs = 0
        infeasible = []
        for placement in set_partitions(self.roles):
            n_placements += 1
            if self.placement_reason(placement) is not None:
                continue
            for alloc in self.allocations(placement):
                n_allocs += 1
                sets = [self._sets[(s, n)] for s, n in zip(placement, alloc)]  # cached by allocations()
                total = sum(combine_stages([s.stage_vector for s in sets], self.params.sequential_driver,
                                           self.params.stage_overhead_s))
                if placement not in by_placement or total < by_placement[placement][0]:
                    by_placement[placement] = (total, alloc)
                item = (-total, -n_allocs, placement, alloc)
                if len(heap) < top_k:
                    heapq.heappush(heap, item)
                elif item > heap[0]:
                    heapq.heapreplace(heap, item)
            if placement not in by_placement:
                infeasible.append(placement)
        top = [self.plan(p, a) for _, _, p, a in sorted(heap, reverse=True)]
        plans = {p: self.plan(p, a) for p, (_, a) in by_placement.items()}
        baselines = {name: (plans.get(p) if p is not None else None)
                     for name, p in baseline_placements(self.roles).items()}
        elapsed = time.perf_counter() - start
        logger.info("searched %d placements, %d allocations, %d set evaluations in %.2f s", n_placements, n_allocs,
                    len(self._sets), elapsed)
        excluded = [{"reason": k, **v} for k, v in self.excluded.items()]
        return SearchResult(top[0] if top else None, top, plans, baselines, elapsed, n_placements, n_allocs,
                            len(self._sets), infeasible, excluded)


def _pareto(cands: list[_Candidate]) -> list[_Candidate]:
    """Drop candidates another one beats or ties on time, persistent and transient bytes (``cands`` sorted
    fastest first)."""
    kept: list[_Candidate] = []
    for c in cands:
        if not any(k.memory.persistent <= c.memory.persistent and k.memory.transient <= c.memory.transient
                   for k in kept):
            kept.append(c)
    return kept


def search(models: dict[str, ModelSpec | None], workload: Workload, cluster: ClusterSpec,
           params: CostParams | None = None, space: SearchSpace | None = None, top_k: int = 5,
           abilities: Abilities | None = None) -> SearchResult:
    """Run Algorithm 1 (see ``MappingSearch``): the best plan, the ``top_k`` best and the baselines."""
    return MappingSearch(models, workload, cluster, params, space, abilities).run(top_k)
