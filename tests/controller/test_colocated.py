"""Worker classes colocated in one process per rank (hybridflow.controller.colocated) with real Ray actors on CPU.

Every expected value is written out from the inputs (row indices, ranks, the classes' own constants).
"""

import os
import sys

import psutil
import pytest
import ray
import torch

from helpers.ray_procs import hosted_classes, role_pids
from hybridflow.controller import (
    ColocatedWorkerGroup,
    Dispatch,
    Execute,
    RayClassWithInitArgs,
    RayWorkerGroup,
    ResourcePool,
    Worker,
    WorkerError,
    can_colocate,
    create_colocated,
    create_groups,
    register,
)
from hybridflow.controller.colocated import colocated_class
from hybridflow.protocol import DataProto

pytestmark = pytest.mark.timeout(180)

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def rows(n):
    return DataProto.from_dict({"x": torch.arange(n)})


class EchoA(Worker):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale
        self.calls = 0

    @register(Dispatch.DP_COMPUTE_PROTO)
    def tag_rows(self, data):
        """The rows received, times ``scale``, tagged with the rank."""
        n = len(data)
        return DataProto.from_dict({"x": data.batch["x"] * self.scale, "rank": torch.full((n,), self.rank)})

    @register(Dispatch.ONE_TO_ALL)
    def who(self):
        self.calls += 1
        return ("A", self.rank, self.calls)

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def pid(self):
        return os.getpid()

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self):
        return {"master": self.get_master_addr_port()}


class EchoB(Worker):
    """Ranks laid out as dp = world: mesh ``b`` (dispatch info asked through the view's prefix)."""

    def __init__(self, offset=0):
        super().__init__()
        self.offset = offset
        self._register_dispatch_collect_info("b", dp_rank=self.rank, is_collect=True)

    @register(Dispatch.MESH_COMPUTE_PROTO, mesh_name="b")
    def shift(self, data):
        return DataProto.from_dict({"x": data.batch["x"] + self.offset})

    @register(Dispatch.ONE_TO_ALL)
    def who(self):
        return ("B", self.rank, self.offset)

    @register(Dispatch.ALL_TO_ALL)
    def add(self, a, b):
        return (self.rank, a + b)

    @register(Dispatch.RANK_ZERO, execute_mode=Execute.RANK_ZERO)
    def zero(self):
        return ("zero", self.rank)

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def pid(self):
        return os.getpid()

    @register(Dispatch.ONE_TO_ALL)
    def fail_on_rank(self, bad_rank):
        if self.rank == bad_rank:
            raise ValueError(f"boom on purpose at rank {self.rank}")
        return "ok"

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self):
        return {"master": self.get_master_addr_port()}


class Threaded(Worker):
    ray_actor_options = {"max_concurrency": 4}

    @register(Dispatch.ONE_TO_ALL)
    def pid(self):
        return os.getpid()


@pytest.fixture(scope="module")
def pair(pool2):
    views = create_colocated(pool2, {"first": RayClassWithInitArgs(EchoA, 10),
                                     "second": RayClassWithInitArgs(EchoB, offset=100)}, fraction=0.25)
    yield views
    views["first"].shutdown()


def test_views_are_named_and_share_the_actors(pair):
    first, second = pair["first"], pair["second"]
    assert isinstance(first, ColocatedWorkerGroup)
    assert (first.name, second.name) == ("first", "second")
    assert (first.world_size, second.world_size) == (2, 2)
    assert first.workers == second.workers
    assert (first.colocated_with, second.colocated_with) == (("second",), ("first",))


def test_both_classes_run_in_one_process_per_rank(pair):
    a = ray.get(pair["first"].pid())
    b = ray.get(pair["second"].pid())
    assert a == b
    assert len(set(a)) == 2  # one process per rank
    # the process title names both classes (ray::EchoA_EchoB); found as either role's process
    assert role_pids(os.getpid(), "EchoA") == sorted(a)
    assert role_pids(os.getpid(), "EchoB") == sorted(a)
    assert hosted_classes(a[0]) == ["EchoA", "EchoB"]


def test_each_class_keeps_its_own_state(pair):
    assert pair["first"].who() == [("A", 0, 1), ("A", 1, 1)]
    assert pair["second"].who() == [("B", 0, 100), ("B", 1, 100)]
    assert pair["first"].who() == [("A", 0, 2), ("A", 1, 2)]


def test_dispatch_modes_of_both_views(pair):
    out = pair["first"].tag_rows(rows(5))  # padded to 6, 3 rows per rank, padding removed
    assert out.batch["x"].tolist() == [0, 10, 20, 30, 40]
    assert out.batch["rank"].tolist() == [0, 0, 0, 1, 1]
    assert pair["second"].dispatch_info("b").dp_size == 2
    assert pair["second"].shift(rows(4)).batch["x"].tolist() == [100, 101, 102, 103]
    assert pair["second"].add([1, 2], [10, 20]) == [(0, 11), (1, 22)]
    assert pair["second"].zero() == ("zero", 0)


def test_a_call_after_another_views_call_on_the_same_actors(pair):
    first = pair["first"].tag_rows.submit(rows(4))
    second = pair["second"].shift.submit_after(first, rows(2))
    assert second.get().batch["x"].tolist() == [100, 101]
    assert first.get().batch["x"].tolist() == [0, 10, 20, 30]


def test_execute_all_by_name_and_one_master(pair):
    masters = {tuple(out["master"]) for view in pair.values()
               for out in ray.get(view.execute_all_async("init_model"))}
    assert len(masters) == 1  # every class of every rank sees rank 0's process address


def test_error_names_the_view_and_rank(pair):
    with pytest.raises(WorkerError, match="worker group 'second': rank 1 failed in fail_on_rank") as info:
        pair["second"].fail_on_rank(1)
    assert (info.value.group, info.value.rank) == ("second", 1)
    assert "boom on purpose at rank 1" in str(info.value)


def test_threaded_class_is_not_colocated():
    assert can_colocate(EchoA) and not can_colocate(Threaded)
    with pytest.raises(ValueError, match="Threaded .'t'. cannot be colocated: .*max_concurrency=4"):
        colocated_class({"a": EchoA, "t": Threaded})
    assert colocated_class({"a": EchoA, "b": EchoB}).__name__ == "EchoA_EchoB"


def test_create_groups_colocates_per_pool_and_shutdown_kills_once(ray_session):
    pool = ResourcePool([2], cpus_per_bundle=0.5, name_prefix="test_coloc")
    try:
        a, t, b = create_groups([(pool, RayClassWithInitArgs(EchoA, 1), "a"),
                                 (pool, RayClassWithInitArgs(Threaded), "t"),
                                 (pool, RayClassWithInitArgs(EchoB), "b")])
        assert isinstance(a, ColocatedWorkerGroup) and isinstance(b, ColocatedWorkerGroup)
        assert isinstance(t, RayWorkerGroup)
        pids, threaded = ray.get(a.pid()), t.pid()
        assert ray.get(b.pid()) == pids and not set(pids) & set(threaded)
        a.shutdown()
        b.shutdown()  # the actors are gone already: nothing left to kill
        assert a.workers == b.workers == []
        t.shutdown()
        alive = psutil.wait_procs([psutil.Process(p) for p in pids + threaded if psutil.pid_exists(p)], timeout=30)[1]
        assert not alive
    finally:
        pool.remove()


def test_create_groups_without_colocation_keeps_separate_processes(pool2):
    a, b = create_groups([(pool2, RayClassWithInitArgs(EchoA, 1), "a"), (pool2, RayClassWithInitArgs(EchoB), "b")],
                         colocate=False)
    try:
        assert isinstance(a, RayWorkerGroup) and isinstance(b, RayWorkerGroup)
        assert not set(ray.get(a.pid())) & set(ray.get(b.pid()))
    finally:
        a.shutdown()
        b.shutdown()
