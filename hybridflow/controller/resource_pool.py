"""Resource pools: Ray placement groups that worker groups are placed into.

A ``ResourcePool`` reserves, for each entry of ``process_on_nodes``, one placement group (``STRICT_PACK``: all its
bundles on one node) of that many bundles. A bundle is one device slot: ``{"GPU": 1, "CPU": c}`` on a GPU
cluster, ``{"CPU": c}`` on CPU. Rank ``r`` of every worker group built on the pool runs in bundle ``r``, so
several worker groups on one pool share devices (each actor takes ``1 / max_colocate_count`` of a bundle).

The pool checks what the cluster has before it asks, fails with ``ResourceError`` instead of waiting forever,
and ``remove()`` releases what it reserved (killing the actors placed in it).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Hashable, Optional, Sequence

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

logger = logging.getLogger(__name__)

__all__ = ["ResourceError", "ResourcePool", "ResourcePoolManager"]


class ResourceError(RuntimeError):
    """The Ray cluster cannot provide what a pool asks for (the message says what was asked and what exists)."""


def _bundle(use_gpu: bool, cpus_per_bundle: float) -> dict[str, float]:
    return {"GPU": 1, "CPU": cpus_per_bundle} if use_gpu else {"CPU": cpus_per_bundle}


def _fmt(resources: dict) -> str:
    return "{" + ", ".join(f"{k}: {resources.get(k, 0):g}" for k in ("CPU", "GPU") if k in resources) + "}"


def _check_fits(what: str, node_bundles: Sequence[int], bundle: dict[str, float]) -> None:
    """Raise ``ResourceError`` unless the cluster's totals, and its largest node, can hold the request.

    Only the cluster's total resources are checked (resources held by others may free up; waiting for them is
    bounded by the pool's ready timeout).
    """
    cluster = ray.cluster_resources()
    total = {k: v * sum(node_bundles) for k, v in bundle.items()}
    short = [k for k, v in total.items() if v > cluster.get(k, 0) + 1e-9]
    if short:
        raise ResourceError(
            f"{what} asks for {sum(node_bundles)} bundles of {_fmt(bundle)} = {_fmt(total)} in total, but the Ray "
            f"cluster has {_fmt({k: cluster.get(k, 0) for k in total})} (short of {', '.join(short)}); ask for "
            "fewer processes or start Ray with more resources (ray.init(num_cpus=..., num_gpus=...))"
        )
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    largest = max(node_bundles)
    need = {k: v * largest for k, v in bundle.items()}
    if nodes and not any(all(node.get(k, 0) + 1e-9 >= v for k, v in need.items()) for node in nodes):
        biggest = max(nodes, key=lambda node: tuple(node.get(k, 0) for k in need))
        raise ResourceError(
            f"{what} needs {largest} bundles of {_fmt(bundle)} = {_fmt(need)} on one node, but the largest node "
            f"has {_fmt({k: biggest.get(k, 0) for k in need})}"
        )


class ResourcePool:
    """Placement groups for ``sum(process_on_nodes)`` worker processes.

    Args:
        process_on_nodes: processes (bundles) per node, e.g. ``[8, 8]`` for two 8-GPU nodes.
        use_gpu: give every bundle one GPU; ``None``: iff the Ray cluster has GPUs.
        max_colocate_count: how many worker groups may share each bundle (each actor takes this fraction of it).
        name_prefix: prefix of the placement group names (a random suffix keeps names unique).
        cpus_per_bundle: CPUs reserved per bundle (may be fractional).
        ready_timeout_s: how long to wait for the placement groups to be reserved.

    Raises:
        RuntimeError: Ray is not initialized.
        ValueError: an argument is out of range (the message names it).
        ResourceError: the cluster has fewer resources than asked (raised before creating anything), or the
            placement groups were not ready within ``ready_timeout_s`` (they are removed again).
    """

    def __init__(
        self,
        process_on_nodes: Sequence[int],
        use_gpu: Optional[bool] = None,
        max_colocate_count: int = 8,
        name_prefix: str = "hf",
        cpus_per_bundle: float = 1,
        ready_timeout_s: float = 60.0,
    ) -> None:
        nodes = list(process_on_nodes)
        if not nodes or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in nodes):
            raise ValueError(f"process_on_nodes must be a non-empty list of positive ints, got {process_on_nodes!r}")
        if not isinstance(max_colocate_count, int) or max_colocate_count < 1:
            raise ValueError(f"max_colocate_count must be a positive int, got {max_colocate_count!r}")
        if not cpus_per_bundle > 0:
            raise ValueError(f"cpus_per_bundle must be > 0, got {cpus_per_bundle!r}")
        if not ray.is_initialized():
            raise RuntimeError("ResourcePool needs a running Ray: call ray.init(...) first")
        self.process_on_nodes = nodes
        self.use_gpu = bool(ray.cluster_resources().get("GPU", 0) > 0) if use_gpu is None else bool(use_gpu)
        self.max_colocate_count = max_colocate_count
        self.cpus_per_bundle = cpus_per_bundle
        self.name = f"{name_prefix}_{uuid.uuid4().hex[:6]}"
        self.bundle = _bundle(self.use_gpu, cpus_per_bundle)
        _check_fits(f"ResourcePool {self.name!r} (process_on_nodes={nodes})", nodes, self.bundle)
        self.placement_groups: list[PlacementGroup] = [
            placement_group([dict(self.bundle) for _ in range(n)], strategy="STRICT_PACK", name=f"{self.name}_node{i}")
            for i, n in enumerate(nodes)
        ]
        self._wait_ready(ready_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for i, pg in enumerate(self.placement_groups):
            try:
                ray.get(pg.ready(), timeout=max(deadline - time.monotonic(), 0.0))
            except GetTimeoutError:
                available = ray.available_resources()
                self.remove()
                raise ResourceError(
                    f"ResourcePool {self.name!r}: placement group {i} ({self.process_on_nodes[i]} bundles of "
                    f"{_fmt(self.bundle)}) was not ready after {timeout_s:g} s; the cluster has "
                    f"{_fmt(ray.cluster_resources())} in total and {_fmt(available)} free now - other placement "
                    "groups or actors hold the rest (remove unused pools, or raise ready_timeout_s)"
                )
        logger.info("ResourcePool %s ready: %s bundles of %s", self.name, self.process_on_nodes, _fmt(self.bundle))

    @property
    def world_size(self) -> int:
        """Total number of bundles (= ranks of a worker group on this pool)."""
        return sum(self.process_on_nodes)

    def remove(self) -> None:
        """Release the placement groups (actors placed in them are killed). Safe to call twice."""
        for pg in self.placement_groups:
            remove_placement_group(pg)
        self.placement_groups = []

    def __repr__(self) -> str:
        return f"ResourcePool({self.name!r}, process_on_nodes={self.process_on_nodes}, bundle={_fmt(self.bundle)})"


class ResourcePoolManager:
    """Named resource pools and which role runs on which pool.

    Args:
        resource_pool_spec: pool name -> processes per node, e.g. ``{"global_pool": [8, 8]}``.
        mapping: role -> pool name; roles are opaque keys here (the trainer's role names).
        max_colocate_count: passed to every ``ResourcePool``; None: for each pool, the number of roles mapped to
            it (at least 1), so each role's actors take an equal share of a bundle.
        use_gpu, cpus_per_bundle, ready_timeout_s: passed to every ``ResourcePool``.

    The pools are created at construction, after checking that the cluster can hold all of them together.

    Raises:
        ValueError: a role maps to a pool name that ``resource_pool_spec`` lacks.
        ResourceError: see ``ResourcePool`` (already created pools are removed again).
    """

    def __init__(
        self,
        resource_pool_spec: dict[str, list[int]],
        mapping: dict[Hashable, str],
        use_gpu: Optional[bool] = None,
        max_colocate_count: Optional[int] = 8,
        cpus_per_bundle: float = 1,
        ready_timeout_s: float = 60.0,
    ) -> None:
        unknown = {role: pool for role, pool in mapping.items() if pool not in resource_pool_spec}
        if unknown:
            raise ValueError(f"roles map to unknown pools {unknown}; pools: {sorted(resource_pool_spec)}")
        if not ray.is_initialized():
            raise RuntimeError("ResourcePoolManager needs a running Ray: call ray.init(...) first")
        self.mapping = dict(mapping)
        gpu = bool(ray.cluster_resources().get("GPU", 0) > 0) if use_gpu is None else bool(use_gpu)
        all_nodes = [n for nodes in resource_pool_spec.values() for n in nodes]
        if all_nodes:
            _check_fits(f"ResourcePoolManager (pools {resource_pool_spec})", all_nodes, _bundle(gpu, cpus_per_bundle))
        self.pools: dict[str, ResourcePool] = {}
        try:
            for name, nodes in resource_pool_spec.items():
                sharing = max(1, sum(pool == name for pool in mapping.values()))
                self.pools[name] = ResourcePool(
                    nodes, use_gpu=gpu, max_colocate_count=max_colocate_count or sharing, name_prefix=name,
                    cpus_per_bundle=cpus_per_bundle, ready_timeout_s=ready_timeout_s,
                )
        except Exception:
            self.remove()
            raise

    def get_resource_pool(self, role: Hashable) -> ResourcePool:
        """The pool ``role`` runs on. Raises ``KeyError`` listing the known roles."""
        if role not in self.mapping:
            raise KeyError(f"no resource pool for role {role!r}; roles: {list(self.mapping)}")
        return self.pools[self.mapping[role]]

    def remove(self) -> None:
        """Remove every pool."""
        for pool in self.pools.values():
            pool.remove()
