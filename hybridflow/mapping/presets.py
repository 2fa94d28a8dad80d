"""Named cost-parameter sets of the auto-mapper, and the plausible range of each parameter (for the sensitivity
report, ``hybridflow.mapping.sensitivity``).

- ``cpu``: the dataclass defaults (no fixed overheads, the sequential driver). ``benchmarks/automap_cpu_ranking.py``
  starts from these (with ZeRO-3 and no recomputation, as the quickstart runs) and calibrates its overheads on this
  machine; nothing here changes its estimates.
- ``a100-paper``: the HybridFlow paper's testbed and execution model (Sheng et al. 2024, arXiv 2409.19256, §8.1:
  A100-80G nodes of 8 GPUs with 600 GB/s NVLink, 200 Gb/s between nodes; §6: models on different devices run a
  stage at the same time). Device numbers come from the ``A100-80G`` device preset (NVIDIA A100 datasheet: 312
  TFLOP/s dense bf16, 2.0 TB/s HBM2e, 80 GB). One set for every model size and cluster size: nothing is tuned per
  case.

Every value of ``a100-paper`` with its source (``PAPER_SOURCES``) and its plausible range (``KNOBS``). Where no
public number exists the value is an order-of-magnitude assumption and says so; the sensitivity report shows
whether a recommendation depends on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.mapping.cost import CostParams
from hybridflow.mapping.specs import lookup_preset

__all__ = ["COST_PRESETS", "KNOBS", "Knob", "PAPER_SOURCES", "get_cost_preset"]

PAPER_A100 = CostParams(
    train_mfu=0.45,  # Megatron-LM on A100: 44-52 % of peak for GPT 1.7B-1T (Narayanan et al. 2021, Table 1)
    infer_mfu=0.5,  # forward only over full 2048-token sequences: no backward, same GEMM shapes as training
    prefill_mfu=0.5,  # as infer_mfu (the prompt pass is a forward over 1024-token prompts)
    gen_mbu=0.7,  # decode reads weights and KV cache at ~70 % of HBM bandwidth (assumption; range 0.5-0.85)
    gen_mfu=0.5,  # a decode step with a batch large enough to be compute-bound (as prefill_mfu)
    mem_usable=0.9,  # 10 % for the CUDA context, NCCL buffers and fragmentation (assumption; vLLM's default
    # gpu_memory_utilization is 0.9)
    zero_stage=1,  # the paper trains with Megatron-LM: distributed optimizer (optimizer states sharded over dp)
    recompute=True,  # activation checkpointing, as Megatron-LM runs models of this size
    decode_step_overhead_s=2e-3,  # vLLM's per-step CPU work (scheduling, input preparation, sampling): a few ms
    # (assumption; range 0.5-10 ms)
    call_overhead_s=0.1,  # a model call through the single controller: Ray dispatch, moving ~40 MB of tokens,
    # masks and outputs, CUDA synchronisation (assumption; range 0.01-1 s)
    layer_overhead_s=5e-5,  # ~12 kernels per decoder layer x ~4 us launch latency and tail each (CUDA kernel
    # launch latency is a few us: NVIDIA, "Getting Started with CUDA Graphs", 2019)
    stage_overhead_s=0.1,  # the driver's barrier and batch hand-over between stages (assumption; equal for all
    # placements, so it changes speedups but not choices)
    sequential_driver=False,  # the paper's model (§6): sets on different devices run a stage at the same time
)

COST_PRESETS: dict[str, CostParams] = {"cpu": CostParams(), "a100-paper": PAPER_A100}

PAPER_SOURCES: dict[str, str] = {
    "train_mfu": "Megatron-LM on A100, 44-52 % of peak (Narayanan et al. 2021)",
    "infer_mfu": "forward over full sequences, as training's GEMMs without backward (assumption)",
    "gen_mbu": "decode at ~70 % of HBM bandwidth (assumption)",
    "mem_usable": "CUDA context, NCCL buffers, fragmentation; vLLM's gpu_memory_utilization 0.9",
    "decode_step_overhead_s": "vLLM per-step CPU work, a few ms (assumption)",
    "call_overhead_s": "single-controller dispatch + data movement + sync per call (assumption)",
    "layer_overhead_s": "~12 kernels x ~4 us launch latency per layer (NVIDIA CUDA Graphs blog)",
    "stage_overhead_s": "driver barrier per stage (assumption; placement-neutral)",
    "device.inter_bw": "200 Gb/s per node (paper §8.1); range 100-800 Gb/s (1-4 HDR links)",
    "device.intra_latency_s": "NCCL small all-reduce inside an NVLink node, ~10 us",
    "device.inter_latency_s": "NCCL small all-reduce across IB nodes, ~30 us",
    "device.mem_bw": "A100-80G HBM2e 2.0 TB/s (datasheet)",
    "sequential_driver": "False: the paper's model; True: hybridflow's synchronous drivers",
}


@dataclass(frozen=True)
class Knob:
    """One parameter varied for the sensitivity report: ``name`` is a ``CostParams`` field or ``device.<field>``
    (a ``DeviceSpec`` field of the cluster's device); ``values``: the ends (or the choices) of its plausible
    range."""

    name: str
    values: tuple[float | bool, ...]

    @property
    def on_device(self) -> bool:
        return self.name.startswith("device.")

    @property
    def field(self) -> str:
        return self.name.split(".", 1)[1] if self.on_device else self.name


KNOBS: tuple[Knob, ...] = (
    Knob("train_mfu", (0.35, 0.55)),
    Knob("infer_mfu", (0.35, 0.6)),
    Knob("gen_mbu", (0.5, 0.85)),
    Knob("mem_usable", (0.8, 0.95)),
    Knob("decode_step_overhead_s", (0.5e-3, 10e-3)),
    Knob("call_overhead_s", (0.01, 1.0)),
    Knob("layer_overhead_s", (1e-5, 2e-4)),
    Knob("device.inter_bw", (100e9 / 8, 800e9 / 8)),
    Knob("device.intra_latency_s", (5e-6, 30e-6)),
    Knob("device.inter_latency_s", (10e-6, 100e-6)),
    Knob("sequential_driver", (True,)),
)


def get_cost_preset(name: str) -> CostParams:
    """The cost-parameter preset ``name`` (``cpu``, ``a100-paper``; case-insensitive).

    Raises:
        SpecError: unknown name; the message lists the presets.
    """
    return lookup_preset(COST_PRESETS, name, "cost preset")
