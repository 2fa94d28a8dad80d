"""SPMD helpers used inside a worker group: process groups, device meshes, FSDP2 wrapping, tensor parallel."""

from hybridflow.distributed.fsdp import (
    apply_fsdp2,
    clip_grad_norm,
    iter_full_state,
    offload_module,
    onload_module,
    offload_optimizer,
    onload_optimizer,
    resolve_reshard_after_forward,
)
from hybridflow.distributed.init import (
    all_reduce_sum,
    build_mesh,
    gather_metrics,
    get_device_name,
    init_distributed,
    resolve_dtype,
)
from hybridflow.distributed.tp import apply_tp, parallelize_model

__all__ = [
    "all_reduce_sum",
    "apply_fsdp2",
    "apply_tp",
    "build_mesh",
    "clip_grad_norm",
    "gather_metrics",
    "get_device_name",
    "init_distributed",
    "iter_full_state",
    "offload_module",
    "offload_optimizer",
    "onload_module",
    "onload_optimizer",
    "parallelize_model",
    "resolve_dtype",
    "resolve_reshard_after_forward",
]
