"""Calls on different resource pools run at the same time; calls of separate groups on one pool run one after the
other; a batch holding another group's future goes to the next group's ranks without the driver reading it."""

import sys
import time

import pytest
import ray
import torch

from hybridflow.controller import (Dispatch, RayClassWithInitArgs, RayWorkerGroup, ResourcePool, Worker,
                                   WorkerError, register)
from hybridflow.protocol import DataProto

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the worker class below, shipped by value

NAP_S = 1.0


class Sleeper(Worker):
    """Each rank sleeps ``NAP_S`` and returns its rows with the wall-clock start and end of its sleep."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def nap(self, data: DataProto) -> DataProto:
        start = time.time()
        time.sleep(NAP_S)
        n = len(data)
        return DataProto.from_dict({"start": torch.full((n,), start, dtype=torch.float64),
                                    "end": torch.full((n,), time.time(), dtype=torch.float64)})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def double(self, data: DataProto) -> DataProto:
        if "fail" in data.meta_info:
            raise RuntimeError("asked to fail")
        return DataProto.from_dict({"y": data.batch["x"] * 2})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def add(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"z": data.batch["x"] + data.batch["y"]})


def interval(out):
    return float(out.batch["start"].min()), float(out.batch["end"].max())


def rows(n):
    return DataProto.from_dict({"x": torch.arange(n)})


@pytest.fixture(scope="module")
def pools(ray_session):
    made = [ResourcePool([2], cpus_per_bundle=0.25, name_prefix=f"order_{i}") for i in range(2)]
    yield made
    for pool in made:
        pool.remove()


@pytest.fixture(scope="module")
def groups(pools):
    """``actor`` and ``critic`` on separate pools, ``other`` in its own processes on the actor's pool."""
    made = RayWorkerGroup.create_many([(pools[0], RayClassWithInitArgs(Sleeper), "actor"),
                                      (pools[1], RayClassWithInitArgs(Sleeper), "critic"),
                                      (pools[0], RayClassWithInitArgs(Sleeper), "other")])
    yield dict(zip(("actor", "critic", "other"), made))
    for group in made:
        group.shutdown()


def test_calls_on_separate_pools_overlap(groups):
    critic = groups["critic"].nap(rows(4))  # both return at once
    actor = groups["actor"].nap(rows(4))
    (c0, c1), (a0, a1) = interval(critic), interval(actor)
    assert max(c0, a0) < min(c1, a1), f"critic {c0:.2f}-{c1:.2f} and actor {a0:.2f}-{a1:.2f} do not intersect"


def test_separate_groups_on_one_pool_take_turns(groups):
    first = groups["actor"].nap(rows(4))
    second = groups["other"].nap(rows(4))
    (f0, f1), (s0, s1) = interval(first), interval(second)
    assert s0 >= f1, f"the second call started at {s0:.2f}, before the first ended at {f1:.2f}"


def test_a_batch_with_a_future_goes_to_the_next_group_without_a_driver_read(groups, monkeypatch):
    batch = rows(4)
    batch.union(groups["actor"].double(batch))  # pending: y
    fetched = []
    real_get = ray.get
    monkeypatch.setattr(ray, "get", lambda refs, *a, **k: fetched.append(refs) or real_get(refs, *a, **k))
    out = groups["critic"].add(batch)  # the critic's ranks fetch y themselves
    assert fetched == [] and batch.split_pending()[1], "the driver read the actor's output"
    monkeypatch.undo()
    assert out.batch["z"].tolist() == [0, 3, 6, 9]  # x + 2x, computed independently
    assert batch.batch["y"].tolist() == [0, 2, 4, 6]


def test_reading_a_column_of_a_failed_producer_names_its_group_and_rank(groups):
    batch = rows(4)
    batch.meta_info["fail"] = True
    batch.union(groups["actor"].double(batch))  # returns at once: nothing raised yet
    with pytest.raises(WorkerError, match=r"'actor': rank \d failed in double\(\).*asked to fail"):
        batch.batch["y"]


def test_a_group_that_read_a_failed_producers_output_raises_the_producers_error(groups):
    batch = rows(4)
    batch.meta_info["fail"] = True
    batch.union(groups["actor"].double(batch))  # fails on the actor's ranks
    out = groups["critic"].add(batch)  # the critic's ranks read the actor's failed output
    with pytest.raises(WorkerError, match=r"'actor': rank \d failed in double\(\)") as caught:
        out.batch["z"]
    assert caught.value.group == "actor" and "read by worker group 'critic'" in "".join(caught.value.__notes__)
