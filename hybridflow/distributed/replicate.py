"""Replicated data parallelism for models small enough to hold whole on every rank (``fsdp_config.fsdp_size=1``).

FSDP2 shards every parameter over the dp ranks and gathers it again for each forward and backward; for a small
model those gathers, the DTensor bookkeeping and the per-unit hooks cost more than the compute (measured on 2 gloo
ranks with the 0.85M-parameter tiny-arith model: a forward + backward 2x slower than the same module unwrapped,
``benchmarks/step_profile.py``). Replicated, each rank keeps plain tensors (full weights, gradients and optimizer
state, like PyTorch DDP), runs its micro-batches without any collective, and the gradients are averaged over the dp
ranks once per optimizer step (:func:`all_reduce_gradients`): the same mean the FSDP2 reduce-scatter computes, so
the applied update is the sharded engine's (tests/training/test_replicated_engine.py).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist

from hybridflow.distributed.fsdp import fits_unsharded

#: bytes per parameter byte a trained replicated model keeps on every rank: weights, gradients, AdamW's two moments
TRAINED_STATE_COPIES = 4
#: gradients are averaged in flat buffers of at most this many bytes (one all-reduce each, all started at once:
#: gloo runs them on its worker threads side by side; 104 MB on 2 CPU ranks took 0.057-0.063 s as 16 MiB buffers
#: started together against 0.076-0.079 s as 64 MiB buffers one after another)
BUCKET_BYTES = 16 << 20


def resolve_fsdp_size(setting, model: torch.nn.Module, device: str, *, trained: bool, param_offload: bool,
                      lora: bool, tp: int, dp: int) -> bool:
    """Whether the FSDP2 engine replicates ``model`` over dp (True) or shards it (False), from
    ``fsdp_config.fsdp_size`` (verl's key: the size of the group a parameter is sharded over).

    ``-1`` or ``dp``: shard over every dp rank (FSDP2). ``1``: replicate (no sharding). ``auto``: replicate when
    every rank can hold the whole training state (weights, and for a trained model gradients and AdamW moments:
    :data:`TRAINED_STATE_COPIES` x the weights) in ``UNSHARDED_MEMORY_SHARE`` of its memory
    (:func:`hybridflow.distributed.fsdp.fits_unsharded`), and nothing asks for sharding: no ``param_offload``,
    no LoRA adapters, no tensor parallelism; else shard. (bf16 compute over fp32 weights: the engine runs a
    replicated model's forwards under ``torch.autocast``.)

    Raises:
        ValueError: another value (hybrid sharding, 1 < fsdp_size < dp, is not implemented), or ``1`` with
            ``tp > 1``.
    """
    value = str(setting).lower()
    if value == "auto":
        if param_offload or lora or tp > 1:
            return False
        return fits_unsharded(model, device, TRAINED_STATE_COPIES if trained else 1)
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size == 1:
        if tp > 1:
            raise ValueError("fsdp_config.fsdp_size=1 (replicated) is not supported with tensor parallelism "
                             f"(tp={tp}): use -1 or auto")
        return True
    if size == -1 or size == dp:
        return False
    raise ValueError(f"fsdp_config.fsdp_size must be auto, -1 (shard over all {dp} dp ranks) or 1 (replicate), "
                     f"got {setting!r} (hybrid sharding is not implemented)")


class GradientBuckets:
    """The gradients of ``params`` (those that require grad) as views of flat buffers of at most
    :data:`BUCKET_BYTES` (PyTorch DDP's ``gradient_as_bucket_view``): backward accumulates into the buffers in
    place, so averaging over dp is one all-reduce per buffer with no gather or scatter copy (measured with the
    25M-parameter ``medium`` preset on 2 gloo ranks: the copies into and out of the flat buffers took ~0.9x the
    time of the all-reduce itself).

    The views stay bound between steps: :meth:`zero` clears them in place (set-to-None would drop them), and
    re-binds any parameter whose ``.grad`` was replaced or dropped (the non-finite guard sets it to None, a load may
    swap parameters). A parameter that got no gradient on this rank takes part with zeros, like its peers'."""

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.buffers: list[torch.Tensor] = []
        self.views: list[torch.Tensor] = []
        for bucket in _buckets(self.params):
            flat = torch.zeros(sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
            self.buffers.append(flat)
            self.views.extend(part.view_as(p) for p, part in zip(bucket, flat.split([p.numel() for p in bucket])))
        self._bind()  # gradients already accumulated are kept (copied into the buffers)

    def zero(self) -> None:
        """Zero the gradients in place (the start of a mini-batch), binding each parameter's ``.grad`` to its view."""
        for flat in self.buffers:
            flat.zero_()
        for p, view in zip(self.params, self.views):
            p.grad = view

    def _bind(self) -> None:
        """Point every ``.grad`` at its view, copying in a gradient that was replaced (zeros for a dropped one)."""
        for p, view in zip(self.params, self.views):
            if p.grad is not view:
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad)
                p.grad = view

    def all_reduce(self, group: Optional[dist.ProcessGroup] = None) -> None:
        """Average the gradients over ``group``'s ranks in place, one all-reduce per buffer, all started before
        the first is waited for; every rank calls it. A no-op outside a process group or with one rank."""
        self._bind()
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return
        world = dist.get_world_size(group)
        started = [dist.all_reduce(flat, group=group, async_op=True) for flat in self.buffers]  # same order on every rank
        for flat, work in zip(self.buffers, started):
            work.wait()
            flat.div_(world)


def _buckets(params: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """``params`` cut into runs of one device and dtype and at most :data:`BUCKET_BYTES` (at least one each)."""
    buckets: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        last = buckets[-1][-1] if buckets else None
        if last is None or size + nbytes > BUCKET_BYTES or (last.device, last.dtype) != (p.device, p.dtype):
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets
