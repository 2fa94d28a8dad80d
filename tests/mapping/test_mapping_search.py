"""The search (HybridFlow Algorithm 1): placements, allocations, layouts, pruning against brute force, and the
paper-scale checks (chosen plan <= colocate / standalone / split; memory holds; 128 GPUs in <= 60 s)."""

import itertools
import json
import time

import pytest

from hybridflow.mapping.cost import CostParams, Layout
from hybridflow.mapping.dataflow import works
from hybridflow.mapping.search import (
    MappingSearch,
    SearchSpace,
    baseline_placements,
    pack_sets,
    search,
    set_partitions,
    set_sizes,
)
from hybridflow.mapping.specs import (
    ALGORITHMS,
    ClusterSpec,
    SpecError,
    Workload,
    get_device,
    get_model,
    parse_cluster,
)

PPO_ROLES = ("actor", "critic", "reference", "reward")
A100 = get_device("A100-80G")


def _models(size, roles=PPO_ROLES):
    return {r: get_model(size) for r in roles}


@pytest.mark.parametrize("n, bell", [(1, 1), (2, 2), (3, 5), (4, 15), (5, 52), (6, 203)])
def test_set_partitions_are_the_bell_number_and_cover_each_item_once(n, bell):
    items = [f"m{i}" for i in range(n)]
    parts = list(set_partitions(items))
    assert len(parts) == len(set(parts)) == bell
    for p in parts:
        assert sorted(r for s in p for r in s) == items


def test_baseline_placements():
    b = baseline_placements(PPO_ROLES)
    assert b["colocate"] == (PPO_ROLES,)
    assert b["standalone"] == tuple((r,) for r in PPO_ROLES)
    assert b["split"] == (("actor", "reference"), ("critic", "reward"))
    assert baseline_placements(("actor", "reference"))["split"] is None


def test_set_sizes_and_packing():
    two = ClusterSpec(2, 8, A100)
    assert set_sizes(two) == [1, 2, 4, 8, 16]
    assert set_sizes(two, unit=4) == [1, 2, 4, 8, 12, 16]
    assert pack_sets([8, 4, 4], two) == [[8], [4], [4]]
    assert pack_sets([12, 4], two) == [[8, 4], [4]]
    assert pack_sets([6, 6, 4], two) is None  # 6 + 6 fill neither node exactly, 4 is left without room
    assert pack_sets([16, 8], two) is None


def test_layouts_respect_node_heads_and_layers():
    s = MappingSearch(_models("13B"), Workload(), parse_cluster("4x8:A100-80G"))
    for n in (4, 8, 16, 32):
        layouts = s.layouts("actor", n)
        assert layouts
        for lay in layouts:
            assert lay.pp * lay.tp * lay.dp == n
            assert 8 % lay.tp == 0 and 40 % lay.tp == 0 and 40 % lay.pp == 0
    # tiny-arith has 4 heads and 4 layers: tp 8 and pp 8 do not divide them
    tiny = MappingSearch(_models("tiny-arith"), Workload(prompt_len=128, response_len=64),
                         parse_cluster("1x8:cpu"))
    assert {(lay.pp, lay.tp) for lay in tiny.layouts("actor", 8)} == {(p, t) for p in (1, 2, 4) for t in (1, 2, 4)
                                                                      if p * t <= 8}
    assert {lay.tp for lay in MappingSearch(_models("13B"), Workload(), parse_cluster("1x8:A100-80G"),
                                            space=SearchSpace(max_tp=1)).layouts("actor", 8)} == {1}


def test_dataflow_works_per_algorithm():
    w = Workload("remax", batch=8, n=2)
    kinds = {(x.role, x.kind, x.sequences, x.greedy) for x in works(w)}
    assert ("actor", "generate", 8, True) in kinds and ("reward", "infer", 16 + 8, False) in kinds
    assert not any(x.role == "critic" for x in works(Workload("grpo")))
    assert {x.role for x in works(Workload("safe-rlhf"))} == set(ALGORITHMS["safe-rlhf"])
    assert not any(x.role == "reward" for x in works(Workload(), {"actor", "critic", "reference"}))


def test_search_matches_brute_force_over_placements_and_allocations():
    cluster = ClusterSpec(2, 8, A100)
    s = MappingSearch(_models("7B"), Workload(), cluster)
    result = s.run(top_k=3)
    sizes = set_sizes(cluster)
    brute = []
    for placement in set_partitions(PPO_ROLES):
        for alloc in itertools.product(sizes, repeat=len(placement)):
            if sum(alloc) == cluster.n_devices and pack_sets(alloc, cluster) is not None:
                plan = s.plan(placement, alloc)
                if plan is not None:
                    brute.append(plan.seconds)
    assert result.best.seconds == pytest.approx(min(brute), rel=1e-12)
    assert [p.seconds for p in result.top] == pytest.approx(sorted(brute)[:3], rel=1e-12)
    split = s.best_for_placement([["critic", "reward"], ["reference", "actor"]])
    assert split.seconds == result.baselines["split"].seconds


@pytest.mark.parametrize("size, n", [("7B", 8), ("13B", 8)])
def test_set_pruning_and_branch_and_bound_match_exhaustive_combination(size, n):
    """The best colocated layouts equal the best over every combination of the roles' layouts (unpruned) and
    every generation layout."""
    s = MappingSearch(_models(size), Workload(batch=256), ClusterSpec(1, 8, A100))
    roles = PPO_ROLES
    best = None
    for combo in itertools.product(*(s.role_candidates(r, n, prune=False) for r in roles)):
        persistent = sum(c.memory.persistent for c in combo)
        if persistent + max(c.memory.transient for c in combo) > s.usable:
            continue
        gen = s._generation(combo[0].layout, n, s.usable - persistent)
        if gen is not None:
            total = sum(c.seconds for c in combo) + gen[0]
            best = total if best is None else min(best, total)
    est = s.set_estimate(roles, n)
    assert best is not None and est is not None
    assert est.seconds == pytest.approx(best, rel=1e-12)


def _check_memory(plan, size, cluster, params):
    """Recompute each set's memory by hand from the chosen layouts: bf16 weights and grads (2 + 2 bytes) and Adam
    (12 bytes) sharded over dp (ZeRO-1) for trained roles, bf16 weights for the others; states + the largest
    transient (activations, or generation's extra weights + KV cache) must fit the usable memory."""
    usable = cluster.device.mem_bytes * params.mem_usable
    for est in plan.sets:
        persistent = 0.0
        for mem in est.memory:
            lay = mem.layout
            model = get_model(size)
            n_params = model.n_params if mem.role in ("actor", "reference") else model.as_value_model().n_params
            shard = n_params / (lay.tp * lay.pp)
            trained = any(ph.role == mem.role and ph.kind == "train" for ph in est.phases)
            expected = shard * (2 + 2 + 12 / lay.dp) if trained else shard * 2
            assert mem.persistent == pytest.approx(expected)
            assert lay.pp * lay.tp * lay.dp == est.devices
            persistent += expected
        assert persistent + max(m.transient for m in est.memory) <= usable
        assert persistent + est.gen_bytes <= usable
        for ph in est.phases:
            assert ph.layout.pp * ph.layout.tp * ph.layout.dp == est.devices


@pytest.mark.parametrize("sequential", [True, False], ids=["sequential-driver", "paper-overlap"])
@pytest.mark.parametrize("size, nodes", [("7B", 2), ("13B", 8), ("70B", 16)])
def test_paper_scale_chosen_plan_beats_baselines_and_fits(size, nodes, sequential):
    cluster = ClusterSpec(nodes, 8, A100)
    params = CostParams(sequential_driver=sequential)
    result = search(_models(size), Workload(), cluster, params)
    best = result.best
    assert best is not None and best.seconds > 0
    for name, plan in result.baselines.items():
        assert plan is not None, name
        assert best.seconds <= plan.seconds + 1e-9, (name, plan.describe())
    for plan in result.top:
        _check_memory(plan, size, cluster, params)
        assert sum(plan.allocation) == cluster.n_devices


@pytest.mark.parametrize("sequential", [True, False], ids=["sequential-driver", "paper-overlap"])
def test_search_for_128_gpus_and_4_models_is_fast(sequential):
    start = time.perf_counter()
    params = CostParams(sequential_driver=sequential)
    result = search(_models("13B"), Workload(), parse_cluster("16x8:A100-80G"), params)
    assert time.perf_counter() - start <= 60
    assert result.placements == 15 and result.allocations > 100


def test_infeasible_cluster_gives_no_plan():
    result = search(_models("70B"), Workload(), parse_cluster("2x8:A100-80G"))
    assert result.best is None and result.top == []
    assert all(p is None for p in result.baselines.values())
    assert len(result.infeasible_placements) == 15
    json.dumps(result.to_dict())


def test_rule_reward_and_other_algorithms():
    models = {"actor": get_model("tiny-arith"), "critic": get_model("tiny-arith"),
              "reference": get_model("tiny-arith"), "reward": None}
    result = search(models, Workload(batch=32, prompt_len=64, response_len=32), parse_cluster("1x4:cpu"))
    assert {r for s in result.best.placement for r in s} == {"actor", "critic", "reference"}
    grpo = search(_models("7B", ALGORITHMS["grpo"]), Workload("grpo", batch=64, n=8), parse_cluster("1x8:H100"))
    assert grpo.best is not None and not any(p.role == "critic" for s in grpo.best.sets for p in s.phases)
    with pytest.raises(SpecError, match="missing"):
        MappingSearch({"actor": get_model("7B")}, Workload(), parse_cluster("1x8:H100"))


def test_plan_of_given_placement_and_validation():
    s = MappingSearch(_models("7B"), Workload(), ClusterSpec(2, 8, A100))
    plan = s.plan([["reward", "critic"], ["reference", "actor"]], [8, 8])
    assert plan is not None and plan.placement == (("critic", "reward"), ("actor", "reference"))
    gen = [p for p in plan.set_of("actor").phases if p.kind == "generate"]
    assert gen and all(isinstance(p.layout, Layout) for p in gen)
    with pytest.raises(SpecError, match="sizes"):
        s.plan([["actor", "reference"], ["critic", "reward"]], [16])
    with pytest.raises(SpecError, match="once"):
        s.plan([["actor"], ["critic", "reward"]], [8, 8])
