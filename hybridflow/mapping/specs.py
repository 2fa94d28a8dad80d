"""What the auto-mapper plans for: devices and clusters, model shapes, and the RL workload.

Units used throughout ``hybridflow.mapping``: seconds, bytes, FLOP and FLOP/s, bytes/s; "device" is one GPU (or
one CPU rank: a process with one intra-op thread). Every spec is a frozen dataclass, so specs can key caches.

Presets: devices ``A100-80G``, ``H100``, ``H200``, ``cpu`` (``DEVICE_PRESETS``); models ``7B``, ``13B``,
``34B``, ``70B`` (Llama-2 shapes; 34B is the Code Llama 34B shape with vocab 32000), ``Qwen3-30B-A3B`` (a
mixture of experts) and ``tiny-arith`` (the model shipped with hybridflow) (``MODEL_PRESETS``). ``get_model`` also reads a local Hugging Face
``config.json``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hybridflow.mapping.flows import RolesByAlgorithm

__all__ = [
    "ALGORITHMS", "ClusterSpec", "DEVICE_PRESETS", "DeviceSpec", "MODEL_PRESETS", "ModelSpec", "SpecError",
    "Workload", "get_device", "get_model", "parse_cluster",
]

GB = 1e9


class SpecError(ValueError):
    """A device, cluster, model or workload description is malformed or unknown (the message says which)."""


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or one CPU rank) and its links.

    Attributes:
        name: preset name.
        peak_flops: dense matmul peak in the compute dtype, FLOP/s.
        mem_bw: device memory bandwidth, bytes/s (what a memory-bound decode step reads at).
        mem_bytes: device memory, bytes.
        intra_bw: per-device bus bandwidth of collectives inside a node (NVLink; gloo for CPU), bytes/s.
        inter_bw: network bandwidth of one node to the others (all its NICs together), bytes/s.
        intra_latency_s: fixed cost of one collective inside a node (of one ring step with ``hop_latency``), s.
        inter_latency_s: fixed cost of one collective across nodes (of one ring step with ``hop_latency``), s.
        dtype_bytes: bytes per element of weights, activations and KV cache (2: bf16 on GPU, 4: fp32 on CPU).
        hop_latency: the latencies are paid on every step of a ring collective (2(g-1) steps for an all-reduce
            of g members, g-1 for an all-gather or reduce-scatter), as gloo's ring algorithms do on CPU; False:
            once per collective (NCCL's small messages, the paper's model).
    """

    name: str
    peak_flops: float
    mem_bw: float
    mem_bytes: float
    intra_bw: float
    inter_bw: float
    intra_latency_s: float
    inter_latency_s: float
    dtype_bytes: int = 2
    hop_latency: bool = False


DEVICE_PRESETS: dict[str, DeviceSpec] = {
    # Datasheet numbers: dense bf16 peak; NVLink total (both directions) halved for one direction. A100 nodes
    # talk over 200 Gb/s each (the HybridFlow paper's cluster); H100/H200 nodes over 8 x 400 Gb/s (DGX).
    "A100-80G": DeviceSpec("A100-80G", 312e12, 2.0e12, 80 * GB, 600e9 / 2, 200e9 / 8, 10e-6, 30e-6),
    "H100": DeviceSpec("H100", 989e12, 3.35e12, 80 * GB, 900e9 / 2, 8 * 400e9 / 8, 10e-6, 30e-6),
    "H200": DeviceSpec("H200", 989e12, 4.8e12, 141 * GB, 900e9 / 2, 8 * 400e9 / 8, 10e-6, 30e-6),
    # One rank (one process, one intra-op thread: one core) of the 2-core, 24 GB development machine, measured
    # with torch 2.13: a 1024^3 fp32 matmul runs at ~115 GFLOP/s with 2 threads (so half per core); a 256 MB
    # tensor copy moves ~21 GB/s read+write (half per core); memory is split between 2 ranks; gloo all-reduce
    # of 64 MB between 2 local processes: ~0.9 GB/s bus bandwidth, a 1 KB all-reduce ~1.4 ms (a loaded
    # machine), i.e. 0.7 ms per ring step (2 steps for 2 ranks; ~0.3-0.4 ms on a lightly loaded machine).
    # Ranks that outnumber the cores share them: ``ClusterSpec.cores_per_node`` (``hybridflow.mapping.cost.
    # contended`` slows a rank's rates and stretches its ring steps by its share of a core).
    "cpu": DeviceSpec("cpu", 115e9 / 2, 21e9 / 2, 24 * GB / 2, 0.9e9, 0.9e9, 0.7e-3, 0.7e-3, dtype_bytes=4,
                      hop_latency=True),
}


def lookup_preset(presets: dict, name: str, what: str):
    """``presets[name]``, the name compared case-insensitively.

    Raises:
        SpecError: unknown name; the message says ``what`` it is and lists the presets.
    """
    for key, value in presets.items():
        if key.lower() == name.lower():
            return value
    raise SpecError(f"unknown {what} {name!r}; presets: {', '.join(presets)}")


def get_device(name: str) -> DeviceSpec:
    """The preset device ``name`` (case-insensitive).

    Raises:
        SpecError: unknown name; the message lists the presets.
    """
    return lookup_preset(DEVICE_PRESETS, name, "device")


@dataclass(frozen=True)
class ClusterSpec:
    """``nodes`` machines of ``devices_per_node`` identical devices each.

    ``cores_per_node``: for CPU ranks, the cores that one node's ranks share (each rank runs one intra-op
    thread); None: every device is a processor of its own (GPUs, or one core per CPU rank).
    """

    nodes: int
    devices_per_node: int
    device: DeviceSpec
    cores_per_node: int | None = None

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.devices_per_node < 1:
            raise SpecError(f"a cluster needs >= 1 node and >= 1 device per node, got {self.nodes} x "
                            f"{self.devices_per_node}")
        if self.cores_per_node is not None and self.cores_per_node < 1:
            raise SpecError(f"a cluster's cores_per_node must be >= 1 (or None), got {self.cores_per_node}")

    @property
    def n_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def __str__(self) -> str:
        cores = "" if self.cores_per_node is None else f"@{self.cores_per_node}"
        return f"{self.nodes}x{self.devices_per_node}:{self.device.name}{cores}"


def parse_cluster(text: str) -> ClusterSpec:
    """Parse ``NODESxDEVICES:PRESET[@CORES]``, e.g. ``16x8:A100-80G``, ``1x4:cpu`` or ``1x4:cpu@2`` (4 CPU ranks
    sharing 2 cores per node: ``ClusterSpec.cores_per_node``).

    Raises:
        SpecError: not of that form, or an unknown device preset.
    """
    match = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*:\s*([^\s@]+)\s*(?:@\s*(\d+)\s*)?", text)
    if not match:
        raise SpecError(f"cluster {text!r}: expected NODESxDEVICES:DEVICE[@CORES], e.g. 16x8:A100-80G, 1x4:cpu "
                        f"or 1x4:cpu@2")
    cores = int(match[4]) if match[4] is not None else None
    return ClusterSpec(int(match[1]), int(match[2]), get_device(match[3]), cores)


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer (Llama family: gated MLP, grouped-query attention).

    ``value_head``: the LM head (vocab x hidden) is replaced by a scalar head (critic, reward and cost models).
    ``max_positions``: the longest sequence it takes (``max_position_embeddings``; None: unknown).

    Mixture of experts (``experts`` > 0; Qwen3-MoE / Qwen2-MoE / Mixtral): every layer's MLP is ``experts`` gated
    MLPs of ``moe_intermediate`` hidden units, a router (hidden x experts) and optionally a shared expert of
    ``shared_intermediate`` units; each token runs ``experts_per_token`` of them. Memory counts every parameter
    (:attr:`n_params`), compute the ones a token runs (:attr:`n_active_params`).
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False
    value_head: bool = False
    max_positions: int | None = None
    experts: int = 0  # routed experts per layer (0: a dense model)
    experts_per_token: int = 0  # top-k
    moe_intermediate: int = 0  # hidden units of one expert
    shared_intermediate: int = 0  # hidden units of the shared expert (Qwen2-MoE); 0: none
    attention_head_dim: int | None = None  # a head's width when it is not hidden / heads (Qwen3: 128); None: that

    def __post_init__(self) -> None:
        if min(self.layers, self.hidden, self.heads, self.kv_heads, self.intermediate, self.vocab) < 1:
            raise SpecError(f"model {self.name}: every size must be >= 1, got {self}")
        if self.experts and not (1 <= self.experts_per_token <= self.experts and self.moe_intermediate >= 1):
            raise SpecError(f"model {self.name}: an MoE model needs 1 <= experts_per_token <= experts and "
                            f"moe_intermediate >= 1, got {self.experts_per_token}, {self.experts}, "
                            f"{self.moe_intermediate}")
        if (self.attention_head_dim is None and self.hidden % self.heads) or self.heads % self.kv_heads:
            raise SpecError(f"model {self.name}: hidden ({self.hidden}) must be divisible by heads ({self.heads}) "
                            f"and heads by kv_heads ({self.kv_heads})")

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden // self.heads

    def _layer_params(self, experts: int) -> int:
        """One decoder layer's q, k, v, o projections, two RMSNorms and its MLP: the gated MLP, or with
        ``experts`` of the MoE's experts counted (the router and the shared expert always)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        mlp = 3 * h * self.intermediate
        if self.experts:
            mlp = experts * 3 * h * self.moe_intermediate + 3 * h * self.shared_intermediate + h * self.experts
        return 2 * h * q + 2 * h * kv + mlp + 2 * h

    @functools.cached_property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: q, k, v, o projections, the MLP (every expert), two RMSNorms."""
        return self._layer_params(self.experts)

    def _total(self, layer_params: int) -> int:
        head = self.hidden if self.value_head else (0 if self.tied_embeddings else self.vocab * self.hidden)
        return self.vocab * self.hidden + self.layers * layer_params + self.hidden + head

    @functools.cached_property
    def n_params(self) -> int:
        """All parameters (what memory holds): embedding, layers, final norm, and the LM head (or a scalar value
        head)."""
        return self._total(self.layer_params)

    @functools.cached_property
    def n_active_params(self) -> int:
        """Parameters one token computes with (what FLOP count): :attr:`n_params` with only ``experts_per_token``
        experts per MoE layer; :attr:`n_params` for a dense model."""
        return self._total(self._layer_params(self.experts_per_token)) if self.experts else self.n_params

    @property
    def n_tensors(self) -> int:
        """Parameter tensors: 9 per layer (q, k, v, o; gate, up, down; 2 norms), the embedding, the final norm,
        and the LM head unless tied (a value head is one more tensor)."""
        head = 1 if self.value_head or not self.tied_embeddings else 0
        return 9 * self.layers + 2 + head

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV-cache bytes of one token over all layers: 2 (K and V) x layers x kv_heads x head_dim x dtype_bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def as_value_model(self) -> "ModelSpec":
        """The same backbone with a scalar value head (a critic, reward or cost model)."""
        return dataclasses.replace(self, value_head=True)

    @classmethod
    def from_hf_config(cls, config: dict, name: str = "hf") -> "ModelSpec":
        """Build from a Hugging Face ``config.json`` mapping (Llama / Qwen / Mistral key names).

        Raises:
            SpecError: a required key is missing (the message names it).
        """
        def need(key: str) -> int:
            if key not in config:
                raise SpecError(f"model config {name}: missing {key!r} (expected a Llama-style HF config.json)")
            return int(config[key])

        heads = need("num_attention_heads")
        experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)  # Qwen-MoE | Mixtral
        moe = dict(experts=experts, experts_per_token=int(config.get("num_experts_per_tok") or 0),
                   moe_intermediate=int(config.get("moe_intermediate_size") or config.get("intermediate_size") or 0),
                   shared_intermediate=int(config.get("shared_expert_intermediate_size") or 0)) if experts else {}
        head_dim = config.get("head_dim")
        if head_dim is not None and int(head_dim) * heads != need("hidden_size"):
            moe["attention_head_dim"] = int(head_dim)
        return cls(name=name, layers=need("num_hidden_layers"), hidden=need("hidden_size"), heads=heads,
                   kv_heads=int(config.get("num_key_value_heads") or heads), intermediate=need("intermediate_size"),
                   vocab=need("vocab_size"), tied_embeddings=bool(config.get("tie_word_embeddings", False)),
                   max_positions=config.get("max_position_embeddings"), **moe)


MODEL_PRESETS: dict[str, ModelSpec] = {  # max_positions: Llama 2 4096, Code Llama 16384 (their config.json)
    "7B": ModelSpec("7B", 32, 4096, 32, 32, 11008, 32000, max_positions=4096),
    "13B": ModelSpec("13B", 40, 5120, 40, 40, 13824, 32000, max_positions=4096),
    "34B": ModelSpec("34B", 48, 8192, 64, 8, 22016, 32000, max_positions=16384),
    "70B": ModelSpec("70B", 80, 8192, 64, 8, 28672, 32000, max_positions=4096),
    # hybridflow/models/builtin (vocab: its 512-token tokenizer padded to a multiple of 64; 256 positions)
    "tiny-arith": ModelSpec("tiny-arith", 4, 128, 4, 2, 384, 512, tied_embeddings=True, max_positions=256),
    # Qwen3-30B-A3B's config.json: 128 experts of 768 units, top-8, heads of 128 (30.5B parameters, 3.3B active)
    "Qwen3-30B-A3B": ModelSpec("Qwen3-30B-A3B", 48, 2048, 32, 4, 6144, 151936, max_positions=40960, experts=128,
                               experts_per_token=8, moe_intermediate=768, attention_head_dim=128),
}


def get_model(name_or_path: str) -> ModelSpec:
    """A preset (``7B``, ``13B``, ``34B``, ``70B``, ``Qwen3-30B-A3B``, ``tiny-arith``; case-insensitive), or the ``config.json`` of a
    local Hugging Face model directory (a path to the directory or to the file; ``builtin:NAME`` is resolved, and so
    is a hub id ``org/name``, as training resolves it: the hub cache, downloading unless ``HF_HUB_OFFLINE=1``).

    Raises:
        SpecError: neither a preset nor a readable config; the message lists the presets. A hub id that cannot be
            had locally: the hub's one line (offline and not cached, unknown, gated).
    """
    for key, spec in MODEL_PRESETS.items():
        if key.lower() == name_or_path.lower():
            return spec
    path = Path(name_or_path)
    from hybridflow.models.builtin import is_hub_id, resolve_model_path

    if name_or_path.startswith("builtin:") or is_hub_id(name_or_path):  # a hub id: its cached (or fetched) snapshot
        try:
            path = Path(resolve_model_path(name_or_path))
        except (ValueError, FileNotFoundError) as exc:
            raise SpecError(str(exc)) from None
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise SpecError(f"model {name_or_path!r}: not a preset ({', '.join(MODEL_PRESETS)}) and no config.json "
                        f"at {path}")
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecError(f"model {name_or_path!r}: cannot read {path}: {exc}") from None
    return ModelSpec.from_hf_config(config.get("text_config", config), name=str(name_or_path))


#: algorithm -> the roles whose models it runs (``Workload.algorithm``; a view of the dataflow registry)
ALGORITHMS: Mapping[str, tuple[str, ...]] = RolesByAlgorithm()


@dataclass(frozen=True)
class Workload:
    """One RL iteration.

    Attributes:
        algorithm: a registered planned algorithm (:mod:`hybridflow.mapping.flows`: ``ppo`` | ``remax`` |
            ``safe-rlhf`` | ``grpo`` and any a plugin registers).
        batch: prompts per iteration.
        n: responses sampled per prompt (GRPO's group size).
        prompt_len, response_len: tokens per prompt and per response (responses run to full length).
        ppo_epochs: passes over the iteration's sequences in the training stage.
        ppo_updates: optimizer steps (mini-batches) per epoch.
        micro_batch: sequences per forward/backward on one data-parallel rank (sets activation memory and the
            number of pipeline micro-batches).
        forward_micro_batch: sequences per forward-only pass on one data-parallel rank (log-probs, values,
            scores; verl's ``log_prob_micro_batch_size_per_gpu``); None: ``micro_batch``.
        actor_logprob: the actor recomputes the old log-probs in the preparation stage (verl and hybridflow do).
    """

    algorithm: str = "ppo"
    batch: int = 1024
    n: int = 1
    prompt_len: int = 1024
    response_len: int = 1024
    ppo_epochs: int = 1
    ppo_updates: int = 1
    micro_batch: int = 1
    actor_logprob: bool = True
    forward_micro_batch: int | None = None

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise SpecError(f"unknown algorithm {self.algorithm!r}; known: {', '.join(ALGORITHMS)}")
        counts = {k: getattr(self, k) for k in ("batch", "n", "prompt_len", "response_len", "ppo_epochs",
                                                "ppo_updates", "micro_batch")}
        if self.forward_micro_batch is not None:
            counts["forward_micro_batch"] = self.forward_micro_batch
        bad = [f"{k}={v}" for k, v in counts.items() if v < 1]
        if bad:
            raise SpecError(f"workload: every count must be >= 1, got {', '.join(bad)}")
        if self.sequences % self.ppo_updates:
            raise SpecError(f"workload: {self.sequences} sequences (batch {self.batch} x n {self.n}) do not split "
                            f"into {self.ppo_updates} equal mini-batches (ppo_updates)")

    @property
    def sequences(self) -> int:
        """Sampled sequences per iteration: batch x n."""
        return self.batch * self.n

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def infer_micro_batch(self) -> int:
        """Sequences per forward-only micro-batch: ``forward_micro_batch``, else ``micro_batch``."""
        return self.micro_batch if self.forward_micro_batch is None else self.forward_micro_batch

    @property
    def roles(self) -> tuple[str, ...]:
        return ALGORITHMS[self.algorithm]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
