"""The Ray worker processes of one run, found in its driver's process tree (the driver started its own Ray: the
raylet is its child and the workers the raylet's), not machine-wide: other runs on a shared machine have workers
of the same class."""

from __future__ import annotations

import psutil


def role_pids(root_pid: int, role_class: str) -> list[int]:
    """Sorted pids of the processes below ``root_pid`` whose command line starts with ``ray::{role_class}``."""
    try:
        procs = psutil.Process(root_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    pids = []
    for proc in procs:
        try:
            if " ".join(proc.cmdline()).startswith(f"ray::{role_class}"):
                pids.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
    return sorted(pids)


def running(pids: list[int]) -> list[int]:
    """The pids of ``pids`` whose process still runs (neither gone nor a zombie)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            continue
    return alive
