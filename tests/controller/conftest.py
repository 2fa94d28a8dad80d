"""A shared 2-bundle resource pool on the session's Ray (``ray_session`` lives in tests/conftest.py)."""

import pytest

from hybridflow.controller import ResourcePool


@pytest.fixture(scope="session")
def pool2(ray_session):
    """Two bundles of 0.5 CPU on the local node; several worker groups share it (colocation by pool)."""
    pool = ResourcePool([2], cpus_per_bundle=0.5, name_prefix="test_pool2")
    yield pool
    pool.remove()
