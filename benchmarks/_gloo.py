"""Local multi-process launches for the benchmarks that time collectives (``reshard.py``, ``tp_collectives.py``):
``world`` spawned processes joined in one gloo group over a free loopback port, and rank 0's JSON result handed back.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, port: int, threads: int, fn: Callable[..., None], args: tuple, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo")
    try:
        fn(rank, *args, out)
    finally:
        dist.destroy_process_group()


def run_gloo_ranks(fn: Callable[..., None], world: int, *args: Any, threads: int = 1) -> dict:
    """Run ``fn(rank, *args, out_path)`` on ``world`` spawned processes that form one gloo group (``threads`` torch
    threads each; the group is destroyed after ``fn``) and return the JSON object rank 0 wrote to ``out_path``.
    ``fn`` must be a module-level function (spawn pickles it by name); a rank that raises fails the call."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_entry, args=(world, port, threads, fn, args, out), nprocs=world, join=True)
        with open(out) as f:
            return json.load(f)
