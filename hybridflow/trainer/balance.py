"""``trainer.balance_batch`` (verl's key): reorder a generated batch so that every data-parallel rank gets about
the same number of tokens.

The dispatch splits a batch into ``dp`` contiguous, equal-row chunks, one per rank; with variable response lengths
one rank can get many more tokens than another and its peers wait for it (in the collectives of an update, or for
the slowest rank's forward). Reordering the rows first (a greedy balanced partition with equal row counts: longest
row first into the chunk with the fewest tokens that still has room) evens the per-rank token sums. Every column
moves with its row; advantages group rows by ``uid``, not by position, so nothing downstream depends on the order.

When the rows come in groups of equal size (``uid``: the rollout's n samples of one prompt) and the groups split
evenly over the ranks, whole groups are balanced instead of rows, so a prompt's samples stay on one rank, next to
each other: its packed training forwards then compute that prompt once for all of them
(:mod:`hybridflow.training.shared_prompt`) instead of once per rank it was scattered to.
"""

from __future__ import annotations

import torch

from hybridflow.protocol import DataProto
from hybridflow.utils.partition import balanced_groups

__all__ = ["balance_batch", "balance_order", "balance_permutation"]


def balance_permutation(lengths: list[int], parts: int) -> list[int]:
    """A row order whose ``parts`` contiguous chunks of ``len(lengths) / parts`` rows have near-equal sums of
    ``lengths`` (greedy: rows by decreasing length, each into the chunk with the smallest sum that has room; ties to
    the lower chunk); rows keep their original order within a chunk.

    Raises:
        ValueError: ``parts < 1`` or the rows do not split into ``parts`` equal chunks.
    """
    n = len(lengths)
    if parts < 1 or n % parts:
        raise ValueError(f"balance_permutation: {n} rows do not split into {parts} equal chunks")
    return [row for chunk in balanced_groups(lengths, parts, max_items=n // parts) for row in chunk]


def balance_batch(batch: DataProto, dp_size: int) -> dict[str, float]:
    """Reorder ``batch`` in place (by its ``attention_mask`` tokens per row) for ``dp_size`` ranks; returns
    ``perf/dp_token_imbalance`` (the largest rank's tokens over the mean rank's, after: 1.0 is even; before: the
    ``_before`` key). A batch that does not split evenly, or one rank, is left as it is (``{}``)."""
    perm, metrics = balance_order(batch, dp_size)
    if perm is not None:
        batch.reorder(perm)
    return metrics


def balance_order(batch: DataProto, dp_size: int) -> tuple[torch.Tensor | None, dict[str, float]]:
    """:func:`balance_batch`'s row order (int64 ``(B,)``: new row i is old row ``perm[i]``) and metrics, without
    reordering: a result computed on the old order (e.g. a call still running) is reordered with the same
    ``perm``. ``(None, {})`` where :func:`balance_batch` leaves the batch as it is."""
    n = len(batch)
    if dp_size <= 1 or n % dp_size or "attention_mask" not in batch.batch:
        return None, {}
    lengths = batch.batch["attention_mask"].sum(-1).tolist()

    def imbalance(order: list[int]) -> float:
        size = n // dp_size
        sums = [sum(lengths[i] for i in order[c * size:(c + 1) * size]) for c in range(dp_size)]
        mean = sum(sums) / dp_size
        return max(sums) / mean if mean else 1.0

    perm = _group_permutation(batch, lengths, dp_size) or balance_permutation(lengths, dp_size)
    metrics = {"perf/dp_token_imbalance_before": imbalance(list(range(n))), "perf/dp_token_imbalance": imbalance(perm)}
    return torch.tensor(perm, dtype=torch.int64), metrics


def _group_permutation(batch: DataProto, lengths: list[int], parts: int) -> list[int] | None:
    """:func:`balance_permutation` over whole ``uid`` groups (cost: the group's tokens), each group's rows adjacent
    in their original order; None when there is no ``uid`` column, the groups differ in size, or they do not split
    evenly over ``parts`` ranks."""
    uids = batch.non_tensor_batch.get("uid")
    if uids is None:
        return None
    members: dict = {}
    for row, uid in enumerate(uids):
        members.setdefault(uid, []).append(row)
    groups = list(members.values())
    if len({len(g) for g in groups}) != 1 or len(groups) % parts or len(groups[0]) < 2:
        return None
    order = balance_permutation([sum(lengths[r] for r in g) for g in groups], parts)
    return [row for g in order for row in groups[g]]
