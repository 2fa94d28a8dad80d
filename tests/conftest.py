"""Shared fixtures: one local Ray session (CPU only) for every in-process test that needs Ray."""

import os

import pytest
import ray

# model.dtype=auto stays fp32 in tests on every CPU (no bf16 probe; hybridflow.distributed.precision); set before
# any Ray worker starts, so workers inherit it
os.environ.setdefault("HYBRIDFLOW_AUTO_DTYPE_PROBE", "0")


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray with 4 logical CPUs, started once (startup takes seconds) and shut down at the end. Code
    under test that calls ``ray.init`` itself finds it running and joins it (``run_ppo`` then leaves it up)."""
    started = not ray.is_initialized()
    if started:
        # address="local": a cluster of its own, never one another process on this machine started
        ray.init(address="local", num_cpus=4, include_dashboard=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def repo_script():
    """``load(relative_path)``: import a script of the repository that is not a package module (a benchmark, an
    example) by its path from the repository root, and return the module."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent

    def load(relative_path: str):
        path = root / relative_path
        spec = importlib.util.spec_from_file_location(f"repo_script_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory):
    """One 2-step ``hybridflow train quickstart`` in a fresh interpreter (its own Ray), run by the first test that
    asks for it and read by every other: tests/helpers/quickstart_run.py says what it runs and for whom."""
    from helpers.quickstart_run import run_quickstart

    return run_quickstart(tmp_path_factory.mktemp("quickstart_run"))
