"""A local run stays off the network: during a 2-step quickstart (the driver starts its own Ray), every listening
socket of the run's process tree (driver, Ray's GCS, raylet, agents, workers, the ranks' torch.distributed
rendezvous and gloo transport) is bound to a loopback address, none to 0.0.0.0 or ::."""

import ipaddress
import os
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.slow

QUICK = ["trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
         "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2",
         "trainer.logger=[jsonl]", "trainer.ray_init.num_cpus=4"]


def _is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def _listening(root: psutil.Process) -> dict[tuple[str, int], str]:
    """(ip, port) -> process name of every listening TCP socket in ``root``'s process tree right now."""
    found = {}
    try:
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for proc in procs:
        try:
            name = proc.name()
            for conn in proc.net_connections("inet"):
                if conn.status == psutil.CONN_LISTEN:
                    found[(conn.laddr.ip, conn.laddr.port)] = name
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def test_local_quickstart_listens_on_loopback_only(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "GLOO_SOCKET_IFNAME")}
    cmd = [sys.executable, "-m", "hybridflow", "train", "recipes/quickstart.yaml", *QUICK,
           f"trainer.default_local_dir={tmp_path / 'run'}"]
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    log = open(tmp_path / "log.txt", "w")
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT)
    seen: dict[tuple[str, int], str] = {}
    try:
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            seen.update(_listening(root))
            time.sleep(1.0)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    output = (tmp_path / "log.txt").read_text()
    assert proc.returncode == 0, output[-3000:]
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2
    names = set(seen.values())
    assert {"gcs_server", "raylet"} <= names, f"the scan missed Ray's processes: {sorted(names)}"
    exposed = sorted(f"{name} {ip}:{port}" for (ip, port), name in seen.items() if not _is_loopback(ip))
    assert not exposed, f"listening beyond loopback: {exposed}"
