"""Greedy balanced partitions of items with costs (longest processing time first): used for token-budget
micro-batches (:mod:`hybridflow.training.token_batches`) and for spreading a batch's tokens evenly over dp ranks
(:mod:`hybridflow.trainer.balance`). Pure Python, so the driver can use it without importing the engines."""

from __future__ import annotations

import heapq
from typing import Optional

__all__ = ["balanced_groups"]


def balanced_groups(lengths: list[int], k: int, max_items: Optional[int] = None) -> list[list[int]]:
    """Assign item ``i`` (cost ``lengths[i]``) to one of ``k`` groups, longest first to the currently lightest group
    (ties: the lower group index); with ``max_items``, a group that holds that many items takes no more. Returns
    ``k`` lists of indices, each in ascending order (some empty if k > n).

    Raises:
        ValueError: ``max_items`` is given and ``k * max_items`` is less than the number of items.
    """
    if max_items is not None and k * max_items < len(lengths):
        raise ValueError(f"balanced_groups: {len(lengths)} items do not fit in {k} groups of at most {max_items}")
    heap = [(0, g) for g in range(k)]
    groups: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        load, g = heapq.heappop(heap)
        groups[g].append(i)
        if max_items is None or len(groups[g]) < max_items:
            heapq.heappush(heap, (load + lengths[i], g))
    return [sorted(g) for g in groups]
