"""Same-host collectives through shared memory, for the small CPU tensors of tensor-parallel decoding.

The hf rollout's generation tp group (:mod:`hybridflow.engine.tp_model`) all-reduces every layer's attention and MLP
output and all-gathers the logits, at every decode step. On CPU those tensors are tens of KB (32 rows x hidden 512
fp32 = 64 KB) and gloo's all-reduce costs 200-750 us each through its TCP transport (measured on 2 cores) -- at the
medium benchmark shape (8 layers, 128 new tokens) ~2,000 of them per generation, more than the time tp saves by
halving the weights each rank streams from memory. Here each member instead writes its tensor to its slot of one
shared-memory segment, publishes a sequence number, waits until every member has published, and reads the others'
slots directly.

- **Same bits everywhere.** Every rank sums the slots in member order (``s_0 + s_1 + ...``), so all ranks hold the
  same result and draw the same tokens from the same seed (as with gloo).
- **Double buffered.** Operations alternate between two sets of slots, so one flag wait per operation is enough:
  a member overwrites a set only after every member has published the operation after the one that read it.
- **Ordering.** The data is written before the flag and read after it is seen; x86-64's total store order keeps
  those in order, so the segment is used only there (elsewhere :meth:`ShmGroup.create` returns None and callers use
  ``torch.distributed``).
- **Fallbacks.** Tensors over the slot capacity (a long prefill), non-CPU tensors, members on different hosts, or too
  little free shared memory: the caller's ``torch.distributed`` collective runs instead.

The segment's name is unlinked as soon as every member has mapped it, so nothing is left behind if a process dies.
A member that does not arrive within ``timeout_s`` raises ``TimeoutError`` naming the missing ranks.
"""

from __future__ import annotations

import mmap
import os
import platform
import shutil
import socket
import time
import uuid
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["DEFAULT_SLOT_BYTES", "ShmGroup", "platform_supported"]

#: bytes per member and buffer: a decode step's (rows, hidden) activations up to 1 MiB (e.g. 256 x 1024 fp32)
DEFAULT_SLOT_BYTES = 1 << 20
_SHM_DIR = "/dev/shm"  # Linux's shared-memory file system
_FLAG_STRIDE = 8  # int64s per member flag: one 64-byte cache line each
_SPIN = 200  # busy polls before yielding the core
_MAX_VIEWS = 256  # cached slot views (dtype and shape combinations x buffers x members)


def platform_supported() -> bool:
    """Whether this process's platform can use the shared-memory path: Linux on x86-64 (total store order) with a
    ``/dev/shm`` file system."""
    return platform.system() == "Linux" and platform.machine().lower() in ("x86_64", "amd64") \
        and os.path.isdir(_SHM_DIR)


def _same_host(group: Optional[dist.ProcessGroup], size: int) -> bool:
    names: list = [None] * size
    dist.all_gather_object(names, (socket.gethostname(), _boot_id()), group=group)
    return len(set(names)) == 1


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:  # two containers on one host name can differ
            return f.read().strip()
    except OSError:
        return ""


class ShmGroup:
    """Shared-memory all-reduce (sum) and all-gather for the members of ``group`` on one host. Build with
    :meth:`create` (collective over ``group``). ``rank`` is this process's index among the members (``0..size-1``,
    global rank order)."""

    def __init__(self, segment: mmap.mmap, rank: int, size: int, slot_bytes: int, timeout_s: float) -> None:
        self._segment = segment  # the mapping the views below read and write (lives as long as they do)
        self.rank, self.size, self.slot_bytes, self.timeout_s = rank, size, slot_bytes, timeout_s
        flag_bytes = size * _FLAG_STRIDE * 8
        self._flags = np.frombuffer(segment, dtype=np.int64, count=size * _FLAG_STRIDE)
        self._data = torch.frombuffer(segment, dtype=torch.uint8, offset=flag_bytes)
        self._seq = 0
        self._views: dict[tuple, torch.Tensor] = {}

    @classmethod
    def create(cls, group: Optional[dist.ProcessGroup], slot_bytes: int = DEFAULT_SLOT_BYTES,
               timeout_s: float = 600.0) -> Optional["ShmGroup"]:
        """Map one segment (a file in ``/dev/shm``, unlinked once mapped) on every member of ``group`` (a gloo
        group; collective). Returns None, on every member alike, where shared memory is not used (not Linux on
        x86-64, members on several hosts, a segment that would not fit in the free shared memory)."""
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        total = size * _FLAG_STRIDE * 8 + 2 * size * slot_bytes
        usable = _same_host(group, size) and platform_supported()  # (_same_host is collective: called first)
        if rank == 0 and usable:
            usable = shutil.disk_usage(_SHM_DIR).free > 2 * total
        source = dist.get_global_rank(group, 0) if group is not None else 0
        shared = [os.path.join(_SHM_DIR, f"hybridflow-{uuid.uuid4().hex[:16]}") if usable and rank == 0 else None]
        dist.broadcast_object_list(shared, src=source, group=group)
        if shared[0] is None:
            return None
        if rank == 0:
            fd = os.open(shared[0], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, total)
        dist.barrier(group=group)
        if rank != 0:
            fd = os.open(shared[0], os.O_RDWR)
        segment = mmap.mmap(fd, total)
        os.close(fd)
        segment.write(bytes(total))  # touch every page now: a full /dev/shm fails here, not mid-decode
        dist.barrier(group=group)
        if rank == 0:
            os.unlink(shared[0])  # every member has it mapped: the name goes, the memory stays until the last unmaps
        return cls(segment, rank, size, slot_bytes, timeout_s)

    def fits(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` goes through shared memory (a CPU tensor within the slot capacity)."""
        return tensor.device.type == "cpu" and tensor.numel() * tensor.element_size() <= self.slot_bytes

    def _slot(self, buffer: int, member: int, like: torch.Tensor) -> torch.Tensor:
        """``member``'s slot in ``buffer`` viewed as ``like``'s dtype and shape (views cached: a decode loop
        repeats a few shapes, and making a view costs more than copying a 64 KB tensor)."""
        key = (buffer, member, like.dtype, like.shape)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= _MAX_VIEWS:
                self._views.clear()
            start = (buffer * self.size + member) * self.slot_bytes
            nbytes = like.numel() * like.element_size()
            view = self._views[key] = self._data[start:start + nbytes].view(like.dtype).view(like.shape)
        return view

    def _publish(self, tensor: torch.Tensor) -> int:
        """Write ``tensor`` to this member's slot, publish, wait for every member; returns the buffer used."""
        self._seq += 1
        buffer = self._seq & 1
        self._slot(buffer, self.rank, tensor).copy_(tensor)
        self._flags[self.rank * _FLAG_STRIDE] = self._seq  # after the data: x86-64 keeps the two stores in order
        self._wait(self._seq)
        return buffer

    def _wait(self, seq: int) -> None:
        flags = self._flags[::_FLAG_STRIDE]
        polls, deadline = 0, None
        while flags.min() < seq:
            polls += 1
            if polls < _SPIN:
                continue
            os.sched_yield() if polls < 50 * _SPIN else time.sleep(1e-4)
            now = time.monotonic()
            deadline = deadline or now + self.timeout_s
            if now > deadline:
                missing = [r for r in range(self.size) if flags[r] < seq]
                raise TimeoutError(f"shared-memory collective {seq}: members {missing} of the group did not arrive "
                                   f"within {self.timeout_s:.0f} s (a rank died or left the decode loop)")

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the members in place (the same bits on every member); returns it. The caller
        checks :meth:`fits` first."""
        buffer = self._publish(tensor.contiguous())
        slots = [self._slot(buffer, member, tensor) for member in range(self.size)]
        if self.size == 1:
            return tensor.copy_(slots[0])
        torch.add(slots[0], slots[1], out=tensor)
        for slot in slots[2:]:
            tensor.add_(slot)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every member's ``tensor``, in member order. The returned tensors view shared memory and stay valid
        until this member's next collective on the group: copy (e.g. ``torch.cat``) before then."""
        buffer = self._publish(tensor.contiguous())
        return [self._slot(buffer, member, tensor) for member in range(self.size)]
