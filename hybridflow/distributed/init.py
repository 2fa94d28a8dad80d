"""Process-group and device-mesh set-up: gloo on CPU, NCCL on GPU, from the env the worker group sets."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def get_device_name() -> str:
    """``"cuda"`` when this process sees a GPU, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(name: str, device: str | None = None) -> torch.dtype:
    """Map a config dtype name to a torch dtype; ``auto`` is fp32 on CPU (bf16 matmul is ~400x slower
    there) and bf16 on GPU.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    if name == "auto":
        return torch.bfloat16 if (device or get_device_name()) == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {['auto', *_DTYPES]}")
    return _DTYPES[name]


def init_distributed(timeout_s: float = 600.0) -> None:
    """Join the worker group's default process group (idempotent).

    Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and LOCAL_RANK on GPU) from the environment, which
    :class:`hybridflow.controller.RayWorkerGroup` sets. Backend: NCCL when a GPU is visible, gloo otherwise.
    A collective that waits longer than ``timeout_s`` seconds raises instead of hanging.
    """
    if dist.is_initialized():
        return
    backend = "nccl" if get_device_name() == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))


def build_mesh(dp: int, tp: int = 1) -> DeviceMesh:
    """A DeviceMesh over the default group with named axes ``("dp",)`` or ``("dp", "tp")``.

    Raises:
        ValueError: ``dp * tp`` differs from the world size.
    """
    world = dist.get_world_size()
    if dp * tp != world:
        raise ValueError(f"layout dp={dp} x tp={tp} = {dp * tp} ranks does not match world size {world}")
    if tp == 1:
        return init_device_mesh(get_device_name(), (dp,), mesh_dim_names=("dp",))
    return init_device_mesh(get_device_name(), (dp, tp), mesh_dim_names=("dp", "tp"))


def all_reduce_sum(value: float | torch.Tensor, group=None) -> torch.Tensor:
    """Sum a scalar (or tensor) over ``group``; returns a new fp64 tensor on the collective's device.
    Without an initialised process group (a single process) it returns the value itself."""
    if not dist.is_initialized():
        return torch.as_tensor(value, dtype=torch.float64).clone()
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.as_tensor(value, dtype=torch.float64, device=device).clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_reduce_mean(values: dict[str, float], group=None) -> dict[str, float]:
    """Average every value of a metrics dict over ``group`` in one collective (same keys on every rank)."""
    if not values:
        return {}
    keys = sorted(values)
    total = all_reduce_sum(torch.tensor([float(values[k]) for k in keys], dtype=torch.float64), group)
    n = dist.get_world_size(group) if dist.is_initialized() else 1
    return {k: float(v) / n for k, v in zip(keys, total.tolist())}
