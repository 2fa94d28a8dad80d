"""Tests for hybridflow.protocol.DataProto; expected values are written out by hand."""

import pickle

import numpy as np
import pytest
import torch

from hybridflow.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto


def make(n: int = 4) -> DataProto:
    """Rows i = 0..n-1: x = [i, 10 i], y = 0.5 i, name = "r{i}", info = {"i": i}."""
    return DataProto.from_dict(
        tensors={
            "x": torch.tensor([[i, 10 * i] for i in range(n)], dtype=torch.long).reshape(n, 2),
            "y": torch.tensor([0.5 * i for i in range(n)], dtype=torch.float32),
        },
        non_tensors={"name": [f"r{i}" for i in range(n)], "info": [{"i": i} for i in range(n)]},
        meta_info={"temperature": 1.0, "nested": {"a": [1, 2]}},
    )


def rows(d: DataProto) -> list[int]:
    """The original row ids, read from the tensor column and checked against the object column."""
    ids = d.batch["x"][:, 0].tolist()
    assert d.batch["x"][:, 1].tolist() == [10 * i for i in ids]
    assert d.batch["y"].tolist() == [0.5 * i for i in ids]
    assert list(d.non_tensor_batch["name"]) == [f"r{i}" for i in ids]
    assert [e["i"] for e in d.non_tensor_batch["info"]] == ids
    return ids


# ---------------------------------------------------------------- construction
def test_from_dict_and_len():
    d = make(3)
    assert len(d) == 3 and d.batch_size == 3
    assert d.non_tensor_batch["name"].dtype == object and d.non_tensor_batch["name"].shape == (3,)
    assert rows(d) == [0, 1, 2]


def test_mismatched_sizes_error_names_every_key():
    with pytest.raises(ValueError) as e:
        DataProto(
            batch={"a": torch.zeros(3), "b": torch.zeros(2, 5)},
            non_tensor_batch={"c": np.zeros(3)},
        )
    msg = str(e.value)
    assert "batch['a']: 3" in msg and "batch['b']: 2" in msg and "non_tensor_batch['c']: 3" in msg


def test_size_check_after_manual_assignment():
    d = make(3)
    d.batch["bad"] = torch.zeros(5)
    with pytest.raises(ValueError, match="'bad'"):
        len(d)


def test_wrong_types_rejected():
    with pytest.raises(TypeError, match="'a'"):
        DataProto(batch={"a": np.zeros(3)})
    with pytest.raises(TypeError, match="'s'"):
        DataProto(batch={"s": torch.tensor(1.0)})
    with pytest.raises(TypeError, match="'n'"):
        DataProto(non_tensor_batch={"n": [1, 2]})


def test_from_single_dict_splits_types_and_keeps_lists_one_dimensional():
    # Equal-length inner lists must not turn into a 2-D array.
    d = DataProto.from_single_dict(
        {"t": torch.arange(2), "a": np.array([1.0, 2.0]), "msgs": [[{"r": "u"}, {"r": "a"}], [{"r": "u"}, {"r": "a"}]]},
        meta_info={"k": 1},
    )
    assert set(d.batch) == {"t"} and set(d.non_tensor_batch) == {"a", "msgs"}
    assert d.non_tensor_batch["msgs"].shape == (2,)
    assert d.non_tensor_batch["msgs"][1] == [{"r": "u"}, {"r": "a"}]
    assert d.meta_info == {"k": 1}
    with pytest.raises(TypeError, match="'bad'"):
        DataProto.from_single_dict({"bad": 3})


def test_empty_and_zero_length():
    assert len(DataProto()) == 0
    only_np = DataProto.from_dict(non_tensors={"s": ["a", "b", "c"]})
    assert len(only_np) == 3
    assert only_np[1:].non_tensor_batch["s"].tolist() == ["b", "c"]
    zero = make(0)
    assert len(zero) == 0 and zero.batch["x"].shape == (0, 2)
    assert len(zero.repeat(3)) == 0
    assert [len(c) for c in zero.chunk(2)] == [0, 0]
    assert zero.split(2) == []


# ---------------------------------------------------------------- indexing
def test_getitem_variants():
    d = make(5)
    assert rows(d[1:4]) == [1, 2, 3]
    assert rows(d[::2]) == [0, 2, 4]
    assert rows(d[::-1]) == [4, 3, 2, 1, 0]
    assert rows(d[[3, 0]]) == [3, 0]
    assert rows(d[np.array([4, 1])]) == [4, 1]
    assert rows(d[torch.tensor([2, 2])]) == [2, 2]
    assert rows(d[np.array([True, False, False, True, False])]) == [0, 3]
    assert rows(d[torch.tensor([False, True, False, False, True])]) == [1, 4]
    assert rows(d[[]]) == []
    one = d[-1]
    assert len(one) == 1 and rows(one) == [4]
    with pytest.raises(IndexError):
        d[5]
    with pytest.raises(IndexError):
        d[[0, 7]]
    with pytest.raises(IndexError, match="length 2"):
        d[np.array([True, False])]
    with pytest.raises(TypeError):
        d["x"]


def test_slice_is_view_and_meta_info_is_copied():
    d = make(4)
    s = d[0:2]
    s.batch["x"][0, 0] = 99
    assert d.batch["x"][0, 0] == 99  # tensors are views for unit-step slices
    s.meta_info["nested"]["a"].append(3)
    assert d.meta_info["nested"]["a"] == [1, 2]


# ---------------------------------------------------------------- select / pop / rename
def test_select():
    d = make(3)
    s = d.select(batch_keys=["x"], non_tensor_batch_keys=[], meta_info_keys=["temperature"])
    assert set(s.batch) == {"x"} and s.non_tensor_batch == {} and s.meta_info == {"temperature": 1.0}
    everything = d.select()
    assert set(everything.batch) == {"x", "y"} and set(everything.non_tensor_batch) == {"name", "info"}
    assert everything.batch["x"] is d.batch["x"]
    deep = d.select(batch_keys=["x"], deepcopy=True)
    deep.batch["x"][0, 0] = 7
    deep.non_tensor_batch["info"][0]["i"] = 100
    assert d.batch["x"][0, 0] == 0 and d.non_tensor_batch["info"][0]["i"] == 0
    with pytest.raises(KeyError, match="'nope'"):
        d.select(batch_keys=["nope"])


def test_pop():
    d = make(3)
    p = d.pop(batch_keys=["y"], non_tensor_batch_keys=["info"], meta_info_keys=["temperature"])
    assert set(p.batch) == {"y"} and set(p.non_tensor_batch) == {"info"} and p.meta_info == {"temperature": 1.0}
    assert set(d.batch) == {"x"} and set(d.non_tensor_batch) == {"name"} and set(d.meta_info) == {"nested"}
    assert p.batch["y"].tolist() == [0.0, 0.5, 1.0]
    nothing = d.pop()
    assert nothing.batch == {} and set(d.batch) == {"x"}
    with pytest.raises(KeyError, match="'missing'"):
        d.pop(batch_keys=["x", "missing"])
    assert set(d.batch) == {"x"}  # nothing removed when a key is missing


def test_rename():
    d = make(2)
    assert d.rename(["x", "name"], ["xx", "label"]) is d
    assert set(d.batch) == {"xx", "y"} and set(d.non_tensor_batch) == {"label", "info"}
    d.rename("y", "z")
    assert d.batch["z"].tolist() == [0.0, 0.5]
    with pytest.raises(ValueError, match="'z'"):
        d.rename("xx", "z")
    with pytest.raises(KeyError, match="'q'"):
        d.rename("q", "w")
    # swapping two names is allowed
    d.rename(["xx", "z"], ["z", "xx"])
    assert d.batch["xx"].tolist() == [0.0, 0.5]


# ---------------------------------------------------------------- union
def test_union_adds_columns_and_meta():
    d = make(2)
    other = DataProto.from_dict(
        tensors={"x": torch.tensor([[0, 0], [1, 10]]), "r": torch.tensor([1.0, -1.0])},
        non_tensors={"name": ["r0", "r1"], "tag": ["a", "b"]},
        meta_info={"temperature": 1.0, "step": 3},
    )
    assert d.union(other) is d
    assert set(d.batch) == {"x", "y", "r"} and set(d.non_tensor_batch) == {"name", "info", "tag"}
    assert d.batch["r"].tolist() == [1.0, -1.0] and d.meta_info["step"] == 3


def test_union_conflicts_name_the_key():
    d = make(2)
    with pytest.raises(ValueError, match="'x'"):
        d.union(DataProto.from_dict(tensors={"x": torch.tensor([[0, 0], [1, 11]])}))
    with pytest.raises(ValueError, match="'name'"):
        d.union(DataProto.from_dict(non_tensors={"name": ["r0", "other"]}))
    with pytest.raises(ValueError, match="'temperature'"):
        d.union(DataProto(meta_info={"temperature": 0.7}))
    with pytest.raises(ValueError, match="3"):
        d.union(make(3))
    # equal NaNs and equal nested objects are not conflicts
    a = DataProto.from_dict(tensors={"v": torch.tensor([float("nan"), 1.0])}, non_tensors={"o": [{"k": [1]}, None]})
    b = DataProto.from_dict(tensors={"v": torch.tensor([float("nan"), 1.0])}, non_tensors={"o": [{"k": [1]}, None]})
    a.union(b)


def test_union_into_empty_takes_other_size():
    d = DataProto().union(make(3))
    assert rows(d) == [0, 1, 2]


# ---------------------------------------------------------------- chunk / split / concat
def test_chunk_concat_round_trip():
    d = make(6)
    pieces = d.chunk(3)
    assert [rows(p) for p in pieces] == [[0, 1], [2, 3], [4, 5]]
    back = DataProto.concat(pieces)
    assert rows(back) == [0, 1, 2, 3, 4, 5]
    assert back.meta_info == d.meta_info


def test_chunk_indivisible_points_to_padding():
    with pytest.raises(ValueError, match=r"5.*chunks=2.*pad_dataproto_to_divisor"):
        make(5).chunk(2)


def test_split_last_piece_smaller():
    assert [rows(p) for p in make(5).split(2)] == [[0, 1], [2, 3], [4]]
    assert [rows(p) for p in make(2).split(8)] == [[0, 1]]


def test_concat_errors():
    a, b = make(2), make(2)
    b.pop(batch_keys=["y"])
    b.batch["w"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"\['y'\].*\['w'\]"):
        DataProto.concat([a, b])
    c = make(2)
    c.batch["x"] = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="'x'"):
        DataProto.concat([a, c])
    with pytest.raises(ValueError, match="empty"):
        DataProto.concat([])


def test_concat_meta_from_first():
    a, b = make(1), make(1)
    b.meta_info = {"other": True}
    assert DataProto.concat([a, b]).meta_info == a.meta_info


# ---------------------------------------------------------------- repeat / reorder / to
def test_repeat_interleave_and_tiled():
    d = make(3)
    assert rows(d.repeat(2, interleave=True)) == [0, 0, 1, 1, 2, 2]
    assert rows(d.repeat(repeat_times=3, interleave=False)) == [0, 1, 2, 0, 1, 2, 0, 1, 2]
    assert rows(d.repeat()) == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError):
        d.repeat(0)


def test_reorder_in_place():
    d = make(4)
    assert d.reorder(torch.tensor([2, 0, 3, 1])) is None
    assert rows(d) == [2, 0, 3, 1]
    d.reorder([1, 0, 2, 3])
    assert rows(d) == [0, 2, 3, 1]
    with pytest.raises(ValueError, match="permutation"):
        d.reorder([0, 0, 1, 2])
    with pytest.raises(ValueError, match="permutation"):
        d.reorder([0, 1])


def test_to_device():
    d = make(2)
    assert d.to("cpu") is d and d.batch["x"].device.type == "cpu"


# ---------------------------------------------------------------- padding
def test_pad_unpad_round_trip():
    d = make(5)
    padded, pad = pad_dataproto_to_divisor(d, 4)
    assert pad == 3 and rows(padded) == [0, 1, 2, 3, 4, 0, 1, 2]
    assert [rows(c) for c in padded.chunk(4)] == [[0, 1], [2, 3], [4, 0], [1, 2]]
    assert rows(unpad_dataproto(padded, pad)) == [0, 1, 2, 3, 4]


def test_pad_wraps_when_more_rows_needed_than_exist():
    padded, pad = pad_dataproto_to_divisor(make(2), 7)
    assert pad == 5 and rows(padded) == [0, 1, 0, 1, 0, 1, 0]


def test_pad_noop_returns_same_object():
    d = make(4)
    padded, pad = pad_dataproto_to_divisor(d, 2)
    assert padded is d and pad == 0 and unpad_dataproto(d, 0) is d
    with pytest.raises(ValueError):
        unpad_dataproto(d, 5)


# ---------------------------------------------------------------- pickling / repr
def test_pickle_round_trip():
    d = make(3)
    back = pickle.loads(pickle.dumps(d))
    assert rows(back) == [0, 1, 2]
    assert back.meta_info == {"temperature": 1.0, "nested": {"a": [1, 2]}}
    assert back.batch["x"].dtype == torch.long and back.batch["y"].dtype == torch.float32


def test_pickled_chunk_does_not_carry_parent_storage():
    big = DataProto.from_dict(tensors={"x": torch.zeros(1000, 1000)})
    piece = big.chunk(10)[3]
    full = len(pickle.dumps(big))
    part = len(pickle.dumps(piece))
    assert part < full / 5  # 1/10 of the rows plus small overhead
    assert torch.equal(pickle.loads(pickle.dumps(piece)).batch["x"], torch.zeros(100, 1000))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool])
def test_pickle_keeps_dtype_values_and_gives_writable_tensors(dtype):
    # a chunk (a view) comes back as its own tensor: same dtype and values, writable, not sharing the sender's memory
    values = (torch.arange(-6, 6).reshape(3, 4) * 0.37).to(dtype)
    sent = values.clone()
    back = pickle.loads(pickle.dumps(DataProto.from_dict(tensors={"t": values})[1:], protocol=5))
    t = back.batch["t"]
    assert t.dtype == dtype and t.shape == (2, 4)
    assert torch.equal(t, sent[1:])
    t.zero_()  # writable, and not shared with the sender
    assert torch.equal(values, sent)


def test_pickle_carries_cpu_tensors_as_numpy_buffers():
    # torch's own tensor pickling (torch.save of the storage) is what the wire form avoids; values, dtypes and
    # shapes survive, a transposed (non-contiguous) tensor included
    d = DataProto.from_dict(tensors={"t": torch.arange(12.0).reshape(3, 4).t().contiguous().t()[:2],
                                     "h": torch.linspace(-2, 2, 6).reshape(2, 3).bfloat16()})
    data = pickle.dumps(d, protocol=5)
    assert b"_rebuild_tensor" not in data and b"_load_from_bytes" not in data
    back = pickle.loads(data)
    assert not d.batch["t"].is_contiguous()
    assert torch.equal(back.batch["t"], torch.tensor([[0.0, 1, 2, 3], [4, 5, 6, 7]]))
    assert back.batch["h"].dtype == torch.bfloat16
    assert back.batch["h"].float().tolist() == [[-2.0, -1.203125, -0.400390625], [0.400390625, 1.203125, 2.0]]


def test_pickle_keeps_a_tensor_that_needs_grad():
    w = torch.ones(2, 3, requires_grad=True)
    back = pickle.loads(pickle.dumps(DataProto.from_dict(tensors={"w": w})))
    assert back.batch["w"].requires_grad and torch.equal(back.batch["w"].detach(), torch.ones(2, 3))


def test_repr_is_concise():
    text = repr(make(2))
    assert "batch_size=2" in text and "x: (2, 2) torch.int64" in text and "name: (2,) object" in text
    assert "meta_info_keys=['nested', 'temperature']" in text
    assert "MiB" in make(2).print_size()
