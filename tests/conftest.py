"""Shared fixtures: one local Ray session (CPU only) for every in-process test that needs Ray."""

import pytest
import ray


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray with 4 logical CPUs, started once (startup takes seconds) and shut down at the end. Code
    under test that calls ``ray.init`` itself finds it running and joins it (``run_ppo`` then leaves it up)."""
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False)
    yield
    if started:
        ray.shutdown()
