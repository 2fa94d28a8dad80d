"""The trainer -> generator transfer group: 1 sender + 2 receivers in separate processes (gloo), each process
also in a default group of its own (as in two worker groups); mixed dtypes, a tensor larger than a bucket, and the
bucket plan itself checked by hand."""

import datetime
import io
import multiprocessing as mp
import os

import pytest
import torch
import torch.distributed as dist

from hybridflow.distributed.launch import free_port
from hybridflow.distributed.weight_sync import WeightTransferGroup, bucket_layout, layout_of, open_store


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(4, 8, generator=g)),          # 128 bytes fp32
            ("a.bias", torch.randn(8, generator=g)),               # 32 bytes fp32
            ("big", torch.randn(100, generator=g)),                # 400 bytes fp32 > bucket
            ("half", torch.randn(6, generator=g).to(torch.bfloat16)),  # 12 bytes bf16
            ("steps", torch.arange(5))]                            # 40 bytes int64


def test_bucket_layout_by_hand():
    layout = layout_of(_tensors())
    assert layout[0] == ("a.weight", (4, 8), "float32") and layout[3][2] == "bfloat16"
    # 200-byte buckets: a.weight + a.bias (160); big alone (400 > 200); a new dtype opens a bucket each time
    assert bucket_layout(layout, 200) == [[0, 1], [2], [3], [4]]
    assert bucket_layout(layout, 10_000) == [[0, 1, 2], [3], [4]]
    assert bucket_layout(layout, 100) == [[0], [1], [2], [3], [4]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        bucket_layout(layout, 0)


def _own_default_group(port):
    """A world of 1 per process, like a worker group of its own (the transfer group must not need it)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))


def _receiver(rank, host, port, layout, default_port, out):
    _own_default_group(default_port)
    group = WeightTransferGroup(host, port, rank, 3, timeout_s=30)
    buf = io.BytesIO()  # plain bytes: a tensor put on the queue is shared by fd, gone once this process exits
    torch.save([(n, t.clone()) for n, t in group.receive(layout, 200)], buf)
    out.put((rank, buf.getvalue()))


def test_one_sender_two_receivers_in_separate_processes():
    ctx = mp.get_context("spawn")
    store = open_store("127.0.0.1", 30)
    tensors = _tensors()
    layout = layout_of(tensors)
    out = ctx.Queue()
    procs = [ctx.Process(target=_receiver, args=(r, "127.0.0.1", store.port, layout, free_port(), out))
             for r in (1, 2)]
    for p in procs:
        p.start()
    try:
        sender = WeightTransferGroup("127.0.0.1", store.port, 0, 3, timeout_s=30, store=store)
        sent = sender.send(iter(tensors), layout, 200)
        got = {rank: torch.load(io.BytesIO(data)) for rank, data in (out.get(timeout=60) for _ in procs)}
    finally:
        for p in procs:
            p.join(timeout=30)
    assert sent == sum(t.numel() * t.element_size() for _, t in tensors)
    for rank in (1, 2):
        assert [n for n, _ in got[rank]] == [n for n, _ in tensors]
        for (_, want), (_, have) in zip(tensors, got[rank]):
            assert have.dtype == want.dtype and torch.equal(have, want)


def test_sender_rejects_tensors_that_disagree_with_the_layout():
    store = open_store("127.0.0.1", 5)
    group = WeightTransferGroup("127.0.0.1", store.port, 0, 1, timeout_s=5, store=store)
    layout = layout_of(_tensors())
    with pytest.raises(ValueError, match="expected a.weight"):
        group.send(iter([("b", torch.zeros(4, 8))]), layout, 200)
