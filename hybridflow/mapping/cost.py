"""Simulators of HybridFlow's auto-mapping (Sheng et al. 2024, arXiv 2409.19256, §6): time and memory of one
model's training, inference (forward) and generation on ``pp x tp x dp`` devices.

Training and inference are compute-bound: time = FLOP per device / (peak x MFU), plus tensor-parallel
all-reduces per layer and pipeline sends per micro-batch, stretched by the pipeline bubble, plus the
data-parallel gradient all-reduce. Generation is
memory-bandwidth-bound: each decode step reads the device's weight shard and the KV cache of its batch
(roofline: the larger of that read time and the step's FLOP time); the KV cache must fit next to the model
states, so a replica decodes its sequences in as many waves as the cache capacity needs.

FLOP counts follow Kaplan et al. 2020 / Narayanan et al. 2021: 2·N per token forward, 6·N forward+backward,
+2·N when activations are recomputed (N parameters; attention score FLOP are left out). Activation memory
follows Korthikanti et al. 2022 (34·h bytes per token per layer in bf16, divided by tp with sequence
parallelism, with flash attention so no s² term). Devices are numbered node-major and parallel groups in
Megatron order (tp fastest, then dp, then pp), so a tp group sits inside a node and a dp group has stride tp.

Units: seconds, bytes, FLOP. Shapes are counts: ``sequences`` (sequences), ``seq_len`` (tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridflow.mapping.specs import ClusterSpec, ModelSpec, SpecError, Workload, ceil_div

__all__ = [
    "CostParams", "GenerateEstimate", "Layout", "activation_bytes_infer", "activation_bytes_train",
    "allreduce_time", "compute_time", "forward_flops", "gen_extra_weight_bytes", "generate_kv_bytes_per_sequence",
    "generate_time", "infer_time", "kv_cache_bytes", "model_state_bytes", "p2p_time", "reshard_time", "train_flops",
    "train_time",
]

ACT_BYTES_PER_TOKEN_LAYER_BF16 = 34  # x hidden: Korthikanti et al. 2022, Table 2 (flash attention: no s^2 term)
LOGIT_BYTES = 4  # logits (and their gradient) are computed in fp32


@dataclass(frozen=True)
class Layout:
    """Parallel sizes of one model: ``pp`` pipeline stages x ``tp`` tensor shards x ``dp`` data replicas."""

    pp: int = 1
    tp: int = 1
    dp: int = 1

    @property
    def size(self) -> int:
        return self.pp * self.tp * self.dp

    def as_list(self) -> list[int]:
        """``[pp, tp, dp]`` (the order of ``layouts`` in the config)."""
        return [self.pp, self.tp, self.dp]

    def __str__(self) -> str:
        return f"pp{self.pp} tp{self.tp} dp{self.dp}"


@dataclass(frozen=True)
class CostParams:
    """Efficiency factors and memory policy of the simulators (documented defaults, all overridable).

    Attributes:
        train_mfu: model FLOP utilisation of training (forward + backward; recompute counted as FLOP).
        infer_mfu: MFU of a forward pass over full sequences (log-probs, values, rewards).
        prefill_mfu: MFU of the prompt pass of generation.
        gen_mbu: fraction of the memory bandwidth a decode step reaches.
        gen_mfu: MFU of a decode step whose batch is large enough to be compute-bound.
        mem_usable: fraction of device memory for model states, activations and KV cache (the rest: runtime,
            fragmentation).
        zero_stage: sharding of training states over dp: 0 none, 1 optimizer (Megatron distributed optimizer),
            2 + gradients, 3 + weights (FSDP; inference-only models are then sharded over dp too).
        recompute: activation checkpointing in training (stores layer inputs; +2·N FLOP per token).
        decode_step_overhead_s: fixed time per decode step (kernel launches, sampling, Python).
        call_overhead_s: fixed time per model call (dispatch, data movement between workers).
    """

    train_mfu: float = 0.45
    infer_mfu: float = 0.5
    prefill_mfu: float = 0.5
    gen_mbu: float = 0.7
    gen_mfu: float = 0.5
    mem_usable: float = 0.9
    zero_stage: int = 1
    recompute: bool = True
    decode_step_overhead_s: float = 0.0
    call_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        fractions = {k: getattr(self, k) for k in ("train_mfu", "infer_mfu", "prefill_mfu", "gen_mbu", "gen_mfu",
                                                   "mem_usable")}
        bad = [f"{k}={v}" for k, v in fractions.items() if not 0 < v <= 1]
        if bad:
            raise SpecError(f"cost params: utilisation factors must be in (0, 1], got {', '.join(bad)}")
        if self.decode_step_overhead_s < 0 or self.call_overhead_s < 0:
            raise SpecError(f"cost params: overheads must be >= 0 s, got decode_step_overhead_s="
                            f"{self.decode_step_overhead_s}, call_overhead_s={self.call_overhead_s}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise SpecError(f"cost params: zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")

    def optimizer_bytes_per_param(self, dtype_bytes: int) -> int:
        """Adam state per parameter: fp32 m and v, plus an fp32 master copy when weights are 16-bit."""
        return 8 + (4 if dtype_bytes < 4 else 0)


# ---------------------------------------------------------------------------------------------- compute


def train_flops(model: ModelSpec, tokens: float, recompute: bool = False) -> float:
    """FLOP of forward + backward over ``tokens`` tokens: 6·N·tokens, 8·N·tokens with recomputation."""
    return (8 if recompute else 6) * model.n_params * tokens


def forward_flops(model: ModelSpec, tokens: float) -> float:
    """FLOP of a forward pass over ``tokens`` tokens: 2·N·tokens."""
    return 2 * model.n_params * tokens


def compute_time(flops: float, n_devices: int, peak_flops: float, mfu: float) -> float:
    """Seconds for ``flops`` spread evenly over ``n_devices`` running at ``mfu`` of ``peak_flops`` each."""
    return flops / (n_devices * peak_flops * mfu)


def allreduce_time(nbytes: float, size: int, stride: int, cluster: ClusterSpec) -> float:
    """Seconds of one all-reduce of ``nbytes`` per member over a group of ``size`` devices ``stride`` apart.

    Inside one node: a ring, latency + 2(g-1)/g · bytes / intra_bw. Across k nodes: hierarchical (reduce-scatter
    and all-gather inside the node, ring all-reduce of the 1/c shard across nodes, c members per node), where
    every device of a node does the same at once (all dp groups sync together), so the node's network moves
    2(k-1)/k · bytes · stride. A group of one costs nothing.
    """
    if size <= 1:
        return 0.0
    dev = cluster.device
    per_node = max(1, min(size, cluster.devices_per_node // stride))
    if per_node >= size:
        return dev.intra_latency_s + 2 * (size - 1) / size * nbytes / dev.intra_bw
    k = ceil_div(size, per_node)
    intra = dev.intra_latency_s + 2 * (per_node - 1) / per_node * nbytes / dev.intra_bw if per_node > 1 else 0.0
    return intra + dev.inter_latency_s + 2 * (k - 1) / k * nbytes * min(stride, cluster.devices_per_node) / dev.inter_bw


def _tp_comm(model: ModelSpec, layout: Layout, n_allreduce_per_layer: int, micro_batches: int, tokens_per_micro: int,
             cluster: ClusterSpec) -> float:
    """Tensor-parallel all-reduces of one device: per layer of its stage, per micro-batch."""
    if layout.tp == 1:
        return 0.0
    nbytes = tokens_per_micro * model.hidden * cluster.device.dtype_bytes
    count = math.ceil(model.layers / layout.pp) * n_allreduce_per_layer * micro_batches
    return count * allreduce_time(nbytes, layout.tp, 1, cluster)


def p2p_time(nbytes: float, stride: int, cluster: ClusterSpec) -> float:
    """Seconds for every device to send ``nbytes`` to the device ``stride`` ranks away (pipeline neighbours):
    over the node's links when the neighbour shares the node, else over the node's network, which all of the
    node's devices use at once."""
    dev = cluster.device
    if stride < cluster.devices_per_node:
        return dev.intra_latency_s + nbytes / dev.intra_bw
    return dev.inter_latency_s + nbytes * cluster.devices_per_node / dev.inter_bw


def _pp_comm(model: ModelSpec, layout: Layout, sends_per_micro: int, micro_batches: int, tokens_per_micro: int,
             cluster: ClusterSpec) -> float:
    """Pipeline sends of one device: its stage's activations (or their gradients), / tp (scatter-gather), per
    micro-batch; neighbours are tp·dp ranks apart."""
    if layout.pp == 1:
        return 0.0
    nbytes = tokens_per_micro * model.hidden * cluster.device.dtype_bytes / layout.tp
    return sends_per_micro * micro_batches * p2p_time(nbytes, layout.tp * layout.dp, cluster)


def _bubble(micro_batches: int, pp: int) -> float:
    """1F1B pipeline stretch: (m + pp - 1) / m for m micro-batches."""
    return (micro_batches + pp - 1) / micro_batches


def train_time(model: ModelSpec, layout: Layout, sequences: int, seq_len: int, cluster: ClusterSpec,
               params: CostParams, *, epochs: int = 1, updates: int = 1, micro_batch: int = 1) -> float:
    """Seconds to train on ``sequences`` sequences of ``seq_len`` tokens, ``epochs`` passes of ``updates``
    optimizer steps each.

    Each dp rank handles ceil(sequences / dp) sequences per epoch in micro-batches of ``micro_batch``; its
    stage does train_flops / (tp·pp) of them at ``train_mfu``, plus (4, or 6 with recompute) tp all-reduces per
    layer per micro-batch and 2 pipeline sends per micro-batch, all stretched by the pipeline bubble; then each
    optimizer step all-reduces the gradient shard (N / (tp·pp) elements) over dp (x1.5 with ZeRO-3 for the
    parameter all-gathers).
    """
    dev = cluster.device
    per_rank = ceil_div(sequences, layout.dp)
    micro_per_step = max(1, ceil_div(per_rank, updates * micro_batch))
    flops = train_flops(model, per_rank * seq_len * epochs, params.recompute) / (layout.tp * layout.pp)
    compute = flops / (dev.peak_flops * params.train_mfu)
    micro_total = micro_per_step * updates * epochs
    comm = (_tp_comm(model, layout, 6 if params.recompute else 4, micro_total, micro_batch * seq_len, cluster)
            + _pp_comm(model, layout, 2, micro_total, micro_batch * seq_len, cluster))
    pipe = (compute + comm) * _bubble(micro_per_step, layout.pp)
    grad_bytes = model.n_params / (layout.tp * layout.pp) * dev.dtype_bytes
    sync = allreduce_time(grad_bytes, layout.dp, layout.tp, cluster) * (1.5 if params.zero_stage >= 3 else 1.0)
    return pipe + sync * updates * epochs + params.call_overhead_s


def infer_time(model: ModelSpec, layout: Layout, sequences: int, seq_len: int, cluster: ClusterSpec,
               params: CostParams, *, micro_batch: int = 1) -> float:
    """Seconds of one forward pass over ``sequences`` sequences of ``seq_len`` tokens (log-probs, values,
    scores): forward_flops / devices at ``infer_mfu``, 2 tp all-reduces per layer and 1 pipeline send per
    micro-batch, stretched by the pipeline bubble."""
    dev = cluster.device
    per_rank = ceil_div(sequences, layout.dp)
    micro = max(1, ceil_div(per_rank, micro_batch))
    flops = forward_flops(model, per_rank * seq_len) / (layout.tp * layout.pp)
    compute = flops / (dev.peak_flops * params.infer_mfu)
    comm = (_tp_comm(model, layout, 2, micro, micro_batch * seq_len, cluster)
            + _pp_comm(model, layout, 1, micro, micro_batch * seq_len, cluster))
    return (compute + comm) * _bubble(micro, layout.pp) + params.call_overhead_s


# ---------------------------------------------------------------------------------------------- generation


def kv_cache_bytes(model: ModelSpec, tokens: float, dtype_bytes: int) -> float:
    """KV-cache bytes of ``tokens`` tokens on one full model: 2·layers·kv_heads·head_dim·dtype_bytes·tokens."""
    return model.kv_bytes_per_token(dtype_bytes) * tokens


def _kv_bytes_per_token_device(model: ModelSpec, layout: Layout, dtype_bytes: int) -> float:
    """One token's KV cache on one device: its stage's layers, its share of kv heads (replicated if tp > kv)."""
    kv_heads = math.ceil(model.kv_heads / layout.tp)
    return 2 * math.ceil(model.layers / layout.pp) * kv_heads * model.head_dim * dtype_bytes


def generate_kv_bytes_per_sequence(model: ModelSpec, layout: Layout, workload: Workload, cluster: ClusterSpec) -> float:
    """KV-cache bytes per device of one full sequence (prompt + response) of ``workload`` on ``layout``."""
    kv_tok = _kv_bytes_per_token_device(model, layout, cluster.device.dtype_bytes)
    return kv_tok * (workload.prompt_len + workload.response_len)


@dataclass(frozen=True)
class GenerateEstimate:
    """Result of ``generate_time``: total seconds, decode waves per replica, concurrent sequences per replica,
    and the KV-cache bytes per device those sequences hold at the end."""

    seconds: float
    waves: int
    batch: int
    kv_bytes: float


def generate_time(model: ModelSpec, layout: Layout, sequences: int, prompt_len: int, response_len: int,
                  kv_budget_bytes: float, cluster: ClusterSpec, params: CostParams) -> GenerateEstimate | None:
    """Generate ``response_len`` tokens for each of ``sequences`` prompts of ``prompt_len`` tokens on ``layout``
    (dp replicas of pp x tp devices), each device having ``kv_budget_bytes`` free for the KV cache.

    A replica holds ``c = floor(budget / kv bytes of one full sequence on a device)`` sequences at once and
    decodes its ceil(sequences / dp) sequences in ``w`` balanced waves of ``b``. Per wave: a prefill
    (2·N·b·prompt_len / (tp·pp) FLOP per device at ``prefill_mfu``) and ``response_len`` decode steps. With
    ``u = min(pp, b)`` micro-batches in flight, a stage's micro-step takes the larger of (weight shard +
    the micro-batch's KV cache at mean length) / (mem_bw·gen_mbu) and its FLOP / (peak·gen_mfu), plus 2 tp
    all-reduces per layer and a pipeline send; a decode step takes max(u, pp) micro-steps.

    Returns:
        The estimate, or None when not even one sequence's KV cache fits in the budget.
    """
    dev = cluster.device
    kv_tok = _kv_bytes_per_token_device(model, layout, dev.dtype_bytes)
    capacity = int(kv_budget_bytes // (kv_tok * (prompt_len + response_len))) if kv_budget_bytes > 0 else 0
    if capacity < 1:
        return None
    per_replica = ceil_div(sequences, layout.dp)
    waves = ceil_div(per_replica, capacity)
    batch = ceil_div(per_replica, waves)
    shards = layout.tp * layout.pp
    prefill = forward_flops(model, batch * prompt_len) / shards / (dev.peak_flops * params.prefill_mfu)
    u = min(layout.pp, batch)
    micro = batch / u
    weights = model.n_params * dev.dtype_bytes / shards
    kv_read = micro * kv_tok * (prompt_len + response_len / 2)
    t_mem = (weights + kv_read) / (dev.mem_bw * params.gen_mbu)
    t_flop = forward_flops(model, micro) / shards / (dev.peak_flops * params.gen_mfu)
    comm = 0.0
    if layout.tp > 1:
        nbytes = micro * model.hidden * dev.dtype_bytes
        comm = 2 * math.ceil(model.layers / layout.pp) * allreduce_time(nbytes, layout.tp, 1, cluster)
    if layout.pp > 1:
        comm += p2p_time(micro * model.hidden * dev.dtype_bytes / layout.tp, layout.tp * layout.dp, cluster)
    step = max(u, layout.pp) * (max(t_mem, t_flop) + comm) + params.decode_step_overhead_s
    seconds = waves * (prefill + response_len * step) + params.call_overhead_s
    return GenerateEstimate(seconds, waves, batch, batch * kv_tok * (prompt_len + response_len))


def reshard_time(model: ModelSpec, train: Layout, gen: Layout, cluster: ClusterSpec) -> float:
    """Seconds of the 3D-HybridEngine's switch from the training layout to the generation layout (HybridFlow
    §5): each device all-gathers the weights its generation shard adds to its training shard,
    N·dtype_bytes·(1/(tp_g·pp_g) - 1/(tp·pp)) bytes, inside its micro-dp group (a node's network carries the
    gathers of all its devices when the group spans nodes). Zero when the generation shard is no larger."""
    dev = cluster.device
    extra = model.n_params * dev.dtype_bytes * (1 / (gen.tp * gen.pp) - 1 / (train.tp * train.pp))
    if extra <= 0:
        return 0.0
    if train.tp * train.pp <= cluster.devices_per_node:
        return dev.intra_latency_s + extra / dev.intra_bw
    return dev.inter_latency_s + extra * cluster.devices_per_node / dev.inter_bw


def gen_extra_weight_bytes(model: ModelSpec, train: Layout | None, gen: Layout, dtype_bytes: int) -> float:
    """Weight bytes per device that generation adds on top of the persistent shard (the whole generation shard
    for a model without a training layout)."""
    gen_shard = model.n_params * dtype_bytes / (gen.tp * gen.pp)
    if train is None:
        return gen_shard
    return max(0.0, gen_shard - model.n_params * dtype_bytes / (train.tp * train.pp))


# ---------------------------------------------------------------------------------------------- memory


def model_state_bytes(model: ModelSpec, layout: Layout, trained: bool, dtype_bytes: int,
                      params: CostParams) -> dict[str, float]:
    """Persistent bytes per device: ``weights``, ``grads`` and ``optimizer`` (zero for a model that is not
    trained). The model is split N / (tp·pp) per device; ZeRO stage z further divides by dp the optimizer
    (z >= 1), gradients (z >= 2) and weights (z >= 3, also for inference-only models)."""
    shard = model.n_params / (layout.tp * layout.pp)
    z, dp = params.zero_stage, layout.dp
    weights = shard * dtype_bytes / (dp if z >= 3 else 1)
    if not trained:
        return {"weights": weights, "grads": 0.0, "optimizer": 0.0}
    grads = shard * dtype_bytes / (dp if z >= 2 else 1)
    optimizer = shard * params.optimizer_bytes_per_param(dtype_bytes) / (dp if z >= 1 else 1)
    return {"weights": weights, "grads": grads, "optimizer": optimizer}


def _layer_activation_bytes(model: ModelSpec, tokens: int, layout: Layout, dtype_bytes: int) -> float:
    return ACT_BYTES_PER_TOKEN_LAYER_BF16 * model.hidden * tokens * dtype_bytes / 2 / layout.tp


def _logit_bytes(model: ModelSpec, tokens: int, layout: Layout) -> float:
    width = 1 if model.value_head else model.vocab / layout.tp
    return width * tokens * LOGIT_BYTES


def activation_bytes_train(model: ModelSpec, layout: Layout, micro_batch: int, seq_len: int, dtype_bytes: int,
                           params: CostParams, micro_batches_per_step: int) -> float:
    """Peak activation bytes per device in training.

    The first stage keeps min(pp, m) micro-batches in flight (1F1B; m micro-batches per step). Each keeps, per
    layer of the stage, its input (h·dtype_bytes/tp per token) with recompute, or the full
    34·h·(dtype_bytes/2)/tp per token without; recompute adds one layer's full activations. Plus fp32
    logits and their gradient for one micro-batch (vocab / tp wide; 1 for a value head).
    """
    tokens = micro_batch * seq_len
    stage_layers = math.ceil(model.layers / layout.pp)
    full = _layer_activation_bytes(model, tokens, layout, dtype_bytes)
    if params.recompute:
        per_micro = stage_layers * model.hidden * tokens * dtype_bytes / layout.tp
        extra = full
    else:
        per_micro = stage_layers * full
        extra = 0.0
    inflight = min(layout.pp, max(1, micro_batches_per_step))
    return inflight * per_micro + extra + 2 * _logit_bytes(model, tokens, layout)


def activation_bytes_infer(model: ModelSpec, layout: Layout, micro_batch: int, seq_len: int,
                           dtype_bytes: int) -> float:
    """Peak activation bytes per device of a forward pass: one layer's activations and the fp32 logits of one
    micro-batch."""
    tokens = micro_batch * seq_len
    return _layer_activation_bytes(model, tokens, layout, dtype_bytes) + _logit_bytes(model, tokens, layout)
