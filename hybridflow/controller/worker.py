"""``Worker``: the base class of every process in a worker group.

A worker is constructed inside a Ray actor that ``RayWorkerGroup`` started. Before the worker's
``__init__`` runs, the group has set these environment variables (the same names ``torchrun`` uses, so
``torch.distributed.init_process_group(init_method="env://")`` works unchanged):

* ``RANK``, ``WORLD_SIZE``: this process's rank in the group and the group size;
* ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``: rank and count within this node's placement group;
* ``MASTER_ADDR``, ``MASTER_PORT``: rank 0's node IP and a free port it picked (a group starts every rank at
  once, so the other ranks get them from :meth:`Worker.set_master_addr_port` right after their ``__init__``,
  before any other call; :data:`MASTER_LATER` tells their ``__init__`` so);
* ``HYBRIDFLOW_PLUGINS`` (optional): the user modules (``trainer.plugins``) that ``Worker.__init__`` imports
  first, so names they register are found by every lookup in the worker (see ``hybridflow/plugins.py``).

Outside a worker group (a plain ``Worker()`` in a test) the defaults are rank 0 of a world of 1, and the
worker picks ``MASTER_ADDR``/``MASTER_PORT`` itself.

Subclasses call ``super().__init__()`` first. This module knows nothing about RL.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket

import ray

logger = logging.getLogger(__name__)

__all__ = ["MASTER_LATER", "Worker"]

#: set to "1" in a rank other than 0 that starts before rank 0 has picked the rendezvous address: its
#: ``__init__`` then accepts no ``MASTER_ADDR``/``MASTER_PORT``, which arrive by ``set_master_addr_port``
MASTER_LATER = "HYBRIDFLOW_MASTER_LATER"


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an IP) resolves to a loopback address; False when it does not resolve."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _node_ip() -> str:
    """This node's IP as Ray sees it (falls back to the host name's address outside Ray)."""
    if ray.is_initialized():
        return ray.util.get_node_ip_address()
    return socket.gethostbyname(socket.gethostname())


#: where rank 0 looks for its rendezvous port: above Ray's worker ports (10002-19999 by default) and below the
#: OS's ephemeral range (32768+ on Linux), which outgoing connections (Ray's gRPC among them) draw from, so a
#: port found free here is rarely taken again before torch.distributed binds it
_PORT_RANGE = (20000, 32767)


def _free_port(host: str) -> int:
    """A TCP port on ``host`` that was free a moment ago: a random one in ``_PORT_RANGE`` (else any the OS
    picks). Another process could still take it first; the range makes that unlikely."""
    import random

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for port in random.sample(range(*_PORT_RANGE), 64):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Worker:
    """One rank of a worker group.

    Attributes read from the environment at construction: ``rank``, ``world_size``, ``local_rank``.

    Raises (from ``__init__``):
        ValueError: ``RANK``/``WORLD_SIZE`` are not integers or ``RANK`` is not in ``[0, WORLD_SIZE)``.
        RuntimeError: a rank other than 0 starts without ``MASTER_ADDR``/``MASTER_PORT`` (only rank 0 picks them).
        UserError: a plugin of ``HYBRIDFLOW_PLUGINS`` cannot be imported.
    """

    def __init__(self) -> None:
        from hybridflow.plugins import import_plugins_from_env

        import_plugins_from_env()  # before the subclass looks anything up in a registry
        self._rank = _env_int("RANK", 0)
        self._world_size = _env_int("WORLD_SIZE", 1)
        self._local_rank = _env_int("LOCAL_RANK", 0)
        if not 0 <= self._rank < self._world_size:
            raise ValueError(f"RANK={self._rank} is not in [0, WORLD_SIZE={self._world_size})")
        if not os.environ.get("MASTER_ADDR") or not os.environ.get("MASTER_PORT"):
            if self._rank != 0 and os.environ.get(MASTER_LATER) == "1":
                pass  # the group passes rank 0's address with set_master_addr_port before any other call
            elif self._rank != 0:
                raise RuntimeError(
                    f"rank {self._rank} started without MASTER_ADDR/MASTER_PORT; only rank 0 picks them "
                    "(start workers through RayWorkerGroup, which passes rank 0's address to the others)"
                )
            os.environ["MASTER_ADDR"] = _node_ip()
            os.environ["MASTER_PORT"] = str(_free_port(os.environ["MASTER_ADDR"]))
        # mesh name -> (dp_rank, is_collect); see _register_dispatch_collect_info.
        self._mesh_dispatch_info: dict[str, tuple[int, bool]] = {}

    # ------------------------------------------------------------------ identity
    @property
    def rank(self) -> int:
        """This process's rank in ``[0, world_size)``."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of processes in the worker group."""
        return self._world_size

    @property
    def local_rank(self) -> int:
        """Rank within this node's placement group (the device index on a GPU node)."""
        return self._local_rank

    @property
    def device_name(self) -> str:
        """``"cuda"`` when this process sees a CUDA device, else ``"cpu"``."""
        import torch  # imported here so the controller layer stays importable without loading torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def get_master_addr_port(self) -> tuple[str, int]:
        """Return ``(MASTER_ADDR, MASTER_PORT)``: rank 0's node IP and the port it picked for rendezvous."""
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])

    def set_master_addr_port(self, addr: str, port: int) -> None:
        """Set this process's ``MASTER_ADDR``/``MASTER_PORT`` (rank 0's, for a rank started with
        ``HYBRIDFLOW_MASTER_LATER=1`` while rank 0 was still starting); called before anything joins the group."""
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = str(addr), str(int(port))

    # ------------------------------------------------------------------ mesh dispatch info
    def _register_dispatch_collect_info(self, mesh_name: str, dp_rank: int, is_collect: bool) -> None:
        """Declare this rank's place in the layout ``mesh_name`` for ``Dispatch.MESH_COMPUTE_PROTO``.

        Args:
            mesh_name: the name methods pass as ``register(..., mesh_name=...)``.
            dp_rank: this rank's data-parallel index; it receives chunk ``dp_rank`` of every batch. The group's
                ``dp_size`` is the number of distinct dp ranks, which must be ``0 .. dp_size - 1``.
            is_collect: whether this rank's output is kept (exactly one rank per dp rank, e.g. tp rank 0 of the
                last pipeline stage).

        Raises:
            TypeError: ``dp_rank`` is not an int or ``is_collect`` not a bool.
            ValueError: ``dp_rank < 0``, or ``mesh_name`` was already registered with different values.
        """
        if not isinstance(dp_rank, int) or isinstance(dp_rank, bool):
            raise TypeError(f"dp_rank must be an int, got {type(dp_rank).__name__}")
        if not isinstance(is_collect, bool):
            raise TypeError(f"is_collect must be a bool, got {type(is_collect).__name__}")
        if dp_rank < 0:
            raise ValueError(f"dp_rank must be >= 0, got {dp_rank}")
        new = (dp_rank, is_collect)
        old = self._mesh_dispatch_info.get(mesh_name)
        if old is not None and old != new:
            raise ValueError(
                f"mesh {mesh_name!r} is already registered on rank {self._rank} as (dp_rank, is_collect)={old}; "
                f"got {new}"
            )
        self._mesh_dispatch_info[mesh_name] = new

    def _query_dispatch_info(self, mesh_name: str) -> tuple[int, bool]:
        """Return ``(dp_rank, is_collect)`` registered for ``mesh_name``.

        Raises ``KeyError`` naming the mesh and the registered ones when this rank never registered it.
        """
        try:
            return self._mesh_dispatch_info[mesh_name]
        except KeyError:
            raise KeyError(
                f"rank {self._rank} has no dispatch info for mesh {mesh_name!r} (registered: "
                f"{sorted(self._mesh_dispatch_info)}); call self._register_dispatch_collect_info("
                f"{mesh_name!r}, dp_rank, is_collect) in __init__"
            ) from None
