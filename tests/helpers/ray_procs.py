"""The Ray worker processes of one run, found in its driver's process tree (the driver started its own Ray: the
raylet is its child and the workers the raylet's), not machine-wide: other runs on a shared machine have workers
of the same class.

A worker process's title is ``ray::<Class>`` (``ray::<Class>.<method>`` while it runs a call); a process that hosts
several colocated classes is titled ``ray::<Class1>_<Class2>...`` (``hybridflow.controller.colocated``)."""

from __future__ import annotations

import psutil

_PREFIX = "ray::"


def _title_classes(cmdline: list[str]) -> list[str]:
    """The class names in a Ray worker's title (``[]`` for another process). Class names are CamelCase, so the
    ``_`` joining colocated ones splits them."""
    title = " ".join(cmdline)
    if not title.startswith(_PREFIX):
        return []
    head = title[len(_PREFIX):].split()[0] if title[len(_PREFIX):].strip() else ""
    return [name for name in head.split(".")[0].split("_") if name]


def hosted_classes(pid: int) -> list[str]:
    """The worker classes process ``pid`` hosts, from its Ray title ([] when it is gone or no Ray worker)."""
    try:
        return _title_classes(psutil.Process(pid).cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return []


def role_pids(root_pid: int, role_class: str) -> list[int]:
    """Sorted pids of the processes below ``root_pid`` that host ``role_class`` (alone, or colocated with other
    classes), by their Ray title."""
    try:
        procs = psutil.Process(root_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    pids = []
    for proc in procs:
        try:
            if role_class in _title_classes(proc.cmdline()):
                pids.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
    return sorted(pids)


def running(pids: list[int]) -> list[int]:
    """The pids of ``pids`` whose process still runs (neither gone nor a zombie)."""
    alive = []
    for pid in set(pids):
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            continue
    return sorted(alive)
