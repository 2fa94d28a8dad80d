"""Cost formulas against numbers worked out by hand (A100-80G: 312 TFLOP/s, 2.0 TB/s, 300 GB/s NVLink one way,
25 GB/s per node across nodes, 10 us / 30 us collective latency; Llama-2-7B: N = 6,738,415,616 parameters)."""

import math

import pytest

from hybridflow.mapping.cost import (
    CostParams,
    Layout,
    activation_bytes_infer,
    activation_bytes_train,
    allreduce_time,
    compute_time,
    forward_flops,
    generate_kv_bytes_per_sequence,
    generate_time,
    infer_time,
    kv_cache_bytes,
    model_state_bytes,
    p2p_time,
    reshard_time,
    train_flops,
    train_time,
)
from hybridflow.mapping.specs import ClusterSpec, SpecError, Workload, get_device, get_model

N7 = 6_738_415_616  # Llama-2-7B, as published
PEAK, BW, NVLINK, NIC = 312e12, 2.0e12, 300e9, 25e9
A100 = get_device("A100-80G")
NODE = ClusterSpec(1, 8, A100)
TWO_NODES = ClusterSpec(2, 8, A100)
M7 = get_model("7B")
NO_RECOMPUTE = CostParams(recompute=False)


def test_presets_match_published_parameter_counts_and_kv_sizes():
    assert M7.n_params == N7
    assert get_model("13B").n_params == 13_015_864_320
    assert get_model("70B").n_params == 68_976_648_192
    # KV cache per token: 2 (K, V) x layers x kv_heads x head_dim x 2 bytes
    assert M7.kv_bytes_per_token(2) == 2 * 32 * 32 * 128 * 2 == 524_288
    assert kv_cache_bytes(get_model("70B"), 1000, 2) == 2 * 80 * 8 * 128 * 2 * 1000


def test_flop_counts():
    assert train_flops(M7, 1000) == 6 * N7 * 1000
    assert train_flops(M7, 1000, recompute=True) == 8 * N7 * 1000
    assert forward_flops(M7, 10) == 2 * N7 * 10
    assert compute_time(6 * N7 * 2048, 8, PEAK, 0.45) == pytest.approx(6 * N7 * 2048 / (8 * 312e12 * 0.45))


def test_train_time_data_parallel_is_6N_tokens_over_devices_plus_gradient_allreduce():
    seconds = train_time(M7, Layout(1, 1, 8), 64, 2048, NODE, NO_RECOMPUTE)
    compute = 6 * N7 * 64 * 2048 / (8 * PEAK * 0.45)
    grad_sync = 10e-6 + 2 * 7 / 8 * (N7 * 2) / NVLINK  # ring all-reduce of bf16 grads inside the node
    assert seconds == pytest.approx(compute + grad_sync, rel=1e-12)


def test_train_time_pipeline_adds_bubble_and_sends():
    # pp2 x dp4: each dp rank has 16 sequences = 16 micro-batches of 1; 1F1B bubble (16 + 1) / 16
    seconds = train_time(M7, Layout(2, 1, 4), 64, 2048, NODE, NO_RECOMPUTE)
    compute = 6 * N7 * 16 * 2048 / 2 / (PEAK * 0.45)
    sends = 2 * 16 * (10e-6 + 2048 * 4096 * 2 / NVLINK)  # activation + gradient per micro-batch, same node
    grad_sync = 10e-6 + 2 * 3 / 4 * (N7 / 2 * 2) / NVLINK
    assert seconds == pytest.approx((compute + sends) * 17 / 16 + grad_sync, rel=1e-12)


def test_infer_time_is_2N_tokens_over_devices():
    seconds = infer_time(M7, Layout(1, 1, 8), 64, 2048, NODE, CostParams())
    assert seconds == pytest.approx(2 * N7 * 64 * 2048 / (8 * PEAK * 0.5), rel=1e-12)


def test_generate_time_memory_bound_decode():
    one = ClusterSpec(1, 1, A100)
    est = generate_time(M7, Layout(1, 1, 1), 4, 100, 50, 1e12, one, CostParams())
    prefill = 2 * N7 * 4 * 100 / (PEAK * 0.5)
    # each step reads the bf16 weights and the 4 sequences' KV cache at its mean length 100 + 50 / 2
    step = (2 * N7 + 4 * 524_288 * 125) / (BW * 0.7)
    assert step > 2 * N7 * 4 / (PEAK * 0.5)  # memory-bound indeed
    assert (est.waves, est.batch) == (1, 4)
    assert est.seconds == pytest.approx(prefill + 50 * step, rel=1e-12)
    assert est.kv_bytes == 4 * 524_288 * 150


def test_generate_time_kv_capacity_sets_waves():
    one = ClusterSpec(1, 1, A100)
    seq = 524_288 * 150  # one full sequence's KV cache
    est = generate_time(M7, Layout(1, 1, 1), 4, 100, 50, 2.5 * seq, one, CostParams())
    assert (est.waves, est.batch) == (2, 2)
    prefill = 2 * N7 * 2 * 100 / (PEAK * 0.5)
    step = (2 * N7 + 2 * 524_288 * 125) / (BW * 0.7)
    assert est.seconds == pytest.approx(2 * (prefill + 50 * step), rel=1e-12)
    assert generate_time(M7, Layout(1, 1, 1), 4, 100, 50, 0.5 * seq, one, CostParams()) is None


def test_kv_cache_per_device_splits_heads_over_tp_and_layers_over_pp():
    w = Workload(prompt_len=100, response_len=28)
    assert generate_kv_bytes_per_sequence(get_model("70B"), Layout(2, 8, 1), w, NODE) == 2 * 40 * 1 * 128 * 2 * 128
    tiny = get_model("tiny-arith")  # 2 kv heads: tp 4 replicates them, one per device
    assert generate_kv_bytes_per_sequence(tiny, Layout(1, 4, 1), w, NODE) == 2 * 4 * 1 * 32 * 2 * 128


@pytest.mark.parametrize("zero, weights, grads, optimizer", [
    (0, 2, 2, 12), (1, 2, 2, 12 / 4), (2, 2, 2 / 4, 12 / 4), (3, 2 / 4, 2 / 4, 12 / 4)])
def test_model_state_bytes_under_zero_stages(zero, weights, grads, optimizer):
    shard = N7 / 4  # tp2 x pp2
    states = model_state_bytes(M7, Layout(2, 2, 4), True, 2, CostParams(zero_stage=zero))
    assert states == pytest.approx({"weights": shard * weights, "grads": shard * grads,
                                    "optimizer": shard * optimizer})


def test_model_state_bytes_inference_only_and_fp32():
    frozen = model_state_bytes(M7, Layout(1, 2, 4), False, 2, CostParams(zero_stage=1))
    assert frozen == {"weights": N7 / 2 * 2, "grads": 0.0, "optimizer": 0.0}
    fp32 = model_state_bytes(M7, Layout(1, 1, 2), True, 4, CostParams(zero_stage=3))
    assert fp32 == pytest.approx({"weights": N7 * 4 / 2, "grads": N7 * 4 / 2, "optimizer": N7 * 8 / 2})


def test_activation_bytes():
    full = 32 * 34 * 4096 * 1000  # 34 h bytes per token per layer (bf16)
    logits = 2 * 32000 * 1000 * 4  # fp32 logits and their gradient
    assert activation_bytes_train(M7, Layout(1, 1, 1), 1, 1000, 2, NO_RECOMPUTE, 8) == full + logits
    recompute = 32 * 4096 * 1000 * 2 + 34 * 4096 * 1000  # stored layer inputs + one layer recomputed
    assert activation_bytes_train(M7, Layout(1, 1, 1), 1, 1000, 2, CostParams(), 8) == recompute + logits
    # pp2 tp2: 16 layers per stage, 2 micro-batches in flight, everything / tp
    pp_tp = 2 * 16 * 34 * 4096 * 1000 / 2 + 2 * 16000 * 1000 * 4
    assert activation_bytes_train(M7, Layout(2, 2, 1), 1, 1000, 2, NO_RECOMPUTE, 8) == pp_tp
    assert activation_bytes_infer(M7, Layout(1, 1, 1), 2, 500, 2) == 34 * 4096 * 1000 + 32000 * 1000 * 4


def test_collectives():
    assert allreduce_time(1e9, 1, 1, NODE) == 0.0
    assert allreduce_time(1e9, 8, 1, NODE) == pytest.approx(10e-6 + 2 * 7 / 8 * 1e9 / NVLINK)
    # 16 devices on 2 nodes: reduce-scatter/all-gather inside the node, then 2 nodes exchange 1/8 shards of all 8
    # devices at once over the node's 25 GB/s
    hier = (10e-6 + 2 * 7 / 8 * 1e9 / NVLINK) + 30e-6 + 2 * 1 / 2 * 1e9 / NIC
    assert allreduce_time(1e9, 16, 1, TWO_NODES) == pytest.approx(hier)
    assert p2p_time(1e6, 4, NODE) == pytest.approx(10e-6 + 1e6 / NVLINK)
    assert p2p_time(1e6, 8, TWO_NODES) == pytest.approx(30e-6 + 1e6 * 8 / NIC)


def test_reshard_gathers_the_missing_part_of_the_generation_shard():
    assert reshard_time(M7, Layout(1, 8, 1), Layout(1, 2, 4), NODE) == pytest.approx(
        10e-6 + N7 * 2 * (1 / 2 - 1 / 8) / NVLINK)
    assert reshard_time(M7, Layout(1, 2, 4), Layout(1, 8, 1), NODE) == 0.0


def test_cost_params_validation():
    with pytest.raises(SpecError, match="train_mfu=1.5"):
        CostParams(train_mfu=1.5)
    with pytest.raises(SpecError, match="zero_stage"):
        CostParams(zero_stage=4)
    assert math.isclose(CostParams().optimizer_bytes_per_param(2), 12)
