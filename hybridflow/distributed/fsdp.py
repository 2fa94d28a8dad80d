"""FSDP2 (``torch.distributed.fsdp.fully_shard``) wrapping, full-weight iteration and host offload."""

from __future__ import annotations

import os
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor


def apply_fsdp2(model: torch.nn.Module, mesh: DeviceMesh, reshard_after_forward: bool = True,
                mp_policy=None) -> torch.nn.Module:
    """Shard ``model`` over the 1-D ``mesh`` (the dp axis): every decoder block (the classes a HF model lists
    in ``_no_split_modules``) is its own FSDP unit, then the root (embeddings, norm, heads). ``mp_policy``: an
    FSDP2 ``MixedPrecisionPolicy`` (None: compute in the parameters' dtype; see
    :mod:`hybridflow.distributed.precision`).

    Parameter names are unchanged (FSDP2 swaps parameters for DTensors in place), so HF names still address
    them. Tied input/output embeddings stay tied.
    """
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    kwargs = {"mp_policy": mp_policy} if mp_policy is not None else {}
    for module in model.modules():
        if type(module).__name__ in block_names:
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, **kwargs)
    return model


#: ``reshard_after_forward=auto`` keeps a model's gathered weights between forward and backward when they take at
#: most this share of a rank's memory
UNSHARDED_MEMORY_SHARE = 1 / 16


def rank_memory_bytes(device: str) -> int:
    """Memory one rank may count on: the current GPU's total, or on CPU the host's RAM over the ranks that may
    share it (``LOCAL_WORLD_SIZE``, else the whole world's size)."""
    if device == "cuda":
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or (dist.get_world_size() if dist.is_initialized() else 1))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, local)


def fits_unsharded(model: torch.nn.Module, device: str, copies: int = 1) -> bool:
    """Whether ``copies`` x ``model``'s full weight bytes fit in ``UNSHARDED_MEMORY_SHARE`` of a rank's memory
    (:func:`rank_memory_bytes`): the size rule of the ``auto`` settings that keep weights whole on a rank."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return copies * weight_bytes <= UNSHARDED_MEMORY_SHARE * rank_memory_bytes(device)


def resolve_reshard_after_forward(setting: str, model: torch.nn.Module, device: str, param_offload: bool,
                                  lora: bool = False) -> bool:
    """FSDP2's ``reshard_after_forward`` from ``fsdp_config.reshard_after_forward`` (``auto``, ``true``,
    ``false``, any case).

    ``true``: each unit frees its gathered weights after its forward and gathers them again for the backward
    (ZeRO-3: least memory, one more all-gather per unit and micro-batch). ``false``: the gathered weights stay until
    the backward is done (ZeRO-2-like; a frozen model, which has no backward, then keeps them: it is in effect
    replicated after its first forward). ``auto``: ``false`` when the full weights take at most
    ``UNSHARDED_MEMORY_SHARE`` of the rank's memory (:func:`rank_memory_bytes`), the parameters are not offloaded
    and the model has no LoRA adapters, else ``true``. (With LoRA, kept weights broke the adapters' gradients after
    the rollout's merged-weight sync in an end-to-end run: ``tests/trainer/test_lora_e2e.py``.)

    Raises:
        ValueError: another value, or ``false`` with ``lora``.
    """
    value = str(setting).lower()
    if value == "false" and lora:
        raise ValueError("fsdp_config.reshard_after_forward=false is not supported with LoRA adapters "
                         "(lora_rank > 0): use auto or true")
    if value in ("true", "false"):
        return value == "true"
    if value != "auto":
        raise ValueError(f"fsdp_config.reshard_after_forward must be auto, true or false, got {setting!r}")
    if lora:
        return True
    return param_offload or not fits_unsharded(model, device)


def iter_full_state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` for every parameter and buffer, gathering DTensor shards one at a time.

    Every rank of the mesh must consume the iterator in the same order (each DTensor gather is a
    collective). Peak extra memory is one full tensor.
    """
    for name, tensor in model.state_dict().items():
        yield name, (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor)


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    """Clip the global gradient norm (across all shards) to ``max_norm``; returns the pre-clip norm.

    A non-finite norm is returned as is and the gradients are left untouched, so the caller can skip the step.
    With tensor parallelism the gradients live on two meshes (2-D ``(dp, tp)`` for split weights, 1-D ``dp`` for
    replicated ones); each group's norm is reduced on its own mesh, then the groups are combined.
    """
    groups: dict[object, list[torch.nn.Parameter]] = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = []
    for params in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return 0.0
    norm = torch.linalg.vector_norm(torch.stack(norms)) if len(norms) > 1 else norms[0]
    if torch.isfinite(norm):
        for params in groups.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm)


def offload_module(model: torch.nn.Module) -> None:
    """Move parameters (and grads) to host memory; a no-op on CPU."""
    if next(model.parameters()).device.type != "cpu":
        model.to("cpu")


def onload_module(model: torch.nn.Module, device: str) -> None:
    """Bring parameters back to ``device``; a no-op when they are already there."""
    if next(model.parameters()).device.type != device:
        model.to(device)


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: str) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device.type != device:
                state[key] = value.to(device, non_blocking=True)


def offload_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Move the optimizer state (Adam moments) to host memory."""
    _move_optimizer_state(optimizer, "cpu")


def onload_optimizer(optimizer: torch.optim.Optimizer, device: str) -> None:
    """Move the optimizer state back to ``device``."""
    _move_optimizer_state(optimizer, device)
