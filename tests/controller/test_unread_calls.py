"""A worker-group call whose output nobody reads still reports its failure: the bookkeeping of unread calls
(``hybridflow.controller.unread``) with stand-ins for Ray, and one call on real actors that fails unread."""

import pickle
import sys

import pytest
import ray
import torch

from hybridflow.controller import (Dispatch, RayClassWithInitArgs, RayWorkerGroup, Worker, WorkerError,
                                   raise_unread_errors, register)
from hybridflow.controller import futures as futures_mod
from hybridflow.controller import unread
from hybridflow.controller.futures import DataProtoFuture
from hybridflow.protocol import DataProto

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the worker class below, shipped by value


class FakeRay:
    """Stand-ins for ``ray.wait`` and ``get_outputs`` over string refs: ``finished`` refs are done, ``failed`` ones
    raise; ``fetched`` records every ref fetched."""

    def __init__(self):
        self.finished, self.failed, self.fetched = set(), set(), []

    def wait(self, refs, num_returns=1, timeout=None, fetch_local=True):
        assert timeout == 0, "a non-blocking check must not wait"
        return [r for r in refs if r in self.finished], [r for r in refs if r not in self.finished]

    def get_outputs(self, refs, ranks, group, method, timeout_s=None):
        self.fetched.extend(refs)
        for ref, rank in zip(refs, ranks):
            if ref in self.failed:
                raise WorkerError(group, rank, method, RuntimeError(f"{ref} broke"))
        return [DataProto.from_dict({"v": torch.tensor([len(ref)])}) for ref in refs]


@pytest.fixture
def fake(monkeypatch):
    fake = FakeRay()
    monkeypatch.setattr(unread.ray, "wait", fake.wait)
    monkeypatch.setattr(unread, "get_outputs", fake.get_outputs)
    monkeypatch.setattr(futures_mod, "get_outputs", fake.get_outputs)
    monkeypatch.setattr(unread, "_ABANDONED", {})
    monkeypatch.setattr(unread, "_LIVE", unread.weakref.WeakValueDictionary())
    return fake


def call(group, method, refs, collect=DataProto.concat):
    """A future of a tracked call of ``group.method`` whose rank ``i`` returns ``refs[i]``."""
    ranks = list(range(len(refs)))
    return DataProtoFuture(collect, refs, source=(group, method, ranks), call=unread.track(refs, ranks, group, method))


def test_a_dropped_failed_call_raises_its_worker_error_once(fake):
    call("actor", "update_actor", ["a0", "a1"])  # dropped unread at once
    fake.finished |= {"a0", "a1"}
    fake.failed.add("a1")
    with pytest.raises(WorkerError, match=r"worker group 'actor': rank 1 failed in update_actor\(\).*a1 broke") as e:
        raise_unread_errors(wait=False)
    assert (e.value.group, e.value.rank, e.value.method) == ("actor", 1, "update_actor")
    raise_unread_errors(wait=False)  # reported once
    assert unread.unread_calls(include_live=True) == []


def test_a_running_call_is_not_fetched_and_a_finished_rank_is_checked_once(fake):
    call("critic", "update_critic", ["c0", "c1"])
    raise_unread_errors(wait=False)
    assert fake.fetched == []  # nothing finished: nothing fetched, nothing waited for
    fake.finished.add("c0")
    raise_unread_errors(wait=False)
    assert fake.fetched == ["c0"]
    [record] = unread.unread_calls()
    assert (record.refs, record.ranks) == (["c1"], [1])  # rank 0 checked, rank 1 still tracked
    fake.finished.add("c1")
    raise_unread_errors(wait=False)
    assert fake.fetched == ["c0", "c1"] and unread.unread_calls(include_live=True) == []


def test_a_read_future_is_forgotten_and_its_error_raised_by_the_read_only(fake):
    out = call("actor", "update_actor", ["r0"])
    fake.finished.add("r0")
    fake.failed.add("r0")
    with pytest.raises(WorkerError, match="rank 0 failed in update_actor"):
        out.get()
    del out
    raise_unread_errors(wait=True)  # the read reported it: nothing more
    assert fake.fetched == ["r0"]


def test_a_future_handed_on_is_forgotten_without_a_fetch(fake):
    whole = call("actor", "generate_sequences", ["g0", "g1"])
    pickle.dumps(whole)  # shipped to another group's rank whole (a Joined)
    pieces = call("actor", "compute_log_prob", ["l0", "l1"]).chunk(2)  # the parent is dropped at once
    assert [r.method for r in unread.unread_calls(include_live=True)] == ["compute_log_prob"]  # chunks hold it
    pickle.dumps(pieces)  # each rank of the next group gets its chunk
    by_rank = call("actor", "generate_sequences", ["s0", "s1"], concatenating_collector()).split_by_rank()
    assert by_rank.chunk(2) == ["s0", "s1"]  # the producing ranks' refs go to the consumer
    del whole, pieces, by_rank
    fake.finished |= {"g0", "g1", "l0", "l1", "s0", "s1"}
    fake.failed |= {"g1", "l0", "s1"}
    raise_unread_errors(wait=True)
    assert fake.fetched == [] and unread.unread_calls(include_live=True) == []


def concatenating_collector():
    """A collect function that concatenates both outputs whole (what ``split_by_rank`` hands out by rank)."""
    collect = lambda outputs: DataProto.concat(outputs)  # noqa: E731
    collect.concatenates = [0, 1]
    return collect


def test_a_live_unread_future_waits_for_a_blocking_check_and_stays_readable(fake):
    ahead = call("rollout", "generate_sequences", ["n0", "n1"])  # e.g. a look-ahead generation, held
    fake.finished |= {"n0", "n1"}
    raise_unread_errors(wait=False)
    assert fake.fetched == []  # it may still be read: a non-blocking check leaves it alone
    raise_unread_errors(wait=True)
    assert fake.fetched == ["n0", "n1"] and unread.unread_calls(include_live=True) == []
    assert ahead.batch["v"].tolist() == [2, 2]  # len("n0"), len("n1"): still readable


def test_a_live_unread_failed_future_fails_the_blocking_check(fake):
    held = call("actor", "update_actor", ["u0", "u1"])
    fake.failed.add("u0")
    with pytest.raises(WorkerError, match=r"'actor': rank 0 failed in update_actor"):
        raise_unread_errors(wait=True)
    with pytest.raises(WorkerError, match=r"'actor': rank 0 failed in update_actor"):
        held.get()  # a read raises the same error


class Flaky(Worker):
    """``step`` fails on rank 1 when the batch asks for it; returns its rows doubled otherwise."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def step(self, data: DataProto) -> DataProto:
        if "fail" in data.meta_info and self.rank == 1:
            raise RuntimeError("rank 1 was asked to fail")
        return DataProto.from_dict({"y": data.batch["x"] * 2})


def test_a_never_read_failed_call_raises_at_the_next_call(pool2):
    group = RayWorkerGroup(pool2, RayClassWithInitArgs(Flaky), name_prefix="flaky")
    try:
        bad = DataProto.from_dict({"x": torch.arange(4)}, meta_info={"fail": True})
        refs = list(group.step(bad).futures)  # the future is dropped at once: its output is never read
        ray.wait(refs, num_returns=len(refs), fetch_local=False)  # it has finished (nothing fetched)
        with pytest.raises(WorkerError, match=r"worker group 'flaky': rank 1 failed in step\(\).*asked to fail") as e:
            group.step(DataProto.from_dict({"x": torch.arange(4)}))  # the next call reports it
        assert (e.value.group, e.value.rank, e.value.method) == ("flaky", 1, "step")
        good = group.step(DataProto.from_dict({"x": torch.arange(4)}))  # reported once: calls go on
        assert good.batch["y"].tolist() == [0, 2, 4, 6]
        raise_unread_errors(wait=True)
        assert unread.unread_calls(include_live=True) == []
    finally:
        group.shutdown()


def test_forget_drops_the_calls_of_the_named_groups_only(fake):
    """A group that is gone (shut down, its pool removed): its unread calls are dropped unchecked, others stay."""
    kept, gone = call("kept", "m", ["k0"]), call("gone", "m", ["g0"])
    call("gone", "dropped", ["g1"])  # abandoned at once
    fake.finished |= {"g0", "g1"}
    fake.failed |= {"g0", "g1"}
    unread.forget(["gone"])
    assert [r.group for r in unread.unread_calls(include_live=True)] == ["kept"]
    raise_unread_errors(wait=False)  # the gone group's failures are not raised
    unread.forget()
    assert unread.unread_calls(include_live=True) == []
    del kept, gone
