"""Process-group and device-mesh set-up: gloo on CPU, NCCL on GPU, from the env the worker group sets.

Rendezvous binds to one address, never to all interfaces: rank 0's ``TCPStore`` listens on ``MASTER_ADDR`` (the
node IP Ray reports: 127.0.0.1 on a local cluster the driver starts, the node's own IP on a multi-node cluster),
through a socket bound here and handed to the store (``master_listen_fd``), because torch's own store server
listens on every interface. On a loopback ``MASTER_ADDR`` the gloo/NCCL transports are pinned to the loopback
interface too (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``, unless already set).
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hybridflow.controller.worker import is_loopback  # (re-exported: rendezvous code imports it from here)
from hybridflow.utils.metrics import Metric, Sum, reduce_metrics

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def get_device_name() -> str:
    """``"cuda"`` when this process sees a GPU, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(name: str, device: str | None = None) -> torch.dtype:
    """Map a config dtype name to a torch dtype; ``auto`` is fp32 on CPU (bf16 matmul is ~400x slower
    there) and bf16 on GPU.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    if name == "auto":
        return torch.bfloat16 if (device or get_device_name()) == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {['auto', *_DTYPES]}")
    return _DTYPES[name]


def _loopback_interface() -> str:
    """Name of the network interface that holds 127.0.0.1 (``lo`` on Linux)."""
    try:
        import psutil
    except ImportError:
        return "lo"
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addresses):
            return name
    return "lo"


def pin_transport_to(host: str) -> None:
    """On a loopback ``host``, make gloo and NCCL open their sockets on the loopback interface (they otherwise
    use the address the host name resolves to, or any interface); explicit settings are kept."""
    if is_loopback(host):
        interface = _loopback_interface()
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)


def rendezvous_store(host: str, port: int, world_size: int | None, is_master: bool,
                     timeout: datetime.timedelta) -> dist.TCPStore:
    """A ``TCPStore`` at ``host:port``. The master's server listens on ``host`` only (a socket bound here and
    handed over); ``port=0`` lets the OS pick (read it from ``store.port``). Clients connect to ``host:port``.

    Raises:
        OSError: the master cannot bind ``host:port`` (taken, or ``host`` is not an address of this node).
    """
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=socket.SOMAXCONN)
    port = sock.getsockname()[1]
    return dist.TCPStore(host, port, world_size, True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=sock.detach())


def init_distributed(timeout_s: float = 600.0) -> None:
    """Join the worker group's default process group (idempotent).

    Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and LOCAL_RANK on GPU) from the environment, which
    :class:`hybridflow.controller.RayWorkerGroup` sets. Backend: NCCL when a GPU is visible, gloo otherwise.
    Rank 0 hosts the rendezvous store on ``MASTER_ADDR`` only (see the module docstring). A collective that
    waits longer than ``timeout_s`` seconds raises instead of hanging.
    """
    if dist.is_initialized():
        return
    backend = "nccl" if get_device_name() == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = datetime.timedelta(seconds=timeout_s)
    pin_transport_to(host)
    store = rendezvous_store(host, port, world_size, rank == 0, timeout)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def build_mesh(dp: int, tp: int = 1) -> DeviceMesh:
    """A DeviceMesh over the default group with named axes ``("dp",)`` or ``("dp", "tp")``.

    Raises:
        ValueError: ``dp * tp`` differs from the world size.
    """
    world = dist.get_world_size()
    if dp * tp != world:
        raise ValueError(f"layout dp={dp} x tp={tp} = {dp * tp} ranks does not match world size {world}")
    if tp == 1:
        return init_device_mesh(get_device_name(), (dp,), mesh_dim_names=("dp",))
    return init_device_mesh(get_device_name(), (dp, tp), mesh_dim_names=("dp", "tp"))


def all_reduce_sum(value: float | torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Sum a scalar (or tensor) over ``group``; returns a new fp64 tensor on the collective's device.
    Without an initialised process group (a single process) it returns the value itself."""
    if not dist.is_initialized():
        return torch.as_tensor(value, dtype=torch.float64).clone()
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.as_tensor(value, dtype=torch.float64, device=device).clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def gather_metrics(metrics: dict[str, Metric], group: Optional[dist.ProcessGroup] = None,
                   replicas: int = 1) -> dict[str, Metric]:
    """Pool typed metrics (:mod:`hybridflow.utils.metrics`) over the ranks of ``group``, each by its kind, in one
    collective; every rank gets the same pooled dict (a key some ranks lack pools over the others). ``replicas``:
    how many ranks hold each piece of data (a dp shard's tp x pp ranks), so a ``Sum`` counts each piece once
    (means, extremes and standard deviations do not change when every sample is counted ``replicas`` times).
    Without an initialised process group it returns ``metrics`` pooled alone."""
    if not dist.is_initialized():
        return reduce_metrics([metrics])
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, metrics, group=group)
    pooled = reduce_metrics(gathered)
    if replicas != 1:
        pooled = {k: Sum(m.value / replicas) if isinstance(m, Sum) else m for k, m in pooled.items()}
    return pooled
