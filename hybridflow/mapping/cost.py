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

With ZeRO-3 (FSDP, what hybridflow's workers run) every FSDP unit (a decoder layer; the root: embeddings, norm,
head) all-gathers its parameters before each forward and each backward of every micro-batch and reduce-scatters
its gradients after each backward, so these collectives are charged per unit and micro-batch.

Fixed costs that do not shrink with more devices (``CostParams``; all zero by default): per decoder layer and
micro-batch pass (kernel launches: small per-device micro-batches run below the MFU), per decode step (the
rollout engine's CPU work), per model call (dispatch and data movement) and per stage (the driver's barrier).
With a fixed cost per call, models on different devices that run a stage at the same time (the paper's model,
``sequential_driver=False``) pay it once per stage instead of once per model, which favours splitting a large
cluster when each model's share of the work gets small (whether enough to change a placement depends on the
sizes: docs/concepts/auto-mapper.md). ``hybridflow.mapping.presets`` holds the
parameter sets (``a100-paper``: the paper's testbed, each value with its source).

CPU ranks (``ClusterSpec.cores_per_node``): ranks that outnumber a node's cores share them. ``rank_share`` gives
each busy rank min(1, cores / busy ranks) of a core and ``contended`` scales the rank's CPU-bound rates by it.
Which ranks are busy depends on the driver (``CostParams.sequential_driver``; see ``hybridflow.mapping.search``).

Units: seconds, bytes, FLOP. Shapes are counts: ``sequences`` (sequences), ``seq_len`` (tokens).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from hybridflow.mapping.expert_cost import param_shards
from hybridflow.mapping.specs import ClusterSpec, ModelSpec, SpecError, Workload, ceil_div

__all__ = [
    "CostParams", "GenerateEstimate", "Layout", "activation_bytes_infer", "activation_bytes_train",
    "allgather_time", "allreduce_time", "compute_time", "contended", "ep_comm_time", "forward_flops", "fsdp_units",
    "gen_extra_weight_bytes", "generate_kv_bytes_per_sequence", "generate_time", "infer_time", "kv_cache_bytes",
    "layer_fixed_time", "layer_passes", "model_state_bytes", "p2p_time", "rank_share", "reshard_time",
    "train_flops", "train_time",
]

ACT_BYTES_PER_TOKEN_LAYER_BF16 = 34  # x hidden: Korthikanti et al. 2022, Table 2 (flash attention: no s^2 term)
LOGIT_BYTES = 4  # logits (and their gradient) are computed in fp32


@dataclass(frozen=True)
class Layout:
    """Parallel sizes of one model: ``pp`` pipeline stages x ``tp`` tensor shards x ``dp`` data replicas, of which
    ``sp`` (a divisor of dp; Ulysses sequence parallelism) share each sequence: dp / sp data groups, each sequence's
    tokens split over sp ranks (the weights still shard over all dp ranks), and ``ep`` (a divisor of dp; expert
    parallelism of an MoE model, :mod:`hybridflow.mapping.expert_cost`) hold experts / ep each."""

    pp: int = 1
    tp: int = 1
    dp: int = 1
    sp: int = 1
    ep: int = 1

    @property
    def size(self) -> int:
        return self.pp * self.tp * self.dp

    def as_list(self) -> list[int]:
        """``[pp, tp, dp]`` (the order of ``layouts`` in the config)."""
        return [self.pp, self.tp, self.dp]

    def __str__(self) -> str:
        return (f"pp{self.pp} tp{self.tp} dp{self.dp}" + (f" sp{self.sp}" if self.sp > 1 else "")
                + (f" ep{self.ep}" if self.ep > 1 else ""))

    @property
    def data_groups(self) -> int:
        """Ranks that each take their own sequences: dp / sp."""
        return self.dp // self.sp


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
        decode_step_overhead_s: fixed time per decode step (kernel launches, sampling, Python), on a rank that
            has a core (GPU: its host core) to itself.
        call_overhead_s: fixed time per model call (dispatch, data movement between workers, the driver's own
            work).
        collective_overhead_s: fixed CPU time a rank spends around each all-gather and reduce-scatter of an
            FSDP unit (ZeRO-3), besides the wire time: FSDP's copy-in / copy-out and hooks (on a rank with a core
            to itself). Not charged to the plain gathers of the rollout's weight sync.
        layer_overhead_s: fixed time per decoder layer each time one device runs it on one micro-batch (a forward;
            a backward counts twice, a recomputation once more; a decode micro-step once): the kernel launches and
            tails that do not shrink with the micro-batch, so small per-device micro-batches run below
            ``train_mfu`` / ``infer_mfu`` (``layer_overhead_s`` = kernels per layer x seconds per kernel).
        stage_overhead_s: fixed time per stage (generate, prepare, train) of an iteration: the driver's barrier
            and its collection and distribution of the batch between stages. The same for every placement.
        sequential_driver: the driver calls one worker group at a time and waits for it, as hybridflow's
            synchronous drivers (PPO family, ReMax, Safe-RLHF) do: sets on different devices never overlap, so a
            stage takes the sum of its sets' times, and only the running set's ranks are busy. False:
            HybridFlow's model (§6, Algorithm 1), where sets on different devices run a stage at the same time
            and the stage takes the slowest set. (An asynchronous driver that overlaps generation of the next
            batch with training is neither; the model does not describe it.)
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
    collective_overhead_s: float = 0.0
    layer_overhead_s: float = 0.0
    stage_overhead_s: float = 0.0
    sequential_driver: bool = True

    def __post_init__(self) -> None:
        fractions = {k: getattr(self, k) for k in ("train_mfu", "infer_mfu", "prefill_mfu", "gen_mbu", "gen_mfu",
                                                   "mem_usable")}
        bad = [f"{k}={v}" for k, v in fractions.items() if not 0 < v <= 1]
        if bad:
            raise SpecError(f"cost params: utilisation factors must be in (0, 1], got {', '.join(bad)}")
        overheads = {k: getattr(self, k) for k in ("decode_step_overhead_s", "call_overhead_s",
                                                   "collective_overhead_s", "layer_overhead_s",
                                                   "stage_overhead_s")}
        negative = [f"{k}={v}" for k, v in overheads.items() if v < 0]
        if negative:
            raise SpecError(f"cost params: overheads must be >= 0 s, got {', '.join(negative)}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise SpecError(f"cost params: zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")

    def optimizer_bytes_per_param(self, dtype_bytes: int) -> int:
        """Adam state per parameter: fp32 m and v, plus an fp32 master copy when weights are 16-bit."""
        return 8 + (4 if dtype_bytes < 4 else 0)


# ---------------------------------------------------------------------------------------------- compute


def train_flops(model: ModelSpec, tokens: float, recompute: bool = False) -> float:
    """FLOP of forward + backward over ``tokens`` tokens: 6·N·tokens, 8·N·tokens with recomputation (N: the
    parameters a token computes with, :attr:`ModelSpec.n_active_params`: an MoE model's routed experts only)."""
    return (8 if recompute else 6) * model.n_active_params * tokens


def forward_flops(model: ModelSpec, tokens: float) -> float:
    """FLOP of a forward pass over ``tokens`` tokens: 2·N·tokens (N: :attr:`ModelSpec.n_active_params`)."""
    return 2 * model.n_active_params * tokens


def compute_time(flops: float, n_devices: int, peak_flops: float, mfu: float) -> float:
    """Seconds for ``flops`` spread evenly over ``n_devices`` running at ``mfu`` of ``peak_flops`` each."""
    return flops / (n_devices * peak_flops * mfu)


def _ring(nbytes: float, size: int, stride: int, cluster: ClusterSpec, rounds: int) -> float:
    """A ring collective of ``rounds`` passes (2: all-reduce; 1: all-gather or reduce-scatter) over ``size``
    devices ``stride`` apart; ``nbytes``: the whole tensor (an all-reduce's input, an all-gather's output).

    Inside one node: latency + rounds·(g-1)/g · bytes / intra_bw, where the latency is paid once
    (``DeviceSpec.hop_latency`` False) or on each of the rounds·(g-1) ring steps (True). Across k nodes:
    hierarchical (the same inside each node with c members, then a ring over the nodes of the 1/c shard), where
    every device of a node does the same at once (all dp groups sync together), so the node's network moves
    rounds·(k-1)/k · bytes · stride. A group of one costs nothing.
    """
    if size <= 1:
        return 0.0
    dev = cluster.device

    def latency(base: float, members: int) -> float:
        return base * rounds * (members - 1) if dev.hop_latency else base

    per_node = max(1, min(size, cluster.devices_per_node // stride))
    if per_node >= size:
        return latency(dev.intra_latency_s, size) + rounds * (size - 1) / size * nbytes / dev.intra_bw
    k = ceil_div(size, per_node)
    intra = (latency(dev.intra_latency_s, per_node) + rounds * (per_node - 1) / per_node * nbytes / dev.intra_bw
             if per_node > 1 else 0.0)
    return (intra + latency(dev.inter_latency_s, k)
            + rounds * (k - 1) / k * nbytes * min(stride, cluster.devices_per_node) / dev.inter_bw)


def allreduce_time(nbytes: float, size: int, stride: int, cluster: ClusterSpec) -> float:
    """Seconds of one all-reduce of ``nbytes`` per member over a group of ``size`` devices ``stride`` apart:
    latency + 2(g-1)/g · bytes / bus bandwidth inside a node, hierarchical across nodes (``_ring``, 2 rounds)."""
    return _ring(nbytes, size, stride, cluster, 2)


def allgather_time(nbytes: float, size: int, stride: int, cluster: ClusterSpec) -> float:
    """Seconds of one all-gather (or reduce-scatter) of a tensor of ``nbytes`` in all, 1/size per member, over
    ``size`` devices ``stride`` apart: half an all-reduce, latency + (g-1)/g · bytes / bus bandwidth inside a
    node (``_ring``, 1 round)."""
    return _ring(nbytes, size, stride, cluster, 1)


def fsdp_units(model: ModelSpec, layout: Layout) -> int:
    """FSDP units of one pipeline stage: its decoder layers, each wrapped on its own, plus the root (embeddings,
    final norm, head) as hybridflow's ``apply_fsdp2`` wraps them."""
    return math.ceil(model.layers / layout.pp) + 1


def _fsdp_comm(model: ModelSpec, layout: Layout, gathers: int, micro_batches: int, cluster: ClusterSpec,
               params: CostParams) -> float:
    """ZeRO-3 collectives of one device: per micro-batch and per FSDP unit, ``gathers`` all-gathers (or
    reduce-scatters) over dp of the unit's share of the stage's weights, N·dtype_bytes / (tp·pp·units), each
    plus ``collective_overhead_s``."""
    if layout.dp == 1:
        return 0.0
    units = fsdp_units(model, layout)
    unit_bytes = model.n_params * cluster.device.dtype_bytes / (layout.tp * layout.pp * units)
    one = allgather_time(unit_bytes, layout.dp, layout.tp, cluster) + params.collective_overhead_s
    return micro_batches * gathers * units * one


def rank_share(busy_ranks: int, cores: int | None) -> float:
    """Share of a core that each of ``busy_ranks`` single-threaded ranks gets on a node of ``cores`` cores:
    min(1, cores / busy_ranks); 1 when ``cores`` is None (every device is its own processor).

    Raises:
        SpecError: ``busy_ranks`` < 1.
    """
    if busy_ranks < 1:
        raise SpecError(f"rank_share: busy_ranks must be >= 1, got {busy_ranks}")
    return 1.0 if cores is None else min(1.0, cores / busy_ranks)


def contended(cluster: ClusterSpec, params: CostParams, busy_ranks: int) -> tuple[ClusterSpec, CostParams]:
    """The cluster and cost parameters as seen by a group with ``busy_ranks`` busy ranks per node.

    With s = ``rank_share(busy_ranks, cluster.cores_per_node)`` < 1, a rank holds a core only a fraction s of
    the time, so everything it does on its core slows by s: peak FLOP/s, memory bandwidth and the intra-node
    collective bandwidth (gloo copies through the CPU) are multiplied by s; the intra-node collective latency
    (a ring step waits until the next rank is scheduled) and the per-decode-step, per-collective and per-layer
    CPU overheads are divided by s. The network between nodes and the driver's per-call overhead are unchanged.
    With s = 1 both come back as given.
    """
    share = rank_share(busy_ranks, cluster.cores_per_node)
    if share >= 1.0:
        return cluster, params
    dev = cluster.device
    device = dataclasses.replace(dev, peak_flops=dev.peak_flops * share, mem_bw=dev.mem_bw * share,
                                 intra_bw=dev.intra_bw * share, intra_latency_s=dev.intra_latency_s / share)
    return (dataclasses.replace(cluster, device=device),
            dataclasses.replace(params, decode_step_overhead_s=params.decode_step_overhead_s / share,
                                collective_overhead_s=params.collective_overhead_s / share,
                                layer_overhead_s=params.layer_overhead_s / share))


def _tp_comm(model: ModelSpec, layout: Layout, n_allreduce_per_layer: int, micro_batches: int, tokens_per_micro: int,
             cluster: ClusterSpec) -> float:
    """Tensor-parallel all-reduces of one device: per layer of its stage, per micro-batch."""
    if layout.tp == 1:
        return 0.0
    nbytes = tokens_per_micro * model.hidden * cluster.device.dtype_bytes
    count = math.ceil(model.layers / layout.pp) * n_allreduce_per_layer * micro_batches
    return count * allreduce_time(nbytes, layout.tp, 1, cluster)


def sp_comm_time(model: ModelSpec, layout: Layout, passes: int, micro_batches: int, tokens_per_micro: int,
                 cluster: ClusterSpec) -> float:
    """Ulysses all-to-alls of one device: per layer of its stage and per pass (forward 1, training 3), 4 of them
    (queries, keys, values to head shards; the output back), each of this rank's 1/sp of the tokens' hidden
    states (/ tp), costed as an all-gather of that size over the sp group (each rank sends (sp-1)/sp of it)."""
    if layout.sp == 1:
        return 0.0
    nbytes = tokens_per_micro / layout.sp * model.hidden * cluster.device.dtype_bytes / layout.tp
    count = math.ceil(model.layers / layout.pp) * 4 * passes * micro_batches
    return count * allgather_time(nbytes, layout.sp, layout.tp, cluster)


def ep_comm_time(model: ModelSpec, layout: Layout, passes: int, micro_batches: int, tokens_per_micro: int,
                 cluster: ClusterSpec) -> float:
    """Expert all-to-alls of one device (:mod:`hybridflow.mapping.expert_cost`): per MoE layer of its stage and per
    pass (forward 1, training 3), dispatch and combine of its 1/sp of the tokens' ``experts_per_token`` routed
    hidden states (/ tp), each costed as an all-gather of that size over the ep group (ranks tp apart)."""
    if layout.ep == 1 or not model.experts:
        return 0.0
    nbytes = tokens_per_micro / layout.sp * model.experts_per_token * model.hidden * cluster.device.dtype_bytes
    count = math.ceil(model.layers / layout.pp) * 2 * passes * micro_batches
    return count * allgather_time(nbytes / layout.tp, layout.ep, layout.tp, cluster)


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


def layer_passes(kind: str, recompute: bool) -> int:
    """Passes over each layer per micro-batch: 1 for a forward (``infer``); 3 for ``train`` (forward, and a
    backward that launches about twice the kernels), 4 with recomputation (the forward again)."""
    if kind == "infer":
        return 1
    if kind == "train":
        return 4 if recompute else 3
    raise SpecError(f"layer_passes: kind must be 'infer' or 'train', got {kind!r}")


def layer_fixed_time(model: ModelSpec, layout: Layout, micro_batches: int, passes: int, params: CostParams) -> float:
    """Fixed seconds of one device's kernels that do not scale with the micro-batch: ``micro_batches`` x
    ``passes`` x ceil(layers / pp) x ``layer_overhead_s``."""
    return micro_batches * passes * math.ceil(model.layers / layout.pp) * params.layer_overhead_s


def train_time(model: ModelSpec, layout: Layout, sequences: int, seq_len: int, cluster: ClusterSpec,
               params: CostParams, *, epochs: int = 1, updates: int = 1, micro_batch: int = 1) -> float:
    """Seconds to train on ``sequences`` sequences of ``seq_len`` tokens, ``epochs`` passes of ``updates``
    optimizer steps each.

    Each dp rank handles ceil(sequences / dp) sequences per epoch in micro-batches of ``micro_batch``; its
    stage does train_flops / (tp·pp) of them at ``train_mfu``, plus (4, or 6 with recompute) tp all-reduces per
    layer per micro-batch and 2 pipeline sends per micro-batch, all stretched by the pipeline bubble; then each
    optimizer step all-reduces the gradient shard (N / (tp·pp) elements) over dp. With ZeRO-3 (FSDP) instead,
    every micro-batch all-gathers each unit's parameters twice (forward, backward) and reduce-scatters its
    gradients (``fsdp_units``; three all-gathers of the stage's weights per micro-batch). Each micro-batch also
    pays ``layer_overhead_s`` per layer of the stage for the forward, twice for the backward and once more for the
    recomputation (``layer_passes``).
    """
    dev = cluster.device
    per_rank = ceil_div(sequences, layout.data_groups)
    micro_per_step = max(1, ceil_div(per_rank, updates * micro_batch))
    flops = train_flops(model, per_rank * seq_len * epochs / layout.sp, params.recompute) / (layout.tp * layout.pp)
    compute = flops / (dev.peak_flops * params.train_mfu)
    micro_total = micro_per_step * updates * epochs
    comm = (_tp_comm(model, layout, 6 if params.recompute else 4, micro_total, micro_batch * seq_len, cluster)
            + sp_comm_time(model, layout, 3, micro_total, micro_batch * seq_len, cluster)
            + ep_comm_time(model, layout, 3, micro_total, micro_batch * seq_len, cluster)
            + _pp_comm(model, layout, 2, micro_total, micro_batch * seq_len, cluster)
            + layer_fixed_time(model, layout, micro_total, layer_passes("train", params.recompute), params))
    if params.zero_stage >= 3:
        comm += _fsdp_comm(model, layout, 3, micro_total, cluster, params)
        sync = 0.0
    else:
        dense, expert = param_shards(model, layout)  # the experts' gradients sync over dp / ep (expert_cost.py)
        sync = allreduce_time(dense * dev.dtype_bytes, layout.dp, layout.tp, cluster)
        if expert:
            sync += allreduce_time(expert * dev.dtype_bytes, layout.dp // layout.ep, layout.tp * layout.ep, cluster)
    pipe = (compute + comm) * _bubble(micro_per_step, layout.pp)
    return pipe + sync * updates * epochs + params.call_overhead_s


def infer_time(model: ModelSpec, layout: Layout, sequences: int, seq_len: int, cluster: ClusterSpec,
               params: CostParams, *, micro_batch: int = 1) -> float:
    """Seconds of one forward pass over ``sequences`` sequences of ``seq_len`` tokens (log-probs, values,
    scores): forward_flops / devices at ``infer_mfu``, 2 tp all-reduces per layer and 1 pipeline send per
    micro-batch (with ZeRO-3, one all-gather per FSDP unit per micro-batch) and ``layer_overhead_s`` per layer per
    micro-batch, stretched by the pipeline bubble."""
    dev = cluster.device
    per_rank = ceil_div(sequences, layout.data_groups)
    micro = max(1, ceil_div(per_rank, micro_batch))
    flops = forward_flops(model, per_rank * seq_len / layout.sp) / (layout.tp * layout.pp)
    compute = flops / (dev.peak_flops * params.infer_mfu)
    comm = (_tp_comm(model, layout, 2, micro, micro_batch * seq_len, cluster)
            + sp_comm_time(model, layout, 1, micro, micro_batch * seq_len, cluster)
            + ep_comm_time(model, layout, 1, micro, micro_batch * seq_len, cluster)
            + _pp_comm(model, layout, 1, micro, micro_batch * seq_len, cluster)
            + layer_fixed_time(model, layout, micro, layer_passes("infer", False), params))
    if params.zero_stage >= 3:
        comm += _fsdp_comm(model, layout, 1, micro, cluster, params)
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
    all-reduces per layer, a pipeline send and ``layer_overhead_s`` per layer of the stage; a decode step takes
    max(u, pp) micro-steps plus ``decode_step_overhead_s``. A prefill pays ``layer_overhead_s`` per layer once.

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
    comm += math.ceil(model.layers / layout.pp) * params.layer_overhead_s
    prefill += model.layers * params.layer_overhead_s
    step = max(u, layout.pp) * (max(t_mem, t_flop) + comm) + params.decode_step_overhead_s
    seconds = waves * (prefill + response_len * step) + params.call_overhead_s
    return GenerateEstimate(seconds, waves, batch, batch * kv_tok * (prompt_len + response_len))


def reshard_time(model: ModelSpec, train: Layout, gen: Layout, cluster: ClusterSpec,
                 params: CostParams | None = None) -> float:
    """Seconds of the 3D-HybridEngine's switch from the training layout to the generation layout (HybridFlow
    §5): each device all-gathers the weights its generation shard adds to its training shard,
    N·dtype_bytes·(1/(tp_g·pp_g) - 1/(tp·pp)) bytes, inside its micro-dp group (a node's network carries the
    gathers of all its devices when the group spans nodes). Zero when the generation shard is no larger.

    With ZeRO-3 (``params.zero_stage`` 3) the training shard is also split over dp, so the generation shard
    (N·dtype_bytes / (tp_g·pp_g)) is all-gathered from the g = tp·pp·dp / (tp_g·pp_g) devices that hold it,
    tensor by tensor (``ModelSpec.n_tensors`` all-gathers; hybridflow's weight sync iterates the state dict).
    """
    dev = cluster.device
    if params is not None and params.zero_stage >= 3 and train.dp > 1:
        group = train.size // (gen.tp * gen.pp)
        gen_bytes = model.n_params * dev.dtype_bytes / (gen.tp * gen.pp)
        return model.n_tensors * allgather_time(gen_bytes / model.n_tensors, group, 1, cluster)
    extra = model.n_params * dev.dtype_bytes * (1 / (gen.tp * gen.pp) - 1 / (train.tp * train.pp))
    if extra <= 0:
        return 0.0
    if train.tp * train.pp <= cluster.devices_per_node:
        return dev.intra_latency_s + extra / dev.intra_bw
    return dev.inter_latency_s + extra * cluster.devices_per_node / dev.inter_bw


def gen_extra_weight_bytes(model: ModelSpec, train: Layout | None, gen: Layout, dtype_bytes: int,
                           zero_stage: int = 0) -> float:
    """Weight bytes per device that generation adds on top of the persistent shard, N·dtype_bytes / (tp·pp),
    / dp more with ZeRO-3 (the whole generation shard for a model without a training layout)."""
    gen_shard = model.n_params * dtype_bytes / (gen.tp * gen.pp)
    if train is None:
        return gen_shard
    train_shards = train.tp * train.pp * (train.dp if zero_stage >= 3 else 1)
    return max(0.0, gen_shard - model.n_params * dtype_bytes / train_shards)


# ---------------------------------------------------------------------------------------------- memory


def model_state_bytes(model: ModelSpec, layout: Layout, trained: bool, dtype_bytes: int,
                      params: CostParams) -> dict[str, float]:
    """Persistent bytes per device: ``weights``, ``grads`` and ``optimizer`` (zero for a model that is not
    trained). The model is split N / (tp·pp) per device; ZeRO stage z further divides by dp the optimizer
    (z >= 1), gradients (z >= 2) and weights (z >= 3, also for inference-only models). With expert parallelism
    (``layout.ep``) an MoE model's experts are split over ep more ranks and ZeRO shards them over dp / ep
    (:mod:`hybridflow.mapping.expert_cost`)."""
    dense, expert = param_shards(model, layout)
    z, dp, edp = params.zero_stage, layout.dp, layout.dp // layout.ep

    def per_device(bytes_per_param: float, stage: int) -> float:
        return bytes_per_param * (dense / (dp if z >= stage else 1) + expert / (edp if z >= stage else 1))

    weights = per_device(dtype_bytes, 3)
    if not trained:
        return {"weights": weights, "grads": 0.0, "optimizer": 0.0}
    grads = per_device(dtype_bytes, 2)
    optimizer = per_device(params.optimizer_bytes_per_param(dtype_bytes), 1)
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
    logits and their gradient for one micro-batch (vocab / tp wide; 1 for a value head). Ulysses (``layout.sp``)
    splits the micro-batch's tokens over sp ranks, so everything here is per 1/sp of them.
    """
    tokens = ceil_div(micro_batch * seq_len, layout.sp)  # Ulysses: each rank holds 1/sp of the tokens
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
    micro-batch (1/sp of its tokens with Ulysses)."""
    tokens = ceil_div(micro_batch * seq_len, layout.sp)
    return _layer_activation_bytes(model, tokens, layout, dtype_bytes) + _logit_bytes(model, tokens, layout)
