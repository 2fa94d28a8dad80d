"""Local SPMD launches without Ray: a function on N spawned processes of this machine that form one gloo group over
a free loopback port (``torch.multiprocessing.spawn``). The one launcher of the multi-process tests and of the
benchmarks that time collectives; also a quick way to run an engine or worker on a few CPU ranks by hand.

    from hybridflow.distributed.launch import spawn_ranks
    spawn_ranks(train_fn, cfg, world=2)  # train_fn(rank, cfg) on 2 ranks, one torch thread each
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["finish_rank", "free_port", "set_rank_env", "spawn_ranks"]


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


def finish_rank() -> None:
    """End a spawned rank whose work succeeded: wait for every rank (none tears the group down while a peer's
    collectives may still run), destroy the process group, flush and leave with status 0 at once, skipping
    interpreter finalization. Without it a rank that had finished its work sometimes died in finalization with
    SIGABRT ("terminate called without an active exception": gloo objects with live threads destroyed late), which
    failed a launch whose every rank had succeeded (seen in clean-clone CI runs of the test suite)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _entry(rank: int, world: int, port: int, init_group: bool, threads: int, fn: Callable[..., None],
           args: tuple) -> None:
    set_rank_env(rank, world, port)
    torch.set_num_threads(threads)
    if init_group:
        dist.init_process_group("gloo")
    try:
        fn(rank, *args)
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    finish_rank()


def spawn_ranks(fn: Callable[..., None], *args: Any, world: int = 2, init_group: bool = True,
                threads: int = 1) -> None:
    """Run ``fn(rank, *args)`` on ``world`` spawned processes and wait for all of them. ``fn`` must be a
    module-level function (spawn pickles it by name).

    ``init_group``: initialize the gloo group before ``fn``; False for code that initializes it itself from the
    environment (:func:`set_rank_env` has set it). ``threads``: torch threads per rank (1: one rank per core).
    A rank that succeeds ends with :func:`finish_rank`; one that raises destroys the group.

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback in the message).
        torch.multiprocessing.ProcessExitedException: a rank died (signal or nonzero exit).
    """
    mp.spawn(_entry, args=(world, free_port(), init_group, threads, fn, args), nprocs=world, join=True)
