"""One local Ray session (CPU only) shared by every controller test, plus a shared 2-bundle resource pool."""

import pytest
import ray

from hybridflow.controller import ResourcePool


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray with 4 logical CPUs; started once (startup takes seconds) and shut down at the end."""
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def pool2(ray_session):
    """Two bundles of 0.5 CPU on the local node; several worker groups share it (colocation by pool)."""
    pool = ResourcePool([2], cpus_per_bundle=0.5, name_prefix="test_pool2")
    yield pool
    pool.remove()
