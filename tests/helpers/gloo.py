"""Launch a function on N local processes that form one gloo group (``torch.multiprocessing.spawn``): the one
launcher of the multi-process tests that drive workers or FSDP2 modules directly, without Ray."""

from __future__ import annotations

import os
import socket
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the rendezvous port of one launch)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_rank_env(rank: int, world: int, port: int) -> None:
    """The torchrun variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) of ``rank`` of ``world``
    local processes, for code that initializes its own process group (a worker's ``__init__``)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def _entry(rank: int, world: int, port: int, init_group: bool, fn: Callable[..., None], args: tuple) -> None:
    set_rank_env(rank, world, port)
    if init_group:
        torch.set_num_threads(1)  # 2 ranks on a 2-core machine: one thread each
        dist.init_process_group("gloo")
    try:
        fn(rank, *args)
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    finish_rank()


def finish_rank() -> None:
    """End a spawned rank whose work succeeded: wait for every rank (none tears the group down while a peer's
    collectives may still run), destroy the process group, flush and leave with status 0 at once, skipping
    interpreter finalization. In clean-clone CI runs a rank that had finished its work sometimes died there with
    SIGABRT ("terminate called without an active exception": gloo objects with live threads destroyed during
    finalization), which failed tests whose every check had passed."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(fn: Callable[..., None], *args: Any, world: int = 2, init_group: bool = True) -> None:
    """Run ``fn(rank, *args)`` on ``world`` spawned processes (``fn`` must be a module-level function: spawn
    pickles it by name) and wait for all of them; a rank that raises fails the call
    (``torch.multiprocessing.ProcessRaisedException``).

    ``init_group``: initialize the gloo group (one torch thread per rank) before ``fn``; False for code that
    initializes it itself from the environment. The group is destroyed after ``fn`` either way."""
    mp.spawn(_entry, args=(world, free_port(), init_group, fn, args), nprocs=world, join=True)
