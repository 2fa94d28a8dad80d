"""Shared-memory collectives (hybridflow/distributed/shm_comm.py) on 3 gloo ranks: sums equal the fixed-order sum of
the members' inputs (gathered by gloo, summed here) bit for bit on every rank; gathers return the inputs in member
order; a subgroup works; oversized tensors fall back to gloo through TPGroup; a missing member times out with its
rank named; nothing is left in /dev/shm."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from hybridflow.distributed.launch import spawn_ranks
from hybridflow.distributed.shm_comm import ShmGroup, platform_supported
from hybridflow.engine.tp_model import TPGroup

pytestmark = pytest.mark.skipif(not platform_supported(), reason="the shared-memory path is used on Linux x86-64 only")

WORLD = 3
SHAPES = [(32, 64), (1, 7), (4, 3, 5), (300,)]
DTYPES = [torch.float32, torch.bfloat16, torch.int64]


def _gloo_gather(tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return parts


def _sums_and_gathers(rank: int, shm: ShmGroup, group=None) -> list[str]:
    """Problems seen over 48 collectives of mixed shapes and dtypes (empty when all hold)."""
    problems = []
    for step in range(48):
        shape, dtype = SHAPES[step % len(SHAPES)], DTYPES[step % len(DTYPES)]
        gen = torch.Generator().manual_seed(1000 * step + rank)
        mine = (torch.randn(shape, generator=gen) * 100).to(dtype)
        inputs = _gloo_gather(mine, group)
        expected = inputs[0] + inputs[1]
        for extra in inputs[2:]:
            expected = expected + extra
        if step % 2:
            got = shm.all_reduce_(mine.clone())
            if not torch.equal(got, expected):
                problems.append(f"step {step}: sum differs from the fixed-order sum")
            if not all(torch.equal(got, other) for other in _gloo_gather(got, group)):
                problems.append(f"step {step}: ranks hold different sums")
        else:
            got = [part.clone() for part in shm.all_gather(mine)]
            if not all(torch.equal(a, b) for a, b in zip(got, inputs)):
                problems.append(f"step {step}: gather differs from gloo's")
    return problems


def _rank(rank: int, out: str) -> None:
    before = {n for n in os.listdir("/dev/shm") if n.startswith("hybridflow-")}
    result = {}
    shm = ShmGroup.create(None)
    result["created"] = shm is not None
    result["problems"] = _sums_and_gathers(rank, shm)
    pair = dist.new_group([0, 2])
    if rank in (0, 2):
        sub = ShmGroup.create(pair)
        result["sub_problems"] = _sums_and_gathers(rank, sub, pair)
    # TPGroup: small slots, so a (16, 16) fp32 tensor (1 KiB) goes through gloo, a (4,) one through shared memory
    small = ShmGroup.create(None, slot_bytes=256)
    tp = TPGroup(None, rank, WORLD, list(range(WORLD)), small)
    big, little = torch.full((16, 16), float(rank + 1)), torch.full((4,), float(rank + 1))
    result["fits"] = (small.fits(big), small.fits(little))
    result["tp_sums"] = (tp.all_reduce(big).unique().tolist(), tp.all_reduce(little).unique().tolist())
    result["tp_gather"] = tp.all_gather_last_dim(torch.full((2, 1), float(rank))).tolist()
    result["leftover"] = sorted({n for n in os.listdir("/dev/shm") if n.startswith("hybridflow-")} - before)
    # a member that never arrives: rank 0 waits 1 s, then names it
    late = ShmGroup.create(None, timeout_s=1.0)
    if rank == 0:
        try:
            late.all_reduce_(torch.ones(3))
        except TimeoutError as exc:
            result["timeout"] = str(exc)
    dist.barrier()
    torch.save(result, f"{out}.{rank}")


def test_shared_memory_collectives_on_three_ranks(tmp_path):
    out = str(tmp_path / "res")
    spawn_ranks(_rank, out, world=WORLD)
    for rank in range(WORLD):
        res = torch.load(f"{out}.{rank}")
        assert res["created"] and res["problems"] == []
        assert res.get("sub_problems", []) == []
        assert res["fits"] == (False, True)
        assert res["tp_sums"] == ([6.0], [6.0])  # 1 + 2 + 3 either way
        assert res["tp_gather"] == [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]]
        assert res["leftover"] == []
    assert "members [1, 2]" in torch.load(f"{out}.0")["timeout"]
