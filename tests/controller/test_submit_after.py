"""``group.method.submit_after(previous, ...)``: a call of one worker group ordered after another group's call with
no driver wait in between, on real Ray actors. The order is read from a log both groups append to (an invariant of
the events, not a timing). Also ``group.method.submit(...)`` of any dispatch mode (a future) and ``futures.get_all``
(several futures read together, the first failure raised at once)."""

import sys
import time

import pytest
import ray
import torch

from hybridflow.controller import (DataProtoFuture, Dispatch, RayClassWithInitArgs, RayWorkerGroup, Worker,
                                   WorkerError, register)
from hybridflow.controller.futures import get_all
from hybridflow.protocol import DataProto

pytestmark = pytest.mark.timeout(180)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the worker class below, shipped by value


class LoggingWorker(Worker):
    """Appends ``<name> <event> <rank>`` lines to a shared log file."""

    def __init__(self, name, log):
        super().__init__()
        self.name, self.log = name, log

    def _write(self, event):
        with open(self.log, "a") as f:
            f.write(f"{self.name} {event} {self.rank}\n")

    @register(Dispatch.DP_COMPUTE_PROTO)
    def work(self, data, seconds=0.0, fail=False):
        """Log start, sleep ``seconds``, log end; returns the rows doubled (raises with ``fail``)."""
        self._write("start")
        time.sleep(seconds)
        if fail:
            raise ValueError(f"{self.name} was told to fail")
        self._write("end")
        return DataProto.from_dict({"y": data.batch["x"] * 2})

    @register(Dispatch.ONE_TO_ALL)
    def tell(self, seconds=0.0, fail=False):
        """``"<name> <rank>"`` after ``seconds`` (raises with ``fail``)."""
        time.sleep(seconds)
        if fail:
            raise ValueError(f"{self.name} was told to fail")
        return f"{self.name} {self.rank}"


@pytest.fixture(scope="module")
def two_groups(pool2, tmp_path_factory):
    log = tmp_path_factory.mktemp("submit_after") / "events.log"
    first = RayWorkerGroup(pool2, RayClassWithInitArgs(LoggingWorker, "first", str(log)), name_prefix="first")
    second = RayWorkerGroup(pool2, RayClassWithInitArgs(LoggingWorker, "second", str(log)), name_prefix="second")
    yield first, second, log
    first.shutdown()
    second.shutdown()


@pytest.fixture()
def groups(two_groups):
    """The two groups, their log emptied."""
    two_groups[2].write_text("")
    return two_groups


def _batch(n):
    return DataProto.from_dict({"x": torch.arange(n)})


def test_the_second_call_starts_after_every_rank_of_the_first_has_finished(groups):
    first, second, log = groups
    before = first.work.submit(_batch(4), seconds=0.5)
    after = second.work.submit_after(before, _batch(4))  # submitted at once: the driver does not wait
    assert isinstance(after, DataProtoFuture)
    assert after.get().batch["y"].tolist() == [0, 2, 4, 6]  # the method never sees the ordering arguments
    assert before.get().batch["y"].tolist() == [0, 2, 4, 6]
    events = log.read_text().split("\n")[:-1]
    first_ends = max(i for i, e in enumerate(events) if e.startswith("first end"))
    second_starts = min(i for i, e in enumerate(events) if e.startswith("second start"))
    assert sorted(events[:first_ends + 1]) == ["first end 0", "first end 1", "first start 0", "first start 1"]
    assert second_starts > first_ends


def test_a_failed_first_call_fails_the_second_without_running_it(groups):
    first, second, log = groups
    before = first.work.submit(_batch(4), fail=True)
    after = second.work.submit_after(before, _batch(4))
    with pytest.raises(WorkerError, match="'first': rank [01] failed in work\\(\\).*told to fail"):
        before.get()
    with pytest.raises(WorkerError, match="'second'"):
        after.get()
    assert not any(line.startswith("second") for line in log.read_text().splitlines())  # it never ran


def test_ordering_after_object_refs_and_rejecting_anything_else(groups):
    first, second, _ = groups
    refs = first.work.submit(_batch(2)).futures  # a plain list of ObjectRefs works too
    assert second.work.submit_after(refs, _batch(2)).get().batch["y"].tolist() == [0, 2]
    with pytest.raises(TypeError, match="submit_after: previous must be a call's future"):
        second.work.submit_after(_batch(2), _batch(2))


def test_submit_of_any_mode_returns_a_future_and_get_all_reads_several_together(groups):
    first, second, _ = groups
    told = second.tell.submit()  # ONE_TO_ALL, registered blocking: submit does not wait either
    assert isinstance(told, DataProtoFuture)
    rows = first.work.submit(_batch(2))
    assert get_all(told, rows)[0] == ["second 0", "second 1"]  # every rank's output, in rank order
    assert rows.get().batch["y"].tolist() == [0, 2]


def test_get_all_raises_the_first_failure_without_waiting_for_the_others(groups):
    # last in the module: the slow call is still running when the test ends (the fixture's shutdown stops it)
    first, second, _ = groups
    failing = first.tell.submit(fail=True)
    slow = second.tell.submit(seconds=60)  # one pool: its ranks wait for the failed call to end, then sleep
    start = time.monotonic()
    with pytest.raises(WorkerError, match="'first': rank [01] failed in tell\\(\\).*told to fail"):
        get_all(slow, failing)  # the slow one first: a sequential wait would block for a minute
    assert time.monotonic() - start < 30
