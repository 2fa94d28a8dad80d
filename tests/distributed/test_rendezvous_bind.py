"""torch.distributed rendezvous binds one address: 2 gloo ranks joined by ``init_distributed`` (rank 0 hosts the
store on MASTER_ADDR=127.0.0.1) and a weight-transfer store listen on loopback only, never on 0.0.0.0 or ::."""

import ipaddress
import os

import psutil
import torch
import torch.distributed as dist

from hybridflow.distributed.init import init_distributed
from hybridflow.distributed.launch import spawn_ranks
from hybridflow.distributed.weight_sync import open_store


def _listening() -> list[str]:
    return [c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == psutil.CONN_LISTEN]


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def _rank(rank: int, out: str) -> None:
    os.environ.pop("GLOO_SOCKET_IFNAME", None)
    init_distributed(timeout_s=60)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)  # the transport is up: its sockets exist now
    stores = [open_store("127.0.0.1", 30)] if rank == 0 else []
    ips = _listening()
    dist.barrier()
    with open(f"{out}/{rank}.txt", "w") as f:
        f.write(f"{t.item()} {os.environ.get('GLOO_SOCKET_IFNAME')} {' '.join(ips)}")
    del stores


def test_rendezvous_and_transport_listen_on_loopback_only(tmp_path):
    spawn_ranks(_rank, str(tmp_path), init_group=False)  # init_distributed binds the rendezvous itself
    for rank in (0, 1):
        total, interface, *ips = (tmp_path / f"{rank}.txt").read_text().split()
        assert float(total) == 3.0  # 1 + 2
        assert ips and all(_loopback(ip) for ip in ips), f"rank {rank} listens on {ips}"
        assert interface != "None"  # gloo pinned to the loopback interface
