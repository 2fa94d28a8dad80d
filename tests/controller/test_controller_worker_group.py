"""RayWorkerGroup end to end with real Ray actors on CPU: dispatch modes, env, gloo, futures, errors.

Every expected value is built by hand from the input (row indices, rank tags), never read back from the code.
"""

import os
import sys
from datetime import timedelta

import numpy as np
import pytest
import ray
import torch

from hybridflow.controller import (
    DataProtoFuture,
    Dispatch,
    DispatchError,
    DispatchPlan,
    Execute,
    RayClassWithInitArgs,
    RayWorkerGroup,
    ResourcePool,
    Worker,
    WorkerError,
    register,
    register_dispatch_mode,
)
from hybridflow.protocol import DataProto, pad_dataproto_to_divisor

pytestmark = pytest.mark.timeout(180)

# pytest imports this file as a top-level module that Ray's worker processes cannot import: ship the
# worker classes defined here by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _sum_outputs(outputs):
    return sum(outputs)


def _dispatch_same(worker_group, *args, **kwargs):
    n = worker_group.world_size
    return DispatchPlan(tuple([a] * n for a in args), {k: [v] * n for k, v in kwargs.items()})


register_dispatch_mode("hf_test_sum", _dispatch_same, _sum_outputs)


def _dispatch_pad_without_padding(worker_group, data):
    """A custom mode that pads but does not say where the padding went (DispatchPlan.padding)."""
    n = worker_group.world_size
    padded, pad = pad_dataproto_to_divisor(data, n)
    return DispatchPlan((padded.chunk(n),), {}, pad_size=pad)


register_dispatch_mode("hf_test_pads_without_padding", _dispatch_pad_without_padding, _sum_outputs)


def rows(n):
    """A batch whose column ``x`` holds the row indices ``0..n-1``."""
    return DataProto.from_dict({"x": torch.arange(n)})


class EchoWorker(Worker):
    def __init__(self, scale=1):
        super().__init__()
        self.scale = scale
        self.zero_calls = 0

    @register(Dispatch.DP_COMPUTE_PROTO)
    def tag_rows(self, data):
        """Return the rows received, each tagged with this rank and the chunk size this rank saw."""
        n = len(data)
        return DataProto.from_dict(
            {"x": data.batch["x"], "rank": torch.full((n,), self.rank), "seen": torch.full((n,), n)}
        )

    @register(Dispatch.DP_COMPUTE_PROTO, batch_keys=("x", "absent"), non_tensor_batch_keys=())
    def columns_seen(self, data):
        """The columns this rank received, as meta_info (a method that declares what it reads)."""
        return DataProto.from_dict({"x": data.batch["x"]},
                                   meta_info={"batch": sorted(data.batch), "non_tensor": sorted(data.non_tensor_batch),
                                              "meta": dict(data.meta_info)})

    @register(Dispatch.DP_COMPUTE_PROTO)
    def repeat_rows(self, data, n):
        """n rows per input row, interleaved (as a rollout returns n samples per prompt), tagged with the rank."""
        out = data.repeat(n, interleave=True)
        return DataProto.from_dict({"x": out.batch["x"], "rank": torch.full((len(out),), self.rank)})

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def repeat_rows_async(self, data, n):
        return data.repeat(n, interleave=True)

    @register("hf_test_pads_without_padding")
    def pads_without_padding(self, data):
        return data

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def scale_rows(self, data):
        return DataProto.from_dict({"x": data.batch["x"] * self.scale})

    @register(Dispatch.ONE_TO_ALL)
    def env(self):
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES")
        return {k: os.environ.get(k) for k in keys} | {"rank": self.rank, "world_size": self.world_size}

    @register(Dispatch.ALL_TO_ALL)
    def add(self, a, b):
        return (self.rank, a + b)

    @register(Dispatch.RANK_ZERO, execute_mode=Execute.RANK_ZERO)
    def count_zero_call(self):
        self.zero_calls += 1
        return ("rank", self.rank)

    @register(Dispatch.ONE_TO_ALL)
    def zero_call_counts(self):
        return self.zero_calls

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def pid(self):
        return os.getpid()

    @register("hf_test_sum")
    def rank_plus(self, x):
        return self.rank + x

    @register(Dispatch.ONE_TO_ALL)
    def allreduce(self, value):
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        t = torch.tensor([value * (self.rank + 1.0)])
        dist.all_reduce(t)
        return (dist.get_rank(), dist.get_world_size(), t.item())

    @register(Dispatch.ONE_TO_ALL)
    def fail_on_rank(self, bad_rank):
        if self.rank == bad_rank:
            raise ValueError(f"boom on purpose at rank {self.rank}")
        return "ok"


class MeshWorker(Worker):
    """4 ranks laid out as dp=2 x tp=2: dp_rank = rank // 2; tp rank 0 of each dp group collects."""

    def __init__(self):
        super().__init__()
        self._register_dispatch_collect_info("train", dp_rank=self.rank // 2, is_collect=self.rank % 2 == 0)
        self.received = None

    @register(Dispatch.MESH_COMPUTE_PROTO, mesh_name="train")
    def forward(self, data, offset=0):
        self.received = data.batch["x"].clone()
        n = len(data)
        return DataProto.from_dict({"x": data.batch["x"] + offset, "rank": torch.full((n,), self.rank)})

    @register(Dispatch.MESH_COMPUTE_PROTO, mesh_name="train")
    def forward_repeat(self, data, n):
        out = data.repeat(n, interleave=True)
        return DataProto.from_dict({"x": out.batch["x"], "rank": torch.full((len(out),), self.rank)})

    @register(Dispatch.ONE_TO_ALL)
    def last_received(self):
        return self.received


class FlatMeshWorker(Worker):
    """Ranks laid out as dp = world, tp = 1: every rank collects its own chunk."""

    def __init__(self):
        super().__init__()
        self._register_dispatch_collect_info("train", dp_rank=self.rank, is_collect=True)

    @register(Dispatch.MESH_COMPUTE_PROTO, mesh_name="train")
    def forward(self, data):
        return DataProto.from_dict({"x": data.batch["x"] * 2})


@pytest.fixture(scope="module")
def echo(pool2):
    wg = RayWorkerGroup(pool2, RayClassWithInitArgs(EchoWorker, scale=10), name_prefix="echo")
    yield wg
    wg.shutdown()


# ---------------------------------------------------------------------- DP_COMPUTE_PROTO
def test_dp_compute_proto_splits_in_rank_order_and_gathers_in_order(echo):
    out = echo.tag_rows(rows(6))
    assert out.batch["x"].tolist() == [0, 1, 2, 3, 4, 5]
    # rank r got rows [r*3, (r+1)*3)
    assert out.batch["rank"].tolist() == [0, 0, 0, 1, 1, 1]
    assert out.batch["seen"].tolist() == [3] * 6


def test_dp_compute_proto_pads_then_unpads_non_divisible_batch(echo):
    out = echo.tag_rows(rows(5))
    assert len(out) == 5
    assert out.batch["x"].tolist() == [0, 1, 2, 3, 4]
    # padded to 6 rows, so each rank saw 3 rows; rank 1 had rows 3, 4 (+ one padding row, removed)
    assert out.batch["rank"].tolist() == [0, 0, 0, 1, 1]
    assert out.batch["seen"].tolist() == [3] * 5


def test_a_method_is_sent_only_the_columns_it_declares(echo):
    batch = rows(4)
    batch.batch["y"] = torch.zeros(4)
    batch.non_tensor_batch["text"] = np.array(["a", "b", "c", "d"], dtype=object)
    batch.meta_info["temperature"] = 0.7
    out = echo.columns_seen(batch)
    assert out.meta_info["batch"] == ["x"] and out.meta_info["non_tensor"] == []  # "absent" is skipped
    assert out.meta_info["meta"] == {"temperature": 0.7} and out.batch["x"].tolist() == [0, 1, 2, 3]
    assert sorted(batch.batch) == ["x", "y"] and "text" in batch.non_tensor_batch  # the caller's batch is intact
    with pytest.raises(TypeError, match="batch_keys must be a tuple"):
        register(Dispatch.DP_COMPUTE_PROTO, batch_keys=["x"])


def test_submit_starts_a_blocking_method_and_returns_its_future(echo):
    pending = echo.tag_rows.submit(rows(5))  # tag_rows is registered blocking: submit does not wait
    assert isinstance(pending, DataProtoFuture)
    out = pending.get()
    assert out.batch["x"].tolist() == [0, 1, 2, 3, 4]  # padded to 6 and unpadded as the blocking call does
    assert out.batch["rank"].tolist() == [0, 0, 0, 1, 1]


@pytest.mark.parametrize("batch", [1, 3, 5])
def test_dp_compute_proto_unpads_a_method_that_returns_n_rows_per_row(echo, batch):
    """3 prompts x n=2 on 2 ranks: padded to 4 prompts, rank 1 gets [2, pad]; its 4 outputs lose the pad's 2."""
    for n in (1, 2, 3):
        out = echo.repeat_rows(rows(batch), n)
        assert out.batch["x"].tolist() == [i for i in range(batch) for _ in range(n)], n
        per_rank = -(-batch // 2)  # rank 0 gets the first ceil(batch / 2) rows
        assert out.batch["rank"].tolist() == [0] * (per_rank * n) + [1] * ((batch - per_rank) * n), n
        future = echo.repeat_rows_async(rows(batch), n)  # the future's collect unpads the same way
        assert future.get().batch["x"].tolist() == [i for i in range(batch) for _ in range(n)], n


def test_custom_mode_that_pads_must_say_where(echo):
    with pytest.raises(DispatchError, match=r"padded the batch \(pad_size=1\) but gave no DispatchPlan.padding"):
        echo.pads_without_padding(rows(3))


# ---------------------------------------------------------------------- other modes
def test_one_to_all_and_rank_zero(echo):
    assert echo.zero_call_counts() == [0, 0]
    assert echo.count_zero_call() == ("rank", 0)
    assert echo.zero_call_counts() == [1, 0]  # rank 1 never ran it


def test_all_to_all_per_rank_args_and_length_error(echo):
    assert echo.add([1, 2], [10, 20]) == [(0, 11), (1, 22)]
    with pytest.raises(DispatchError, match=r"echo\.add\(\).*argument 'b'.*world_size=2, got length 3"):
        echo.add([1, 2], b=[1, 2, 3])


def test_custom_dispatch_mode(echo):
    assert echo.rank_plus(5) == (0 + 5) + (1 + 5)


def test_non_blocking_non_proto_mode_returns_object_refs(echo):
    refs = echo.pid()
    assert len(refs) == 2 and all(isinstance(r, ray.ObjectRef) for r in refs)
    pids = ray.get(refs)
    assert len(set(pids)) == 2 and os.getpid() not in pids


def test_mesh_dispatch_on_unregistered_mesh_names_the_problem(echo):
    with pytest.raises(WorkerError, match=r"_query_dispatch_info\(\): KeyError: .*no dispatch info for mesh 'nope'"):
        echo.dispatch_info("nope")


# ---------------------------------------------------------------------- env + torch.distributed
def test_env_vars_and_gloo_all_reduce(echo):
    envs = echo.env()
    assert [e["RANK"] for e in envs] == ["0", "1"]
    assert [e["rank"] for e in envs] == [0, 1]
    assert {e["WORLD_SIZE"] for e in envs} == {"2"} and {e["world_size"] for e in envs} == {2}
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
    assert envs[0]["MASTER_ADDR"] == envs[1]["MASTER_ADDR"] == ray.util.get_node_ip_address()
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"] and 0 < int(envs[0]["MASTER_PORT"]) < 65536
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["", ""]  # a pool without GPUs: its workers see none
    # sum over ranks of 2 * (rank + 1) = 2 * (1 + 2) = 6
    assert echo.allreduce(2.0) == [(0, 2, 6.0), (1, 2, 6.0)]


# ---------------------------------------------------------------------- errors
def test_worker_exception_names_group_rank_and_method(echo):
    with pytest.raises(WorkerError, match=r"'echo': rank 1 failed in fail_on_rank\(\).*ValueError.*boom") as info:
        echo.fail_on_rank(1)
    assert (info.value.rank, info.value.method, info.value.group) == (1, "fail_on_rank", "echo")
    assert echo.fail_on_rank(7) == ["ok", "ok"]  # the group still works afterwards


# ---------------------------------------------------------------------- futures
def test_future_flows_into_next_group_without_driver_get(echo, pool2, monkeypatch):
    consumer = RayWorkerGroup(pool2, RayClassWithInitArgs(EchoWorker), name_prefix="consumer")
    try:
        fetched = []
        real_get, real_wait = ray.get, ray.wait

        def spy_get(refs, *a, **k):
            fetched.extend(refs if isinstance(refs, list) else [refs])
            return real_get(refs, *a, **k)

        def spy_wait(refs, *a, **k):
            fetched.extend(refs)
            return real_wait(refs, *a, **k)

        monkeypatch.setattr(ray, "get", spy_get)
        monkeypatch.setattr(ray, "wait", spy_wait)
        future = echo.scale_rows(rows(4))  # blocking=False
        assert isinstance(future, DataProtoFuture)
        out = consumer.tag_rows(future)
        assert not set(fetched) & set(future.futures), "the driver fetched the producer's outputs"
        assert out.batch["x"].tolist() == [0, 10, 20, 30]
        assert out.batch["rank"].tolist() == [0, 0, 1, 1]
        monkeypatch.undo()

        # A future whose batch (3 rows, producer padded and unpadded) is not divisible by the consumer's 2 ranks.
        expected = r"'consumer': rank \d failed in tag_rows\(\): ValueError: a DataProtoFuture of batch size 3"
        lazy = consumer.tag_rows(echo.scale_rows(rows(3)))  # returns at once: the failure shows when it is read
        with pytest.raises(WorkerError, match=expected):
            lazy.batch
        assert echo.scale_rows(rows(3)).get().batch["x"].tolist() == [0, 10, 20]
    finally:
        consumer.shutdown()


def test_future_split_by_rank_gives_each_consumer_rank_its_producer_rank_output(echo, pool2, monkeypatch):
    consumer = RayWorkerGroup(pool2, RayClassWithInitArgs(EchoWorker), name_prefix="consumer")
    try:
        for prompts in (4, 3):  # 4: even split, outputs handed over by rank; 3: padded, the lazy pieces instead
            lazy = consumer.tag_rows(echo.repeat_rows_async(rows(prompts), 2))
            fetched = []
            real_get = ray.get
            monkeypatch.setattr(ray, "get", lambda refs, *a, **k: fetched.append(refs) or real_get(refs, *a, **k))
            future = echo.repeat_rows_async(rows(prompts), 2)
            by_rank = consumer.tag_rows(future.split_by_rank())
            monkeypatch.undo()
            # each row i twice, in order, the first half on consumer rank 0 (the same rows either way)
            expected = [i for i in range(prompts) for _ in range(2)]
            assert by_rank.batch["x"].tolist() == lazy.batch["x"].tolist() == expected
            assert by_rank.batch["rank"].tolist() == lazy.batch["rank"].tolist() == [0] * prompts + [1] * prompts
            assert not [r for r in fetched if r in future.futures], "the driver fetched the producer's outputs"
            assert isinstance(future.split_by_rank().chunk(2)[0], ray.ObjectRef) == (prompts == 4)
    finally:
        consumer.shutdown()


# ---------------------------------------------------------------------- mesh dispatch
def test_mesh_dispatch_sends_a_chunk_of_one_reader_inline(ray_session, monkeypatch):
    pool = ResourcePool([2], cpus_per_bundle=0.5, name_prefix="test_flat_mesh")
    wg = None
    try:
        wg = RayWorkerGroup(pool, RayClassWithInitArgs(FlatMeshWorker), name_prefix="flat_mesh")
        puts = []
        real_put = ray.put
        monkeypatch.setattr(ray, "put", lambda v, *a, **k: puts.append(v) or real_put(v, *a, **k))
        out = wg.forward(rows(5))  # padded to 6, unpadded back
        monkeypatch.undo()
        assert puts == [], "a chunk only one rank reads goes with the call, not through the object store"
        assert out.batch["x"].tolist() == [0, 2, 4, 6, 8]
    finally:
        if wg is not None:
            wg.shutdown()
        pool.remove()


def test_mesh_dispatch_dp2_tp2(ray_session, monkeypatch):
    pool = ResourcePool([4], cpus_per_bundle=0.5, name_prefix="test_mesh")
    wg = None
    try:
        wg = RayWorkerGroup(pool, RayClassWithInitArgs(MeshWorker), name_prefix="mesh")
        info = wg.dispatch_info("train")
        assert (info.dp_rank, info.is_collect, info.dp_size) == ((0, 0, 1, 1), (True, False, True, False), 2)

        puts = []
        real_put = ray.put
        monkeypatch.setattr(ray, "put", lambda v, *a, **k: puts.append(v) or real_put(v, *a, **k))
        out = wg.forward(rows(8), offset=100)
        monkeypatch.undo()
        assert len(puts) == 2, "one ray.put per dp chunk, shared by its tp peers"
        received = [r.tolist() for r in wg.last_received()]
        assert received == [[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7], [4, 5, 6, 7]]
        assert out.batch["x"].tolist() == [100 + i for i in range(8)]
        assert out.batch["rank"].tolist() == [0] * 4 + [2] * 4  # one collecting rank per dp group, in dp order

        out = wg.forward(rows(5))  # padded to 6 for dp=2, unpadded back to 5
        assert out.batch["x"].tolist() == [0, 1, 2, 3, 4]
        assert out.batch["rank"].tolist() == [0, 0, 0, 2, 2]
        # 3 rows x n=2 for dp=2: padded to 4; dp rank 1 (collected from rank 2) returns [2, 2, pad, pad]
        out = wg.forward_repeat(rows(3), 2)
        assert out.batch["x"].tolist() == [0, 0, 1, 1, 2, 2]
        assert out.batch["rank"].tolist() == [0, 0, 0, 0, 2, 2]
    finally:
        if wg is not None:
            wg.shutdown()
        pool.remove()


# ---------------------------------------------------------------------- plugins reach every worker class
class PluginProbe(Worker):
    """Records, in its own constructor (after ``Worker.__init__``), whether the plugin module was imported."""

    def __init__(self):
        super().__init__()
        self.seen = [name for name in sys.modules if name.startswith("hybridflow_plugin_")]

    @register(Dispatch.ONE_TO_ALL)
    def probe(self):
        return self.seen, os.getpid()


def test_plugins_are_imported_in_every_rank_before_the_worker_constructor(pool2, tmp_path):
    from hybridflow.plugins import plugin_env

    plugin = tmp_path / "probe_plugin.py"
    plugin.write_text("import os\nIMPORTED_IN = os.getpid()\n")
    wg = RayWorkerGroup(pool2, RayClassWithInitArgs(PluginProbe), name_prefix="plugins",
                        env=plugin_env([str(plugin)]))
    try:
        results = wg.probe()
        assert [seen for seen, _ in results] == [["hybridflow_plugin_probe_plugin"]] * 2
        assert all(pid != os.getpid() for _, pid in results)
    finally:
        wg.shutdown()
