"""The cost terms added for the paper-scale placements (issue 22) against hand-computed values, the presets, the
sensitivity report and the two trend checks of benchmarks/automap_paper_scale.py.

Hand values: Llama-2-7B has 32 layers; A100-80G: 312 TFLOP/s, 2.0 TB/s.
"""

import dataclasses

import pytest

from hybridflow.mapping.cost import (
    CostParams,
    Layout,
    generate_time,
    infer_time,
    layer_fixed_time,
    layer_passes,
    train_time,
)
from hybridflow.mapping.plans import combine_stages
from hybridflow.mapping.presets import COST_PRESETS, KNOBS, Knob, get_cost_preset
from hybridflow.mapping.search import MappingSearch, SearchSpace
from hybridflow.mapping.sensitivity import placement_kind, sensitivity, vary
from hybridflow.mapping.specs import ClusterSpec, SpecError, Workload, get_device, get_model

A100 = get_device("A100-80G")
NODE = ClusterSpec(1, 8, A100)
M7 = get_model("7B")
ROLES = ("actor", "critic", "reference", "reward")
L = 1e-4  # a layer overhead that is easy to multiply


def test_layer_passes_and_fixed_time():
    assert (layer_passes("infer", True), layer_passes("train", False), layer_passes("train", True)) == (1, 3, 4)
    with pytest.raises(SpecError, match="kind"):
        layer_passes("generate", False)
    # 10 micro-batches x 4 passes x 32/4 layers x 50 us
    assert layer_fixed_time(M7, Layout(4, 1, 1), 10, 4, CostParams(layer_overhead_s=5e-5)) == pytest.approx(0.016)


def test_train_time_pays_the_layer_overhead_per_micro_batch_stretched_by_the_bubble():
    # pp2 dp2: 64 sequences -> 32 per rank, 2 updates of 16 micro-batches of 1; 32 micro-batches in all, 16 layers
    # per stage, 4 passes (recompute); 1F1B bubble (16 + 1) / 16
    base = CostParams(recompute=True)
    args = (M7, Layout(2, 1, 2), 64, 2048, NODE)
    delta = (train_time(*args, dataclasses.replace(base, layer_overhead_s=L), updates=2)
             - train_time(*args, base, updates=2))
    assert delta == pytest.approx(17 / 16 * 32 * 16 * 4 * L)


def test_train_efficiency_falls_as_the_per_device_micro_batch_shrinks():
    """Same sequences and devices: halving the micro-batch doubles the fixed part; at 1-token micro-batches the
    fixed part is most of the time (compute per micro-batch 6.74e9 x 8 FLOP / (312e12 x 0.45) = 0.38 ms vs 32 x 4 x
    50 us = 6.4 ms)."""
    params = CostParams(layer_overhead_s=5e-5, recompute=True)
    t = {mb: train_time(M7, Layout(1, 1, 1), 8, 1, NODE, params, micro_batch=mb) for mb in (1, 8)}
    compute = 8 * M7.n_params * 8 / (312e12 * 0.45)
    assert t[8] == pytest.approx(compute + 1 * 32 * 4 * 5e-5)
    assert t[1] == pytest.approx(compute + 8 * 32 * 4 * 5e-5)


def test_infer_time_pays_the_layer_overhead_once_per_layer_and_micro_batch():
    # dp4: 16 sequences per rank in micro-batches of 2 -> 8 micro-batches x 32 layers x 1 pass
    args = (M7, Layout(1, 1, 4), 64, 2048, NODE)
    delta = infer_time(*args, CostParams(layer_overhead_s=L), micro_batch=2) - infer_time(*args, CostParams(),
                                                                                          micro_batch=2)
    assert delta == pytest.approx(8 * 32 * L)


def test_generate_time_pays_layer_and_step_overheads():
    # one replica, 4 sequences in one wave: a prefill (32 layers) and 16 decode steps of 32 layers each, plus a
    # decode-step overhead per step
    args = (M7, Layout(1, 1, 1), 4, 8, 16, 60e9, NODE)
    base = generate_time(*args, CostParams())
    with_layers = generate_time(*args, CostParams(layer_overhead_s=L))
    with_steps = generate_time(*args, CostParams(decode_step_overhead_s=2e-3))
    assert base.waves == with_layers.waves == 1
    assert with_layers.seconds - base.seconds == pytest.approx((32 + 16 * 32) * L)
    assert with_steps.seconds - base.seconds == pytest.approx(16 * 2e-3)


def test_generation_per_sequence_cost_falls_with_the_batch_per_replica():
    """Memory-bound decode (7B on one A100, 1024 + 1024 tokens): each step reads the 13,476,831,232 weight bytes
    once for the whole batch, plus 524,288 KV bytes per token x 1536 tokens (mean length) per sequence, at
    2.0 TB/s x 0.7; the prompt pass is 2N x 1024 FLOP per sequence at 312 TFLOP/s x 0.5."""
    weights, kv_seq, bw, flops = 13_476_831_232, 524_288 * 1536, 2.0e12 * 0.7, 312e12 * 0.5
    n = 6_738_415_616
    expected = {b: 2 * n * 1024 * b / flops + 1024 * (weights + b * kv_seq) / bw for b in (1, 8)}
    got = {b: generate_time(M7, Layout(1, 1, 1), b, 1024, 1024, 60e9, NODE, CostParams()) for b in (1, 8)}
    assert got[1].seconds == pytest.approx(expected[1]) and got[8].seconds == pytest.approx(expected[8])
    assert got[8].waves == 1 and got[8].seconds / 8 < got[1].seconds / 5  # 1.9 s vs 10.5 s per sequence


def test_combine_stages_sum_or_slowest_plus_stage_overhead():
    vectors = [[1.0, 2.0, 3.0], [4.0, 1.0, 1.0]]
    assert combine_stages(vectors, True) == [5.0, 3.0, 4.0]
    assert combine_stages(vectors, False) == [4.0, 2.0, 3.0]
    assert combine_stages(vectors, False, 0.5) == [4.5, 2.5, 3.5]


def test_stage_overhead_adds_three_stages_to_every_plan_and_the_search_agrees():
    wl = Workload(batch=64, prompt_len=128, response_len=128)
    models = {r: M7 for r in ROLES}
    base = MappingSearch(models, wl, NODE, CostParams()).plan([ROLES], [8])
    more = MappingSearch(models, wl, NODE, CostParams(stage_overhead_s=0.5)).plan([ROLES], [8])
    assert more.seconds - base.seconds == pytest.approx(1.5)
    result = MappingSearch(models, wl, NODE, CostParams(stage_overhead_s=0.5)).run(top_k=1)
    again = MappingSearch(models, wl, NODE, CostParams(stage_overhead_s=0.5)).plan(result.best.placement,
                                                                                 result.best.allocation)
    assert result.best.seconds == pytest.approx(again.seconds)


def test_overlapping_sets_take_the_slowest_set_per_stage():
    wl = Workload(batch=64, prompt_len=128, response_len=128)
    search = MappingSearch({r: M7 for r in ROLES}, wl, NODE, CostParams(sequential_driver=False))
    plan = search.plan([("actor", "reference"), ("critic", "reward")], [4, 4])
    a, b = (s.stage_vector for s in plan.sets)
    assert plan.seconds == pytest.approx(sum(max(x, y) for x, y in zip(a, b)))


def test_presets():
    assert COST_PRESETS["cpu"] == CostParams()
    paper = get_cost_preset("A100-paper")
    assert not paper.sequential_driver and paper.zero_stage == 1 and paper.layer_overhead_s > 0
    with pytest.raises(SpecError, match="a100-paper"):
        get_cost_preset("h100")
    with pytest.raises(SpecError, match="overheads"):
        CostParams(layer_overhead_s=-1.0)
    for knob in KNOBS:  # every knob names a real field and its range holds the preset's value (or is a choice)
        target = A100 if knob.on_device else paper
        current = getattr(target, knob.field)
        assert isinstance(current, bool) or min(knob.values) <= current <= max(knob.values), knob.name


def test_vary_and_placement_kind():
    params, cluster = vary(CostParams(), NODE, Knob("device.inter_bw", (1.0,)), 1.0)
    assert cluster.device.inter_bw == 1.0 and params == CostParams() and NODE.device.inter_bw == 25e9
    params, cluster = vary(CostParams(), NODE, Knob("call_overhead_s", (0.3,)), 0.3)
    assert params.call_overhead_s == 0.3 and cluster == NODE
    assert placement_kind((ROLES,), ROLES) == "colocate"
    assert placement_kind((("critic", "reward"), ("reference", "actor")), ROLES) == "split"
    assert placement_kind(tuple((r,) for r in reversed(ROLES)), ROLES) == "standalone"
    assert placement_kind((("actor", "reward"), ("critic", "reference")), ROLES) == "other (2 sets)"


def test_sensitivity_reports_the_knob_that_flips_a_placement():
    """70B on 96 GPUs: with overlapping sets two sets of two models win; with the sequential driver the sets take
    turns, so a split only gives each model fewer devices and colocate-all comes back. A placement-neutral knob
    (the per-stage overhead) flips nothing."""
    wl = Workload(ppo_updates=8)
    cluster = ClusterSpec(12, 8, A100)
    paper = get_cost_preset("a100-paper")
    models = {r: get_model("70B") for r in ROLES}

    def build(p, c):
        return MappingSearch(models, wl, c, p)

    best = build(paper, cluster).run(top_k=1).best
    report = sensitivity(build, paper, cluster, best, knobs=(Knob("sequential_driver", (True,)),))
    assert report["placement"] != "colocate" and not report["robust"]
    assert report["flips"][0]["placement"] == "colocate" and report["flips"][0]["speedup_vs_colocate"] == 1.0
    unchanged = sensitivity(build, paper, cluster, best, knobs=(Knob("stage_overhead_s", (0.0, 0.5)),))
    assert unchanged["robust"] and len(unchanged["checked"]) == 2


def test_trend_check_logic(repo_script):
    bench = repo_script("benchmarks/automap_paper_scale.py")

    def row(size, gpus, kind):
        return {"model": size, "gpus": gpus, "chosen": {"kind": kind}}

    rows = [row("7B", 16, "colocate"), row("13B", 16, "colocate"), row("13B", 128, "standalone")]
    assert bench.trends(rows) == {"colocate_for_7B_and_13B_at_16": True, "not_colocate_for_13B_at_128": True}
    rows[1] = row("13B", 16, "split")
    rows[2] = row("13B", 128, "colocate")
    assert bench.trends(rows) == {"colocate_for_7B_and_13B_at_16": False, "not_colocate_for_13B_at_128": False}
    assert bench.trends(rows[:1]) == {"colocate_for_7B_and_13B_at_16": None, "not_colocate_for_13B_at_128": None}


@pytest.mark.parametrize("size", ["7B", "13B"])
def test_first_trend_colocate_all_at_16_gpus(repo_script, size):
    row = repo_script("benchmarks/automap_paper_scale.py").run_case(size, 16, get_cost_preset("a100-paper"), with_sensitivity=False)
    assert row["chosen"]["kind"] == "colocate"


@pytest.mark.xfail(strict=True, reason="not reproduced: with the a100-paper parameters 13B's MHA decode is KV-read "
                                       "bound and keeps scaling with devices, so colocate-all stays best at 128 GPUs "
                                       "(README, Auto-mapper)")
def test_second_trend_13b_at_128_gpus_is_not_colocate_all(repo_script):
    row = repo_script("benchmarks/automap_paper_scale.py").run_case("13B", 128, get_cost_preset("a100-paper"), with_sensitivity=False)
    assert row["chosen"]["kind"] != "colocate"


def test_max_gen_pp_keeps_generation_to_tp_and_dp():
    wl = Workload(batch=256, prompt_len=512, response_len=512)
    cluster = ClusterSpec(2, 8, A100)
    models = {r: get_model("13B") for r in ROLES}
    for space, allowed in ((SearchSpace(max_gen_pp=1), {1}), (SearchSpace(max_gen_pp=2), {1, 2})):
        plan = MappingSearch(models, wl, cluster, CostParams(), space).plan([ROLES], [16])
        gens = [p for p in plan.sets[0].phases if p.kind == "generate"]
        assert gens and all(p.layout.pp in allowed for p in gens)
