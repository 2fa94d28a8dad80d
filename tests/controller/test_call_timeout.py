"""A worker-group call that does not finish within the group's call_timeout_s raises CallTimeoutError naming the
group, the method and the ranks that did not answer, within the limit plus a few seconds (real Ray actors)."""

import sys
import time

import pytest
import ray
import torch

from hybridflow.controller import CallTimeoutError, Dispatch, RayClassWithInitArgs, RayWorkerGroup, Worker, register
from hybridflow.protocol import DataProto

pytestmark = pytest.mark.timeout(120)

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

LIMIT_S = 1.0
SLACK_S = 5.0  # Ray's wait returns within this of its deadline on a loaded CI machine
HANG_S = 60.0  # the stuck rank's sleep; the group is killed long before


class StuckRankWorker(Worker):
    """Rank 1 sleeps HANG_S in every call but ready(); rank 0 answers at once."""

    def _maybe_hang(self):
        if self.rank == 1:
            time.sleep(HANG_S)

    @register(Dispatch.ONE_TO_ALL)
    def ready(self):
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def ping(self):
        self._maybe_hang()
        return self.rank

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def double(self, data):
        self._maybe_hang()
        return DataProto.from_dict({"x": data.batch["x"] * 2})


@pytest.fixture(scope="module")
def stuck(pool2):
    group = RayWorkerGroup(pool2, RayClassWithInitArgs(StuckRankWorker), name_prefix="stuck")
    assert group.ready() == [0, 1]  # both ranks up (their processes imported torch) before the limit applies
    group.call_timeout_s = LIMIT_S
    yield group
    group.shutdown()  # kills the sleeping rank


def _raises_in_time(call):
    start = time.monotonic()
    with pytest.raises(CallTimeoutError) as info:
        call()
    elapsed = time.monotonic() - start
    assert LIMIT_S <= elapsed < LIMIT_S + SLACK_S
    return info.value


def test_a_blocking_call_past_the_limit_names_group_method_and_ranks(stuck):
    err = _raises_in_time(stuck.ping)
    assert (err.group, err.method, err.ranks, err.timeout_s) == ("stuck", "ping", [1], LIMIT_S)
    assert str(err) == "worker group 'stuck': ranks [1] did not answer ping() within 1 s"


def test_a_future_keeps_the_limit_of_its_group(stuck):
    future = stuck.double(DataProto.from_dict({"x": torch.arange(4)}))
    stuck.call_timeout_s = None  # set after the call: the future keeps the limit it was made with
    try:
        err = _raises_in_time(future.get)
    finally:
        stuck.call_timeout_s = LIMIT_S
    assert (err.group, err.method, err.ranks) == ("stuck", "double", [1])


def test_unbounded_by_default_and_the_limit_is_checked(pool2):
    group = RayWorkerGroup(pool2, RayClassWithInitArgs(StuckRankWorker), name_prefix="unbounded", _start=False)
    assert group.call_timeout_s is None  # (no actors started: only the attribute is checked)
    with pytest.raises(ValueError, match="call_timeout_s must be None or > 0"):
        group.call_timeout_s = 0
