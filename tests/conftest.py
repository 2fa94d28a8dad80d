"""Shared fixtures: one local Ray session (CPU only) for every in-process test that needs Ray."""

import os
import sys
import time

import pytest
import ray

import tiers
from hybridflow.distributed.launch import preload

# model.dtype=auto stays fp32 in tests on every CPU (no bf16 probe; hybridflow.distributed.precision); set before
# any Ray worker starts, so workers inherit it
os.environ.setdefault("HYBRIDFLOW_AUTO_DTYPE_PROBE", "0")
# nothing in the tests downloads: a Hugging Face hub id resolves from the local cache only (and a miss fails at once)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# what most multi-rank tests import: the fork server behind spawn_ranks imports it once per session, so a launch's
# ranks start with it instead of importing it each (seconds per launch on 2 cores)
preload("transformers.modeling_utils", "transformers.models.llama.modeling_llama",
        "transformers.models.qwen2.modeling_qwen2", "hybridflow.workers.ppo_actor", "hybridflow.workers.ppo_critic",
        "hybridflow.training.fsdp2", "hybridflow.engine", "vllm", "vllm.entrypoints.llm")


def pytest_configure(config):
    for tier, doc in (("unit", "in-process tests (the quick tier with dist)"),
                      ("dist", "gloo ranks, Ray actors or CLI child processes, no training run"),
                      ("e2e", "training runs (hybridflow train, run_ppo, a driver)")):
        config.addinivalue_line("markers", f"{tier}: {doc}; assigned in tests/tiers.py")
    tiers.install()


def pytest_collection_modifyitems(items):
    """Every test gets exactly one tier marker, from tests/tiers.py, and the tiers run in order (unit, dist, e2e;
    the file order kept within each), so a run fails fast and each tier's wall time is one stretch."""
    for item in items:
        item.add_marker(tiers.tier_of(item.nodeid))
    items.sort(key=lambda item: tiers.LEVELS.index(tiers.tier_of(item.nodeid)))


_tier_seconds: dict[str, list[float]] = {}  # tier -> [seconds, tests]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = time.monotonic()
    try:
        return (yield)
    finally:
        spent = _tier_seconds.setdefault(tiers.tier_of(item.nodeid), [0.0, 0])
        spent[0] += time.monotonic() - start
        spent[1] += 1


def pytest_terminal_summary(terminalreporter):
    if _tier_seconds:
        terminalreporter.write_line("wall time by tier: " + ", ".join(
            f"{tier} {_tier_seconds[tier][0]:.0f} s ({_tier_seconds[tier][1]} tests)"
            for tier in tiers.LEVELS if tier in _tier_seconds))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with tiers.running(item.nodeid, tiers.tier_of(item.nodeid)):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    tier = tiers.tier_of(item.nodeid)
    tiers.check_fixtures(item.nodeid, item.fixturenames, tier)
    with tiers.running(item.nodeid, tier):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    with tiers.running(f"fixture:{fixturedef.argname}", tiers.current_tier()):
        return (yield)


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


@pytest.fixture(autouse=True)
def _forget_unread_calls():
    """A test that leaves a failed worker-group call unread (on purpose, or as its groups are torn down) must not
    make a later test's next call raise it: the controller's unread-call registry is per process."""
    yield
    unread = sys.modules.get("hybridflow.controller.unread")
    if unread is not None:
        unread.forget()
