"""Token-budget micro-batches (``use_dynamic_bsz``): a micro-batch holds as many sequences as fit in a token budget
(``ppo_max_token_len_per_gpu``, ``log_prob_max_token_len_per_gpu``, ...) instead of a fixed number of sequences.

Plan of one (mini-)batch on one rank: the cost of a sequence is its valid tokens (``attention_mask`` sum, what a
padding-free forward computes); the rank needs k_r micro-batches, the smallest k >= ceil(total / budget) for which
the longest-processing-time-first assignment (each sequence, longest first, to the currently lightest micro-batch)
keeps every micro-batch within the budget (a sequence longer than the budget gets a micro-batch of its own). Every
rank then uses k = max over ranks of k_r (one all-reduce), so all ranks run the same number of forwards and
backwards: FSDP's per-forward gathers and per-backward reduce-scatters pair up and nothing deadlocks. A rank with
fewer sequences than k runs its extra micro-batches as *dummies*: a forward/backward of one of its rows whose loss
is multiplied by 0 (the collectives happen, the gradient is unchanged).

The mini-batch gradient does not depend on the split (:mod:`hybridflow.training.micro`: every micro-batch loss is
normalised by mini-batch totals), so any plan gives the same update.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
import torch.distributed as dist

from hybridflow.protocol import DataProto
from hybridflow.utils.partition import balanced_groups


def local_micro_count(lengths: list[int], max_tokens: int) -> int:
    """The fewest micro-batches (>= ceil(sum / max_tokens)) whose :func:`balanced_groups` all stay within
    ``max_tokens`` tokens, or one per sequence. Raises ``ValueError`` for ``max_tokens`` < 1."""
    if max_tokens < 1:
        raise ValueError(f"max token length per micro-batch must be >= 1, got {max_tokens}")
    n = len(lengths)
    k = max(1, math.ceil(sum(lengths) / max_tokens))
    while k < n and max(sum(lengths[i] for i in g) for g in balanced_groups(lengths, k)) > max_tokens:
        k += 1
    return min(k, max(n, 1))


def _max_over_ranks(value: int) -> int:
    if not dist.is_initialized():
        return value
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def micro_batch_indices(data: DataProto, micro_batch_size: int, max_tokens: int | None) -> list[torch.Tensor]:
    """Row indices (long) of each micro-batch of ``data``: consecutive chunks of ``micro_batch_size`` rows when
    ``max_tokens`` is None, else the token-budget plan of the module docstring (a collective: every rank of the
    default process group must call it for the same batch step). Empty index tensors mark dummy micro-batches."""
    n = len(data)
    if max_tokens is None:
        return list(torch.arange(n).split(micro_batch_size))
    lengths = data.batch["attention_mask"].sum(dim=1).tolist()
    k = _max_over_ranks(local_micro_count(lengths, max_tokens))
    return [torch.tensor(g, dtype=torch.long) for g in balanced_groups(lengths, k)]


def iter_micro_batches(data: DataProto, micro_batch_size: int,
                       max_tokens: int | None) -> Iterator[tuple[DataProto, bool]]:
    """``(micro-batch, is_dummy)`` over the plan of :func:`micro_batch_indices`; a dummy is ``data``'s first row,
    to be run with its loss multiplied by 0 (it only keeps this rank in step with the others)."""
    for index in micro_batch_indices(data, micro_batch_size, max_tokens):
        yield (data[index], False) if index.numel() else (data[:1], True)


def gather_in_order(parts: list[torch.Tensor], indices: list[torch.Tensor], n: int) -> torch.Tensor:
    """Put the per-micro-batch outputs ``parts`` (rows in the order of ``indices``; dummies skipped) back into the
    original row order: returns (n, ...) with row ``indices[j][i]`` = ``parts[j][i]``."""
    real = [(p, i) for p, i in zip(parts, indices) if i.numel()]
    out = torch.cat([p for p, _ in real])
    order = torch.cat([i for _, i in real])
    result = torch.empty((n, *out.shape[1:]), dtype=out.dtype, device=out.device)
    result[order.to(out.device)] = out
    return result
