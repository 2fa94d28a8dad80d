"""Controller pieces in the driver process, without starting actors: Worker env handling, register, dispatch
plans, mesh layout validation, the dispatch-mode registry and DataProtoFuture chunking."""

import os

import pytest
import ray
import torch

from hybridflow.controller import (
    DataProtoFuture,
    Dispatch,
    DispatchError,
    Execute,
    MeshDispatchInfo,
    Worker,
    get_dispatch_mode,
    get_method_spec,
    register,
    register_dispatch_mode,
)
from hybridflow.controller.worker import MASTER_LATER
from hybridflow.controller.dispatch import (
    Collector,
    collect_dp_compute_data_proto,
    collect_rank_zero,
    dispatch_all_to_all,
    dispatch_dp_compute_data_proto,
)
from hybridflow.protocol import DataProto
from hybridflow.utils.metrics import Max, Mean, Min, Span, Sum


class FakeGroup:
    """What dispatch functions read from a worker group: its size."""

    def __init__(self, world_size):
        self.world_size = world_size


def rows(n, start=0):
    return DataProto.from_dict({"x": torch.arange(start, start + n)})


# ---------------------------------------------------------------------- Worker
@pytest.fixture
def clean_env(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # registers the original value for restoration; "" counts as unset
    return monkeypatch


def test_worker_defaults_to_single_process_and_picks_master(clean_env):
    w = Worker()
    assert (w.rank, w.world_size, w.local_rank, w.device_name) == (0, 1, 0, "cpu")
    addr, port = w.get_master_addr_port()
    assert addr and 0 < port < 65536


def test_a_later_rank_may_start_before_rank_0_named_the_master(clean_env):
    clean_env.setenv("RANK", "1")
    clean_env.setenv("WORLD_SIZE", "2")
    clean_env.setenv(MASTER_LATER, "1")
    w = Worker()  # rank 0 is still starting: its address arrives by set_master_addr_port
    w.set_master_addr_port("127.0.0.1", 29400)
    assert w.get_master_addr_port() == ("127.0.0.1", 29400)
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("127.0.0.1", "29400")


def test_worker_rank_checks(clean_env):
    clean_env.setenv("RANK", "1")
    clean_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="rank 1 started without MASTER_ADDR"):
        Worker()
    clean_env.setenv("RANK", "2")
    with pytest.raises(ValueError, match=r"RANK=2 is not in \[0, WORLD_SIZE=2\)"):
        Worker()


def test_worker_mesh_registration(clean_env):
    w = Worker()
    w._register_dispatch_collect_info("train", 1, False)
    w._register_dispatch_collect_info("train", 1, False)  # same values again: fine
    assert w._query_dispatch_info("train") == (1, False)
    with pytest.raises(ValueError, match="already registered"):
        w._register_dispatch_collect_info("train", 0, True)
    with pytest.raises(KeyError, match="no dispatch info for mesh 'gen'.*registered: \\['train'\\]"):
        w._query_dispatch_info("gen")


# ---------------------------------------------------------------------- register
def test_register_stores_spec_and_validates():
    @register(Dispatch.MESH_COMPUTE_PROTO, execute_mode=Execute.ALL, blocking=False, mesh_name="m")
    def f(self, x):
        return x

    spec = get_method_spec(f)
    assert (spec.dispatch_mode, spec.execute_mode, spec.blocking, spec.mesh_name) == (
        Dispatch.MESH_COMPUTE_PROTO, Execute.ALL, False, "m"
    )
    assert f(None, 3) == 3 and f.__name__ == "f"
    with pytest.raises(ValueError, match="needs mesh_name"):
        register(Dispatch.MESH_COMPUTE_PROTO)
    with pytest.raises(ValueError, match="only applies to Dispatch.MESH_COMPUTE_PROTO"):
        register(Dispatch.ONE_TO_ALL, mesh_name="m")
    with pytest.raises(TypeError, match="with parentheses"):
        register(lambda self: None)


# ---------------------------------------------------------------------- dispatch plans
def test_dp_plan_pads_and_collect_unpads():
    plan = dispatch_dp_compute_data_proto(FakeGroup(2), rows(5), 7, flag="k")
    assert plan.pad_size == 1
    chunks, scalars = plan.args
    assert [c.batch["x"].tolist()[:2] for c in chunks] == [[0, 1], [3, 4]] and [len(c) for c in chunks] == [3, 3]
    assert scalars == [7, 7] and plan.kwargs == {"flag": ["k", "k"]}
    assert plan.padding == [(3, 0), (3, 1)]  # rank 1's chunk: rows 3, 4 and one padding row at its end
    out = Collector(collect_dp_compute_data_proto, [0, 1], plan.padding)(chunks)
    assert out.batch["x"].tolist() == [0, 1, 2, 3, 4]


def test_dp_plan_padding_spans_several_chunks():
    # 1 row over 4 ranks: padded with 3 copies of row 0, so ranks 1..3 hold padding only
    plan = dispatch_dp_compute_data_proto(FakeGroup(4), rows(1))
    assert (plan.pad_size, plan.padding) == (3, [(1, 0), (1, 1), (1, 1), (1, 1)])
    # 5 rows over 4 ranks: 8 rows of 2 per chunk; rows 5..7 are padding: half of chunk 2, all of chunk 3
    plan = dispatch_dp_compute_data_proto(FakeGroup(4), rows(5))
    assert (plan.pad_size, plan.padding) == (3, [(2, 0), (2, 0), (2, 1), (2, 2)])
    assert dispatch_dp_compute_data_proto(FakeGroup(2), rows(4)).padding == [(2, 0), (2, 0)]
    assert dispatch_dp_compute_data_proto(FakeGroup(2), 7).padding is None  # no DataProto argument


@pytest.mark.parametrize("batch,n", [(1, 2), (3, 2), (5, 3), (5, 1), (4, 3)])
def test_collect_removes_the_rows_padding_produced_when_a_method_repeats_rows(batch, n):
    """A method returning n rows per input row (a rollout's n samples): the padding's n rows each go."""
    plan = dispatch_dp_compute_data_proto(FakeGroup(2), rows(batch))
    outputs = [chunk.repeat(n, interleave=True) for chunk in plan.args[0]]  # what each rank would return
    out = Collector(collect_dp_compute_data_proto, [0, 1], plan.padding)(outputs)
    assert out.batch["x"].tolist() == [i for i in range(batch) for _ in range(n)]


def test_collect_rejects_padded_output_it_cannot_unpad():
    plan = dispatch_dp_compute_data_proto(FakeGroup(2), rows(3))  # rank 1: rows 2 and a padding row
    outputs = [plan.args[0][0], rows(3)]  # rank 1 returned 3 rows for its 2 input rows
    with pytest.raises(ValueError, match="output 1 of 2: the method returned 3 rows for an input chunk of 2 rows"):
        Collector(collect_dp_compute_data_proto, [0, 1], plan.padding)(outputs)
    with pytest.raises(TypeError, match="output 1 of 2 must be a DataProto, got dict"):
        Collector(collect_dp_compute_data_proto, [0, 1], plan.padding)([rows(2), {"x": 1}])


def test_dp_plan_rejects_mismatched_batches():
    with pytest.raises(DispatchError, match="same batch size"):
        dispatch_dp_compute_data_proto(FakeGroup(2), rows(4), rows(6))


def test_all_to_all_error_names_argument_and_lengths():
    with pytest.raises(DispatchError, match="argument 1 must be a list of length world_size=3, got length 2"):
        dispatch_all_to_all(FakeGroup(3), [1, 2, 3], [1, 2])
    with pytest.raises(DispatchError, match="argument 0 .* got a int"):
        dispatch_all_to_all(FakeGroup(3), 5)


def test_collect_dp_keeps_the_slowest_ranks_worker_seconds():
    outs = [DataProto(meta_info={"worker_s/update_actor": Max(t), "metrics": {"rank": r}})
            for r, t in enumerate((0.2, 0.5))]
    merged = collect_dp_compute_data_proto(outs)
    assert merged.meta_info["worker_s/update_actor"] == 0.5  # the driver waited for rank 1
    assert merged.meta_info["metrics"] == {"rank": 0}  # other meta_info: the first output's


def test_collect_dp_pools_each_declared_metric_by_its_kind_over_two_ranks():
    # two ranks' hand-made outputs, as report_time, send_weights-like totals, the LoRA probe check and an update's
    # already-pooled metrics declare them
    rank0 = {"worker_s/generate_sequences": Max(1.5), "seed": 7,
             "metrics": {"actor/pg_loss": 0.25, "sync/bytes": Sum(100.0), "x/mean": Mean(6.0, 3.0),
                         "x/min": Min(2.0)},
             "sync_metrics": {"sync/verified": Min(1.0), "sync/probe_max_abs_diff": Max(1e-6)}}
    rank1 = {"worker_s/generate_sequences": Max(2.5), "seed": 8,
             "metrics": {"actor/pg_loss": 0.25, "sync/bytes": Sum(40.0), "x/mean": Mean(10.0, 1.0),
                         "x/min": Min(-1.0)},
             "sync_metrics": {"sync/verified": Min(0.0), "sync/probe_max_abs_diff": Max(3e-6)},
             "worker_s/only_here": Max(0.75)}
    meta = collect_dp_compute_data_proto([DataProto(meta_info=rank0), DataProto(meta_info=rank1)]).meta_info
    assert meta["worker_s/generate_sequences"] == 2.5 and meta["worker_s/only_here"] == 0.75
    assert meta["seed"] == 7  # no kind: the first rank's
    assert meta["metrics"] == {"actor/pg_loss": 0.25, "sync/bytes": 140.0, "x/mean": 4.0, "x/min": -1.0}
    assert meta["sync_metrics"] == {"sync/verified": 0.0, "sync/probe_max_abs_diff": 3e-6}
    with pytest.raises(TypeError):  # one key declared as two kinds
        collect_dp_compute_data_proto([DataProto(meta_info={"m": Max(1.0)}), DataProto(meta_info={"m": Sum(1.0)})])


def test_collect_dp_pools_a_calls_wall_clock_spans_into_earliest_start_and_latest_end():
    outs = [DataProto(meta_info={"worker_span/update_actor": Span(s, e)}) for s, e in ((10.0, 10.4), (10.1, 10.5))]
    merged = collect_dp_compute_data_proto(outs)
    assert merged.meta_info["worker_span/update_actor"] == [(10.0, 10.5)]  # rank 0 started, rank 1 ended


def test_collect_dp_rejects_non_dataproto_output():
    with pytest.raises(TypeError, match="output 1 of 2 is a dict"):
        collect_dp_compute_data_proto([rows(1), {"x": 1}])


# ---------------------------------------------------------------------- mesh layouts
def test_mesh_info_orders_collectors_by_dp_rank():
    # 6 ranks, dp=3 x tp=2 with dp as the inner axis: dp_rank = rank % 3; tp rank 1 collects.
    info = MeshDispatchInfo("m", (0, 1, 2, 0, 1, 2), (False, False, False, True, True, True))
    assert (info.dp_size, info.collect_ranks) == (3, (3, 4, 5))


def test_mesh_info_rejects_bad_layouts():
    with pytest.raises(DispatchError, match=r"exactly one rank per dp rank.*dp rank 0: collecting ranks \[0, 1\]"):
        MeshDispatchInfo("m", (0, 0, 1, 1), (True, True, True, False))
    with pytest.raises(DispatchError, match=r"dp rank 1: collecting ranks \[\]"):
        MeshDispatchInfo("m", (0, 0, 1, 1), (True, False, False, False))
    with pytest.raises(DispatchError, match="no gap"):
        MeshDispatchInfo("m", (0, 2), (True, True))


# ---------------------------------------------------------------------- registry
def test_registry_lookup_and_duplicates():
    with pytest.raises(KeyError, match="unknown dispatch mode 'nope'.*DP_COMPUTE_PROTO"):
        get_dispatch_mode("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_dispatch_mode("ONE_TO_ALL", dispatch_all_to_all, list)
    assert get_dispatch_mode(Dispatch.DP_COMPUTE_PROTO).returns_proto


# ---------------------------------------------------------------------- futures
def test_future_chunks_lazily_and_materializes_in_registered_method(ray_session):
    refs = [ray.put(rows(3, 0)), ray.put(rows(3, 3))]
    future = DataProtoFuture(Collector(collect_dp_compute_data_proto, [0, 1]), refs)
    first, second = future.chunk(2)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def head(self, data, n):
        return data.batch["x"].tolist()[:n]

    assert head(None, second, 10) == [3, 4, 5]  # the wrapper called .get() on the future
    assert first.get().batch["x"].tolist() == [0, 1, 2]
    assert [p.get().batch["x"].tolist() for p in second.chunk(3)] == [[3], [4], [5]]  # chunk of a chunk
    with pytest.raises(ValueError, match="batch size 6 cannot be split into 4 equal chunks"):
        future.chunk(4)[0].get()


def test_future_split_by_rank_hands_out_the_outputs_only_when_they_are_the_chunks(ray_session):
    refs = [ray.put(rows(3, 0)), ray.put(rows(3, 3)), ray.put(rows(3, 6))]
    counted = DataProtoFuture(Collector(collect_dp_compute_data_proto, [0, 2]), refs).split_by_rank()
    assert counted.chunk(2) == [refs[0], refs[2]]  # the counted outputs themselves, in collect order
    # any other split (or padding the collect removes, or a plain future) keeps the lazy pieces of the batch
    assert [p.get().batch["x"].tolist() for p in counted.chunk(3)] == [[0, 1], [2, 6], [7, 8]]
    padded = DataProtoFuture(Collector(collect_dp_compute_data_proto, [0, 1], [(3, 0), (3, 1)]), refs[:2])
    assert all(isinstance(p, DataProtoFuture) for p in padded.split_by_rank().chunk(2))
    assert all(isinstance(p, DataProtoFuture) for p in DataProtoFuture(counted.collect_fn, refs).chunk(2))
    assert isinstance(counted.chunk(1)[0], DataProtoFuture)
    first = DataProtoFuture(Collector(collect_rank_zero, [0, 1]), refs[:2]).split_by_rank()  # not a concatenation
    assert all(isinstance(p, DataProtoFuture) for p in first.chunk(2))
