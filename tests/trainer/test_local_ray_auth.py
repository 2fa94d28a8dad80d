"""A local Ray cluster on loopback starts without Ray's token authentication (and its warning at every start);
a user's own ``RAY_AUTH_MODE`` and a cluster on another address keep Ray's behaviour."""

import os

import pytest
import ray

from hybridflow.trainer import setup


@pytest.fixture
def seen_auth_mode(monkeypatch):
    """``ray.init`` replaced by a recorder of ``RAY_AUTH_MODE`` at the time of the call (no cluster starts)."""
    seen = []
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.append(os.environ.get("RAY_AUTH_MODE")))
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)  # restored after the test, whatever the code under test set
    return seen


@pytest.mark.parametrize("host, given, expected", [
    ("127.0.0.1", None, "disabled"),  # only this machine reaches it: no token, no warning
    ("localhost", None, "disabled"),
    ("127.0.0.1", "token", "token"),  # the user's choice is kept
    ("10.1.2.3", None, None),  # reachable from the network: Ray's default (token) stays
])
def test_ray_auth_mode_at_init(seen_auth_mode, monkeypatch, host, given, expected):
    if given is not None:
        monkeypatch.setenv("RAY_AUTH_MODE", given)
    setup._start_local_ray(2, host)
    assert seen_auth_mode == [expected]
