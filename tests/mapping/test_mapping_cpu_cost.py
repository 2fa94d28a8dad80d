"""Cost terms for CPU ranks and hybridflow's execution, against numbers worked out by hand.

cpu preset, per rank (one core): 57.5 GFLOP/s, 10.5 GB/s memory, 0.9 GB/s gloo bus bandwidth, 0.7 ms per ring
step, fp32. tiny-arith: N = 853,120 parameters and 38 tensors (as its safetensors hold), 4 layers; its LM head is
tied to the embedding, so its value model only adds a scalar head of 128: N_v = 853,248.
"""

import dataclasses

import pytest

from hybridflow.mapping.cost import (
    CostParams,
    Layout,
    allgather_time,
    allreduce_time,
    contended,
    fsdp_units,
    gen_extra_weight_bytes,
    infer_time,
    rank_share,
    reshard_time,
    train_time,
)
from hybridflow.mapping.search import MappingSearch
from hybridflow.mapping.specs import ClusterSpec, SpecError, Workload, get_device, get_model

CPU = get_device("cpu")
FLOPS, MEM_BW, GLOO_BW, HOP = 57.5e9, 10.5e9, 0.9e9, 0.7e-3
TINY = get_model("tiny-arith")
N = 853_120
N_V = 853_248
A100_NODE = ClusterSpec(1, 8, get_device("A100-80G"))


def test_tiny_arith_and_llama_tensor_counts():
    assert TINY.n_params == N and TINY.n_tensors == 4 * 9 + 2 == 38
    assert get_model("7B").n_tensors == 291  # Llama-2-7B's checkpoint: 32 x 9 + embedding, norm, lm_head
    assert TINY.as_value_model().n_tensors == 39 and TINY.as_value_model().n_params == N_V
    assert fsdp_units(TINY, Layout(1, 1, 2)) == 5 and fsdp_units(get_model("7B"), Layout(4, 1, 1)) == 9


def test_rank_share():
    assert rank_share(4, 2) == 0.5
    assert rank_share(3, 2) == pytest.approx(2 / 3)
    assert rank_share(2, 2) == rank_share(1, 2) == 1.0
    assert rank_share(64, None) == 1.0
    with pytest.raises(SpecError, match="busy_ranks"):
        rank_share(0, 2)


def test_contended_scales_a_ranks_cpu_rates_only():
    cluster = ClusterSpec(1, 4, CPU, cores_per_node=2)
    params = CostParams(decode_step_overhead_s=0.01, call_overhead_s=0.1, collective_overhead_s=0.003)
    slow, slow_params = contended(cluster, params, 4)
    dev = slow.device
    assert (dev.peak_flops, dev.mem_bw, dev.intra_bw) == pytest.approx((FLOPS / 2, MEM_BW / 2, GLOO_BW / 2))
    assert dev.intra_latency_s == pytest.approx(2 * HOP)
    assert (dev.inter_latency_s, dev.inter_bw, dev.mem_bytes) == (HOP, GLOO_BW, CPU.mem_bytes)
    assert slow_params.decode_step_overhead_s == pytest.approx(0.02) and slow_params.call_overhead_s == 0.1
    assert slow_params.collective_overhead_s == pytest.approx(0.006)
    assert contended(cluster, params, 2) == (cluster, params)
    assert contended(ClusterSpec(1, 8, CPU), params, 8) == (ClusterSpec(1, 8, CPU), params)  # no cores given


def test_gloo_collectives_pay_latency_per_ring_step():
    node = ClusterSpec(1, 4, CPU)
    # all-reduce over 4 ranks: 2 x 3 ring steps; all-gather: 3
    assert allreduce_time(1e6, 4, 1, node) == pytest.approx(6 * HOP + 2 * 3 / 4 * 1e6 / GLOO_BW)
    assert allgather_time(1e6, 4, 1, node) == pytest.approx(3 * HOP + 3 / 4 * 1e6 / GLOO_BW)
    assert allreduce_time(1e3, 2, 1, node) == pytest.approx(1.4e-3 + 1e3 / GLOO_BW)  # the preset's 1 KB number
    # 2 nodes of 2 ranks: ring inside the node (2 steps), then over the 2 nodes (2 steps)
    two = ClusterSpec(2, 2, CPU)
    assert allreduce_time(1e6, 4, 1, two) == pytest.approx(2 * HOP + 1e6 / GLOO_BW + 2 * HOP + 1e6 / GLOO_BW)
    # NCCL (no hop latency): latency once, half an all-reduce's bytes
    assert allgather_time(1e9, 8, 1, A100_NODE) == pytest.approx(10e-6 + 7 / 8 * 1e9 / 300e9)
    assert allgather_time(1e9, 1, 1, A100_NODE) == 0.0


def test_zero3_train_time_gathers_per_unit_and_micro_batch():
    node = ClusterSpec(1, 2, CPU)
    params = CostParams(recompute=False, zero_stage=3)
    seconds = train_time(TINY, Layout(1, 1, 2), 32, 64, node, params, updates=2, micro_batch=4)
    # 16 sequences per rank, 2 optimizer steps of 2 micro-batches of 4
    compute = 6 * N * 16 * 64 / (FLOPS * 0.45)
    unit_gather = HOP + 1 / 2 * (N * 4 / 5) / GLOO_BW  # 5 FSDP units, 2 ranks: 1 ring step
    assert seconds == pytest.approx(compute + 4 * 3 * 5 * unit_gather, rel=1e-12)
    # a fixed CPU cost around each of those 60 collectives
    overhead = train_time(TINY, Layout(1, 1, 2), 32, 64, node, dataclasses.replace(params, collective_overhead_s=2e-3),
                          updates=2, micro_batch=4)
    assert overhead == pytest.approx(seconds + 60 * 2e-3, rel=1e-12)
    single = train_time(TINY, Layout(1, 1, 1), 32, 64, ClusterSpec(1, 1, CPU),
                        dataclasses.replace(params, collective_overhead_s=2e-3), updates=2, micro_batch=4)
    assert single == pytest.approx(6 * N * 32 * 64 / (FLOPS * 0.45), rel=1e-12)  # one rank: no collectives
    # ZeRO-1 instead: one gradient all-reduce per optimizer step
    zero1 = train_time(TINY, Layout(1, 1, 2), 32, 64, node, dataclasses.replace(params, zero_stage=1), updates=2,
                       micro_batch=4)
    assert zero1 == pytest.approx(compute + 2 * (2 * HOP + N * 4 / GLOO_BW), rel=1e-12)


def test_zero3_infer_time_gathers_once_per_unit_and_micro_batch():
    node = ClusterSpec(1, 4, CPU)
    params = CostParams(zero_stage=3)
    seconds = infer_time(TINY, Layout(1, 1, 4), 32, 64, node, params, micro_batch=16)
    # 8 sequences per rank: one micro-batch; 4 ranks: 3 ring steps per all-gather
    expected = 2 * N * 8 * 64 / (FLOPS * 0.5) + 5 * (3 * HOP + 3 / 4 * (N * 4 / 5) / GLOO_BW)
    assert seconds == pytest.approx(expected, rel=1e-12)


def test_zero3_reshard_gathers_the_generation_shard_tensor_by_tensor():
    node = ClusterSpec(1, 2, CPU)
    full = Layout(1, 1, 2)  # the hf rollout: a full copy on each rank
    expected = 38 * (HOP + 1 / 2 * (N * 4 / 38) / GLOO_BW)
    zero3 = CostParams(zero_stage=3)
    assert reshard_time(TINY, full, full, node, zero3) == pytest.approx(expected, rel=1e-12)
    # FSDP's per-collective overhead is not charged to the plain gathers of the weight sync
    assert reshard_time(TINY, full, full, node, dataclasses.replace(zero3, collective_overhead_s=1e-3)) == \
        pytest.approx(expected, rel=1e-12)
    assert reshard_time(TINY, full, full, node) == 0.0  # ZeRO-1: every rank holds the weights already
    assert reshard_time(TINY, Layout(1, 1, 1), Layout(1, 1, 1), ClusterSpec(1, 1, CPU), zero3) == 0.0
    # the full copy adds the weights a rank does not hold: all of them but its 1/dp shard under ZeRO-3
    assert gen_extra_weight_bytes(TINY, full, full, 4, zero_stage=3) == pytest.approx(N * 4 / 2)
    assert gen_extra_weight_bytes(TINY, full, full, 4) == 0.0


QUICK = Workload("ppo", batch=32, prompt_len=32, response_len=32, ppo_updates=2, micro_batch=4,
                 forward_micro_batch=16)
QUICK_MODELS = {"actor": TINY, "reference": TINY, "critic": TINY, "reward": None}


def _phase(plan, role, kind):
    return next(p.seconds for s in plan.sets for p in s.phases if p.role == role and p.kind == kind)


def test_sequential_driver_sums_sets_and_overlap_takes_the_slowest():
    cluster = ClusterSpec(1, 4, CPU)  # a core per rank: the driver alone makes the difference
    params = CostParams(recompute=False, zero_stage=3)
    placement, alloc = [["actor", "reference"], ["critic"]], [2, 2]
    seq = MappingSearch(QUICK_MODELS, QUICK, cluster, params).plan(placement, alloc)
    assert seq.seconds == pytest.approx(sum(s.seconds for s in seq.sets), rel=1e-12)
    over = MappingSearch(QUICK_MODELS, QUICK, cluster, dataclasses.replace(params, sequential_driver=False))
    plan = over.plan(placement, alloc)
    by_stage = [max(s.stage_seconds(st) for s in plan.sets) for st in ("generate", "prepare", "train")]
    assert plan.seconds == pytest.approx(sum(by_stage), rel=1e-12)
    assert plan.seconds < seq.seconds
    for mine, theirs in zip(seq.sets, plan.sets):  # same layouts and phase times: only the combination differs
        assert mine.stage_vector == pytest.approx(theirs.stage_vector, rel=1e-12)


def test_busy_ranks_set_the_share_of_a_core():
    """Sequential driver: only the running set's ranks are busy, so 4 ranks on 2 cores compute like 2 ranks; the
    paper's overlapping model counts the whole node as busy."""
    cluster = ClusterSpec(1, 4, CPU, cores_per_node=2)
    params = CostParams(recompute=False, zero_stage=0)
    seq = MappingSearch(QUICK_MODELS, QUICK, cluster, params)
    two = seq.plan([["actor", "reference"], ["critic"]], [2, 2])
    four = seq.plan([["actor", "reference", "critic"]], [4])
    assert _phase(two, "critic", "infer") == pytest.approx(2 * N_V * 16 * 64 / (FLOPS * 0.5), rel=1e-12)
    assert _phase(four, "critic", "infer") == pytest.approx(2 * N_V * 8 * 64 / (FLOPS / 2 * 0.5), rel=1e-12)
    assert seq.busy_ranks(2) == 2 and seq.busy_ranks(4) == 4
    over = MappingSearch(QUICK_MODELS, QUICK, cluster, dataclasses.replace(params, sequential_driver=False))
    assert over.busy_ranks(2) == 4
    shared = over.plan([["actor", "reference"], ["critic"]], [2, 2])
    assert _phase(shared, "critic", "infer") == pytest.approx(2 * N_V * 16 * 64 / (FLOPS / 2 * 0.5), rel=1e-12)


def test_forward_micro_batch_sets_the_forward_passes():
    assert Workload(micro_batch=4).infer_micro_batch == 4
    assert Workload(micro_batch=4, forward_micro_batch=16).infer_micro_batch == 16
    with pytest.raises(SpecError, match="forward_micro_batch=0"):
        Workload(forward_micro_batch=0)


def test_overheads_must_not_be_negative():
    with pytest.raises(SpecError, match="collective_overhead_s=-0.1"):
        CostParams(collective_overhead_s=-0.1)
