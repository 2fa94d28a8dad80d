"""trainer.balance_batch: the greedy equal-count partition worked by hand, the batch reordered with every column,
and the PPO driver applying it for the actor's dp size before the forwards."""

import numpy as np
import pytest
import torch

from hybridflow.protocol import DataProto
from hybridflow.trainer.balance import balance_batch, balance_permutation


def test_partition_worked_by_hand():
    # rows by length: 10 (row 0) -> chunk 0, 9 (2) -> 1, 8 (4) -> 1 (9 < 10), 3 (5) -> 0, 2 (3) -> 0 (full), 1 (1) -> 1
    assert balance_permutation([10, 1, 9, 2, 8, 3], 2) == [0, 3, 5, 1, 2, 4]
    # sums 15 / 18, the best any split into two chunks of 3 rows can do (33 tokens: {10, 3, 2} vs {9, 8, 1})
    assert balance_permutation([5, 5, 5, 5], 2) == [0, 2, 1, 3]  # equal sums: the lower chunk first
    assert balance_permutation([4, 3, 2, 1], 1) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="5 rows do not split into 2 equal chunks"):
        balance_permutation([1] * 5, 2)


def test_balance_batch_moves_every_column_with_its_row():
    lengths = [10, 1, 9, 2, 8, 3]
    mask = torch.tensor([[1] * n + [0] * (10 - n) for n in lengths])
    batch = DataProto.from_dict(tensors={"attention_mask": mask, "row": torch.arange(6)},
                                non_tensors={"uid": np.array(list("abcdef"), dtype=object)})
    metrics = balance_batch(batch, 2)
    assert batch.batch["row"].tolist() == [0, 3, 5, 1, 2, 4]
    assert list(batch.non_tensor_batch["uid"]) == ["a", "d", "f", "b", "c", "e"]
    assert batch.batch["attention_mask"].sum(-1).tolist() == [10, 2, 3, 1, 9, 8]
    # chunk sums before 20 / 13, after 15 / 18; mean 16.5
    assert metrics["perf/dp_token_imbalance_before"] == pytest.approx(20 / 16.5)
    assert metrics["perf/dp_token_imbalance"] == pytest.approx(18 / 16.5)
    assert balance_batch(batch, 1) == {} and balance_batch(batch, 4) == {}  # one rank; 6 rows do not split in 4
    assert batch.batch["row"].tolist() == [0, 3, 5, 1, 2, 4]


def test_equal_uid_groups_stay_together_and_are_balanced_as_wholes():
    # 4 prompts x 2 samples; group token sums a: 10+9=19, b: 1+2=3, c: 8+3=11, d: 5+5=10 -> greedy over groups with
    # 2 per rank: a (19) -> rank 0, c (11) -> rank 1, d (10) -> rank 1 (11 < 19), b (3) -> rank 0: 22 / 21
    lengths = [10, 9, 1, 2, 8, 3, 5, 5]
    mask = torch.tensor([[1] * n + [0] * (10 - n) for n in lengths])
    batch = DataProto.from_dict(tensors={"attention_mask": mask, "row": torch.arange(8)},
                                non_tensors={"uid": np.array(list("aabbccdd"), dtype=object)})
    metrics = balance_batch(batch, 2)
    assert batch.batch["row"].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]  # groups a, b | c, d
    assert list(batch.non_tensor_batch["uid"]) == list("aabbccdd")
    assert metrics["perf/dp_token_imbalance"] == pytest.approx(22 / 21.5)
    # unequal groups fall back to rows (the row-level partition of the first test's kind)
    ragged = DataProto.from_dict(tensors={"attention_mask": mask, "row": torch.arange(8)},
                                 non_tensors={"uid": np.array(list("aaabbcdd"), dtype=object)})
    balance_batch(ragged, 2)
    rows = ragged.batch["row"].tolist()
    assert sorted(rows) == list(range(8)) and rows != list(range(8))
