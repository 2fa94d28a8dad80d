"""A batch with futures unioned into it, as the dispatch hands it to the ranks (no Ray: the futures are stand-ins)."""

import torch

from hybridflow.controller.decorator import Dispatch, Execute, MethodSpec
from hybridflow.controller.dispatch import dispatch_dp_compute_data_proto
from hybridflow.controller.futures import DataProtoFuture, Joined, PendingBatch
from hybridflow.protocol import DataProto


class StandIn(DataProtoFuture):
    """A future whose output is ``value`` (``get`` counts its reads)."""

    def __init__(self, value):
        super().__init__(lambda outputs: value, [], source=("producer", "make", []))
        self.value, self.reads = value, 0

    def get(self):
        self.reads += 1
        return self.value


class Group:
    world_size = 2


def rows(n, **columns):
    return DataProto.from_dict({"x": torch.arange(n), **columns})


def test_joined_adds_each_piece_then_keeps_the_declared_columns():
    spec = MethodSpec(Dispatch.DP_COMPUTE_PROTO, Execute.ALL, True, None, batch_keys=("x", "y"))
    joined = Joined(rows(2), [DataProto.from_dict({"y": torch.tensor([5, 6]), "z": torch.zeros(2)})],
                    spec.select_inputs)
    out = joined.get()
    assert sorted(out.batch) == ["x", "y"] and out.batch["y"].tolist() == [5, 6]


def test_an_even_split_gives_each_rank_its_chunk_of_the_columns_and_of_every_future():
    future = StandIn(DataProto.from_dict({"y": torch.arange(4) * 10}))
    plan = dispatch_dp_compute_data_proto(Group(), PendingBatch(rows(4), [future]))
    pieces = plan.args[0]
    assert [type(p) for p in pieces] == [Joined, Joined] and future.reads == 0  # nothing read on the driver
    assert [p.known.batch["x"].tolist() for p in pieces] == [[0, 1], [2, 3]]
    assert [p.pieces[0].dispatch_fn.index for p in pieces] == [0, 1]  # chunk i of the future for rank i
    # what rank 1 would compute, with the stand-in's output: rows 2, 3 of both
    rank1 = pieces[1].known.union(pieces[1].pieces[0].dispatch_fn(future.value))
    assert rank1.batch["y"].tolist() == [20, 30]


def test_a_batch_that_needs_padding_is_read_on_the_driver_first():
    future = StandIn(DataProto.from_dict({"y": torch.arange(3) * 10}))
    plan = dispatch_dp_compute_data_proto(Group(), PendingBatch(rows(3), [future]))
    assert future.reads == 1 and plan.pad_size == 1  # 3 rows over 2 ranks: padded with a copy of row 0
    assert [p.batch["y"].tolist() for p in plan.args[0]] == [[0, 10], [20, 0]]


def test_a_rows_per_row_future_hands_each_rank_its_producers_output():
    from hybridflow.controller.decorator import get_method_spec, register
    from hybridflow.controller.dispatch import Collector, collect_dp_compute_data_proto

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, rows_per_row=True)
    def rollout(self, prompts):
        return prompts

    assert get_method_spec(rollout).rows_per_row
    # two producer ranks, nothing padded: output i is chunk i of the collected batch
    future = DataProtoFuture(Collector(collect_dp_compute_data_proto, [0, 1]), ["out0", "out1"], by_rank=True)
    plan = dispatch_dp_compute_data_proto(Group(), PendingBatch(rows(4), [future]))
    assert [p.pieces for p in plan.args[0]] == [["out0"], ["out1"]]  # the producer rank's own output, no re-split
