"""Local SPMD launches without Ray: a function on N processes of this machine that form one gloo group over a free
loopback port (``torch.multiprocessing.start_processes`` with a fork server). The one launcher of the multi-process tests and of the
benchmarks that time collectives; also a quick way to run an engine or worker on a few CPU ranks by hand.

    from hybridflow.distributed.launch import spawn_ranks
    spawn_ranks(train_fn, cfg, world=2)  # train_fn(rank, cfg) on 2 ranks, one torch thread each
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["finish_rank", "free_port", "preload", "set_rank_env", "spawn_ranks"]

# Modules the fork server imports once, before it forks any rank (see :func:`spawn_ranks`); the launched function's
# own module is added at the server's start.
_PRELOAD: list = ["torch", "torch.distributed"]


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


def preload(*modules: str) -> None:
    """Name more modules for the fork server to import once (e.g. ``transformers.modeling_utils``), so that the
    ranks of every later launch start with them imported. Effective until the server has started (the first
    :func:`spawn_ranks` of a process); a module that does not import is skipped (then each rank imports it)."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def _entry(rank: int, world: int, port: int, init_group: bool, threads: int, fn: Callable[..., None],
           args: tuple, environ: dict) -> None:
    os.environ.update(environ)  # the launching process's environment now, not the fork server's at its start
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
    """Run ``fn(rank, *args)`` on ``world`` processes and wait for all of them. ``fn`` must be a module-level
    function (it is pickled by name).

    The ranks are forked by a fork server (``multiprocessing``'s ``forkserver`` start method): a clean process
    started once per launching process that has imported torch (and :func:`preload`'s modules, and ``fn``'s module
    at its start) and forks each rank from there. A launch then costs milliseconds instead of every rank importing
    torch anew (~4 s on a 2-core CPU), while each rank still starts single-threaded and without the launching
    process's state, as with ``spawn``: it gets the launching process's current environment, working directory
    and ``sys.path``.

    ``init_group``: initialize the gloo group before ``fn``; False for code that initializes it itself from the
    environment (:func:`set_rank_env` has set it). ``threads``: torch threads per rank (1: one rank per core).
    A rank that succeeds ends with :func:`finish_rank`; one that raises destroys the group.

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback in the message).
        torch.multiprocessing.ProcessExitedException: a rank died (signal or nonzero exit).
    """
    module = getattr(fn, "__module__", None)
    multiprocessing.set_forkserver_preload(_PRELOAD + ([module] if module and module != "__main__" else []))
    mp.start_processes(_entry, args=(world, free_port(), init_group, threads, fn, args, dict(os.environ)),
                       nprocs=world, join=True, start_method="forkserver")
