"""Measuring the tensor memory a block of code allocates, on any device (CPU included, where torch keeps no
allocator statistics).

:class:`TensorMemoryTracker` is a ``TorchDispatchMode``: every operator output that does not alias an input
(a fresh allocation) is counted until the last tensor viewing its storage (views made inside the block
included) is freed; views and in-place results of memory allocated before the block are not counted.
``peak_bytes`` is the largest live total inside the block. Storage that collectives or libraries allocate
outside torch tensors (e.g. transport buffers) is not seen.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["TensorMemoryTracker"]


class TensorMemoryTracker(TorchDispatchMode):
    """``with TensorMemoryTracker() as mem: ...`` then ``mem.peak_bytes`` / ``mem.live_bytes`` (bytes of
    tensors allocated inside the block, at the peak / still alive at the end)."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._refs: dict[int, list[int]] = {}  # storage data_ptr -> [tracked tensors alive, bytes]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        flat, _ = tree_flatten(out)
        for i, tensor in enumerate(flat):
            aliases = i < len(returns) and returns[i].alias_info is not None
            if isinstance(tensor, torch.Tensor):
                self._track(tensor, fresh=not aliases)
        return out

    def _track(self, tensor: torch.Tensor, fresh: bool) -> None:
        try:
            storage = tensor.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
        except RuntimeError:  # a wrapper subclass without storage (e.g. an async collective's result)
            return
        if not key or not nbytes:
            return
        entry = self._refs.get(key)
        if entry is None:
            if not fresh:  # a view of memory allocated before the block
                return
            self._refs[key] = [1, nbytes]
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        else:
            entry[0] += 1
        weakref.finalize(tensor, self._release, key)

    def _release(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live_bytes -= entry[1]
            del self._refs[key]
