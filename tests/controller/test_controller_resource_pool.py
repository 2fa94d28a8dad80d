"""ResourcePool / ResourcePoolManager against the local 4-CPU Ray: checks before asking, bounded waits, cleanup."""

import time

import pytest
import ray

from hybridflow.controller import ResourceError, ResourcePool, ResourcePoolManager

pytestmark = pytest.mark.timeout(60)


def test_pool_reserves_cpu_bundles_and_removes_them(ray_session):
    pool = ResourcePool([2], cpus_per_bundle=0.25, max_colocate_count=2, name_prefix="t")
    try:
        assert pool.world_size == 2 and pool.use_gpu is False  # no GPU in this cluster
        assert pool.bundle == {"CPU": 0.25}
        assert [pg.bundle_specs for pg in pool.placement_groups] == [[{"CPU": 0.25}, {"CPU": 0.25}]]
    finally:
        pool.remove()
    assert pool.placement_groups == []
    pool.remove()  # twice is fine


def test_pool_asking_more_than_the_cluster_has_fails_fast(ray_session):
    start = time.monotonic()
    with pytest.raises(ResourceError, match=r"asks for 8 bundles of \{CPU: 1\} = \{CPU: 8\}.*cluster has \{CPU: 4\}"):
        ResourcePool([8])
    with pytest.raises(ResourceError, match=r"short of GPU"):
        ResourcePool([1], use_gpu=True)
    assert time.monotonic() - start < 5


def test_pool_times_out_instead_of_hanging_when_resources_are_held(ray_session):
    total = ray.cluster_resources()["CPU"]
    holder = ResourcePool([1], cpus_per_bundle=0.25, name_prefix="holder")
    try:
        start = time.monotonic()
        # Fits the cluster's total (passes the up-front check) but not while the holder exists.
        with pytest.raises(ResourceError, match=r"was not ready after 1 s.*free now"):
            ResourcePool([1], cpus_per_bundle=total, ready_timeout_s=1)
        assert time.monotonic() - start < 10
    finally:
        holder.remove()


def test_manager_maps_roles_to_pools(ray_session):
    with pytest.raises(ValueError, match=r"unknown pools \{'critic': 'missing'\}"):
        ResourcePoolManager({"main": [1]}, {"actor": "main", "critic": "missing"})
    with pytest.raises(ResourceError, match="ResourcePoolManager"):
        ResourcePoolManager({"a": [3], "b": [3]}, {"actor": "a"})  # 6 CPUs together > 4
    manager = ResourcePoolManager(
        {"main": [2], "side": [1]}, {"actor": "main", "ref": "main", "reward": "side"}, cpus_per_bundle=0.25
    )
    try:
        assert manager.get_resource_pool("actor") is manager.get_resource_pool("ref")
        assert manager.get_resource_pool("reward").world_size == 1
        with pytest.raises(KeyError, match="no resource pool for role 'critic'"):
            manager.get_resource_pool("critic")
    finally:
        manager.remove()


def test_manager_colocate_count_defaults_to_the_roles_sharing_each_pool(ray_session):
    manager = ResourcePoolManager({"main": [1], "side": [1]}, {"actor": "main", "critic": "main", "reward": "side"},
                                  max_colocate_count=None, cpus_per_bundle=0.25)
    try:
        assert manager.get_resource_pool("actor").max_colocate_count == 2
        assert manager.get_resource_pool("reward").max_colocate_count == 1
    finally:
        manager.remove()
