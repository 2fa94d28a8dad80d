"""Collectives of Ulysses sequence parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023, "System Optimizations for
Enabling Training of Extreme Long Sequence Transformer Models", Sec. 3): the sp ranks of one data-parallel group
each hold a contiguous slice of the sequence; before attention an all-to-all turns "every head, my slice of the
sequence" into "my slice of the heads, the whole sequence", and after attention the inverse all-to-all turns it
back. Both are autograd-aware (the backward of an all-to-all is the inverse all-to-all).

The process groups: the ranks of one dp group that share a batch (:func:`new_sp_group`, rank order of
:class:`hybridflow.training.base.ParallelLayout`: tp fastest, then sp, then dp, then pp).

Works on gloo (CPU) and NCCL; no Ray, no models.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["all_to_all", "gather_sequence", "new_sp_group", "sp_group_ranks"]


def sp_group_ranks(world: int, sp: int, tp: int = 1) -> list[list[int]]:
    """The global ranks of every sp group of a ``world``-rank layout with ``sp`` sequence-parallel ranks (adjacent
    after the ``tp`` fastest): ``[[base + s * tp for s in range(sp)] ...]``.

    Raises:
        ValueError: ``sp * tp`` does not divide ``world``.
    """
    if sp < 1 or tp < 1 or world % (sp * tp):
        raise ValueError(f"sp={sp} x tp={tp} does not divide the {world} ranks")
    groups = []
    for block in range(world // (sp * tp)):
        for t in range(tp):
            groups.append([block * sp * tp + s * tp + t for s in range(sp)])
    return groups


def new_sp_group(sp: int, tp: int = 1) -> Optional[dist.ProcessGroup]:
    """This rank's sp group (a collective: every rank of the default group calls it; each group is created on all
    of them as ``dist.new_group`` requires). None for ``sp == 1``.

    Raises:
        ValueError: as :func:`sp_group_ranks`.
    """
    if sp == 1:
        return None
    rank, mine = dist.get_rank(), None
    for ranks in sp_group_ranks(dist.get_world_size(), sp, tp):
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    send = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()  # (size, ...) piece j goes to rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)  # piece i came from rank i: its slice of gather_dim


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad.contiguous(), ctx.group, gather_dim, scatter_dim), None, None, None


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``x`` into ``sp`` equal chunks along ``scatter_dim``, send chunk j to rank j of ``group``, and
    concatenate the chunks received (rank order) along ``gather_dim``. E.g. (B, H, S/sp, D) with scatter 1,
    gather 2 -> (B, H/sp, S, D). Differentiable (the backward is the inverse all-to-all).

    Raises:
        RuntimeError: ``x.shape[scatter_dim]`` is not divisible by the group size (unequal chunks).
    """
    size = dist.get_world_size(group)
    if x.shape[scatter_dim] % size:
        raise RuntimeError(f"all_to_all: dim {scatter_dim} of {tuple(x.shape)} is not divisible by {size} ranks")
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.length = group, dim, x.shape[dim]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        start = dist.get_rank(ctx.group) * ctx.length
        return grad.narrow(ctx.dim, start, ctx.length).contiguous(), None, None


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """Concatenate every sp rank's equal slice ``x`` along ``dim`` (rank order): (B, S/sp) -> (B, S).

    Gradient: the backward SUMS the output gradients of all sp ranks and returns this rank's slice. Every sp rank
    computes the same loss from the same gathered tensor, so each rank's parameter gradient is ``sp`` times its
    share of the true gradient; data-parallel averaging over the ``dp * sp`` ranks (FSDP's reduce-scatter, or the
    replicated all-reduce) then yields exactly the gradient of the dp-averaged loss, as without sp.
    """
    return _GatherSequence.apply(x, group, dim)

