"""``DataProto.union`` of a future: recorded without waiting, read on the first column access (layer 1, no Ray)."""

import pickle

import pytest
import torch

from hybridflow.protocol import DataProto


class FakeFuture:
    """A future-like object: ``get()`` counts its calls and returns (or raises) what it was given."""

    __dataproto_future__ = True

    def __init__(self, value=None, error=None):
        self.value, self.error, self.calls = value, error, 0

    def get(self):
        self.calls += 1
        if self.error is not None:
            raise self.error
        return self.value


def base():
    return DataProto.from_dict({"a": torch.arange(4)}, meta_info={"step": 1})


def test_union_of_a_future_waits_for_nothing_until_a_column_is_read():
    future = FakeFuture(DataProto.from_dict({"b": torch.arange(4) * 2}, meta_info={"m": 3}))
    batch = base()
    assert batch.union(future) is batch and future.calls == 0
    known, pending = batch.split_pending()  # what the controller forwards: no wait either
    assert future.calls == 0 and pending == [future] and list(known.batch) == ["a"]
    assert batch.batch["b"].tolist() == [0, 2, 4, 6]  # the read waits, once
    assert batch.meta_info == {"step": 1, "m": 3} and future.calls == 1
    assert len(batch) == 4 and future.calls == 1


def test_pending_futures_are_added_in_union_order_and_checked_like_a_plain_union():
    first = FakeFuture(DataProto.from_dict({"b": torch.ones(4)}))
    clash = FakeFuture(DataProto.from_dict({"b": torch.zeros(4)}))
    batch = base().union(first).union(clash)
    with pytest.raises(ValueError, match="key 'b' is in both"):
        batch.batch


def test_reading_a_column_of_a_failed_producer_raises_its_error():
    batch = base().union(FakeFuture(error=RuntimeError("worker group 'critic': rank 1 failed")))
    with pytest.raises(RuntimeError, match="'critic': rank 1"):
        batch.non_tensor_batch


def test_pickling_reads_the_pending_futures_first():
    batch = base().union(FakeFuture(DataProto.from_dict({"b": torch.arange(4) + 7})))
    copy = pickle.loads(pickle.dumps(batch))
    assert copy.batch["b"].tolist() == [7, 8, 9, 10] and copy.batch["a"].tolist() == [0, 1, 2, 3]
