"""Trainer -> generator weight transfer over a process group that spans two worker groups (LlamaRL, Meta 2025,
arXiv 2505.24034, §4: weights move device to device, with no parameter server and no disk).

Each worker group has its own default process group (its ranks' torch.distributed world). The transfer group is a
second, separate group: rank 0 is the trainer rank that sends (trainer rank 0, which holds the gathered full
tensors) and ranks ``1 .. G`` are the generator ranks. It is built from a ``TCPStore`` that the sender hosts on a
port the OS picks, and a backend-level process group (``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` on GPU), so
it does not disturb either side's default group.

Tensors travel in buckets: consecutive tensors of one dtype packed into one flat buffer of at most
``bucket_bytes`` (a larger tensor gets a bucket of its own), one broadcast per bucket. Both sides derive the same
buckets from the same ``layout`` (the list of ``(name, shape, dtype)`` the driver hands to the generators), so
no metadata travels with the tensors.
"""

from __future__ import annotations

import datetime
from typing import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from hybridflow.distributed.init import pin_transport_to, rendezvous_store

__all__ = ["TensorLayout", "WeightTransferGroup", "bucket_layout", "layout_of", "open_store"]

#: ``(name, shape, dtype name)`` of one tensor, e.g. ``("lm_head.weight", (V, H), "float32")``
TensorLayout = tuple[str, tuple[int, ...], str]


def layout_of(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[TensorLayout]:
    """The layout of ``(name, tensor)`` pairs (global shapes for DTensors; no data is read)."""
    return [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in named_tensors]


def _nbytes(entry: TensorLayout) -> int:
    _, shape, dtype = entry
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def bucket_layout(layout: Sequence[TensorLayout], bucket_bytes: int) -> list[list[int]]:
    """Group tensor indices into buckets: consecutive tensors of one dtype, at most ``bucket_bytes`` bytes per
    bucket (a tensor larger than that alone in its bucket). Deterministic in ``layout`` and ``bucket_bytes``.

    Raises:
        ValueError: ``bucket_bytes <= 0``.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[list[int]] = []
    size, dtype = 0, None
    for i, entry in enumerate(layout):
        nbytes = _nbytes(entry)
        if not buckets or entry[2] != dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size, dtype = 0, entry[2]
        buckets[-1].append(i)
        size += nbytes
    return buckets


def open_store(host: str, timeout_s: float) -> dist.TCPStore:
    """Host the transfer group's rendezvous store on ``host`` (only: not on all interfaces) at a port the OS
    picks (``store.port``)."""
    pin_transport_to(host)
    return rendezvous_store(host, 0, None, True, datetime.timedelta(seconds=timeout_s))


class WeightTransferGroup:
    """This process's membership of a transfer group of ``world_size`` ranks (rank 0 sends, the others receive).

    Args:
        host, port: the store hosted by rank 0 (:func:`open_store`); rank 0 passes its ``store``.
        rank: this process's rank in the transfer group.
        world_size: 1 sender + the number of generator ranks.
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL; tensors are moved to the current CUDA device).
        timeout_s: a collective that waits longer than this (a peer died or never joined) raises instead of
            hanging.
        store: rank 0's own store (from :func:`open_store`); other ranks connect to ``host:port``.

    The constructor returns once every rank joined (it blocks on the others).
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, device: str = "cpu",
                 timeout_s: float = 60.0, store: dist.Store | None = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"transfer-group rank {rank} is not in [0, {world_size})")
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            pin_transport_to(host)
            store = rendezvous_store(host, port, None, False, timeout)
        self.rank, self.world_size, self.device = rank, world_size, device
        store = dist.PrefixStore("hybridflow_weight_sync", store)
        if device == "cuda":  # untested here (no GPU); the timeout as for gloo
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(store, rank, world_size, options)
        else:
            self._pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)

    def _broadcast(self, flat: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self._pg.broadcast([flat], opts).wait()
        if flat.is_cuda:  # NCCL's wait() only orders the stream; the bytes have moved once it is synchronized
            torch.cuda.current_stream().synchronize()

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], layout: Sequence[TensorLayout],
             bucket_bytes: int) -> int:
        """Rank 0: broadcast the tensors of ``layout`` (in its order) bucket by bucket; returns the bytes sent
        (per receiver). ``named_tensors`` may be a generator (e.g. gathering FSDP shards one at a time) and must
        yield the layout's names in order.

        Raises:
            ValueError: called on a rank other than 0, or a tensor's name/shape differs from the layout.
        """
        if self.rank != 0:
            raise ValueError(f"only transfer-group rank 0 sends; this is rank {self.rank}")
        it = iter(named_tensors)
        sent = 0
        for bucket in bucket_layout(layout, bucket_bytes):
            parts = []
            for i in bucket:
                name, shape, _ = layout[i]
                got_name, tensor = next(it)
                if got_name != name or tuple(tensor.shape) != tuple(shape):
                    raise ValueError(f"weight sync: expected {name} {tuple(shape)}, got {got_name} "
                                     f"{tuple(tensor.shape)} (the layout and the tensors disagree)")
                parts.append(tensor.detach().reshape(-1).to(self.device))
            flat = torch.cat(parts) if len(parts) > 1 else parts[0]  # the sender's tensor is only read
            self._broadcast(flat)
            sent += flat.numel() * flat.element_size()
        return sent

    def receive(self, layout: Sequence[TensorLayout], bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Ranks >= 1: receive the tensors of ``layout`` bucket by bucket; yields ``(name, tensor)`` views into
        each received bucket (on ``device``), in layout order. Consume it fully: every bucket is a collective."""
        for bucket in bucket_layout(layout, bucket_bytes):
            dtype = getattr(torch, layout[bucket[0]][2])
            numels = [int(torch.Size(layout[i][1]).numel()) for i in bucket]
            flat = torch.empty(sum(numels), dtype=dtype, device=self.device)
            self._broadcast(flat)
            for i, piece in zip(bucket, flat.split(numels)):
                yield layout[i][0], piece.view(layout[i][1])
