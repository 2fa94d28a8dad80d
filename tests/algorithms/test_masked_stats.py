"""masked_sum / masked_mean / masked_var / masked_whiten against hand-computed values and invariants."""

import math
import statistics

import pytest
import torch

from hybridflow.algorithms import masked_mean, masked_sum, masked_var, masked_whiten

VALUES = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 6.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])  # int mask on purpose: any dtype works
VALID = [1.0, 2.0, 3.0, 4.0, 6.0]


def with_garbage(values, mask, garbage):
    return torch.where(mask.bool(), values, torch.full_like(values, garbage))


def test_masked_sum_and_mean_by_hand():
    assert masked_sum(VALUES, MASK).item() == 16.0  # 1+2+3+4+6
    assert masked_sum(VALUES, MASK, axis=-1).tolist() == [6.0, 10.0]
    assert masked_mean(VALUES, MASK).item() == pytest.approx(16.0 / 5)
    assert masked_mean(VALUES, MASK, axis=-1).tolist() == [2.0, 5.0]  # 6/3, 10/2
    assert masked_mean(VALUES, MASK.bool(), axis=0).tolist() == [2.5, 4.0, 3.0, 0.0]  # last column empty -> 0


@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), -float("inf"), 1e30, -7.0])
def test_garbage_at_padding_is_ignored_including_gradient(garbage):
    values = with_garbage(VALUES, MASK, garbage).requires_grad_()
    mean_rows = masked_mean(values, MASK, axis=-1)
    assert mean_rows.tolist() == [2.0, 5.0]
    assert masked_var(values, MASK).item() == pytest.approx(statistics.variance(VALID))
    (mean_rows.sum() + masked_sum(values, MASK)).backward()
    assert torch.isfinite(values.grad).all()
    assert (values.grad[~MASK.bool()] == 0).all()


def test_empty_row_mean_is_zero_with_finite_gradient():
    values = torch.tensor([[1.0, 2.0], [5.0, 5.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    out = masked_mean(values, mask, axis=-1)
    assert out.tolist() == [1.5, 0.0]
    out.sum().backward()
    assert values.grad.tolist() == [[0.5, 0.5], [0.0, 0.0]]


def test_masked_var_biased_and_unbiased():
    mean = sum(VALID) / 5
    ss = sum((v - mean) ** 2 for v in VALID)
    assert masked_var(VALUES, MASK, unbiased=True).item() == pytest.approx(ss / 4)
    assert masked_var(VALUES, MASK, unbiased=False).item() == pytest.approx(ss / 5)
    one = torch.tensor([[3.0, 9.0]]), torch.tensor([[1, 0]])
    assert masked_var(*one, unbiased=False).item() == 0.0


def test_masked_var_errors():
    with pytest.raises(ValueError, match="no valid"):
        masked_var(VALUES, torch.zeros_like(MASK))
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(torch.tensor([[3.0, 9.0]]), torch.tensor([[1, 0]]))
    with pytest.raises(ValueError, match="no valid"):
        masked_whiten(VALUES, torch.zeros_like(MASK))


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_matches_python_statistics(shift_mean):
    mean, std = statistics.mean(VALID), statistics.stdev(VALID)  # stdev: unbiased (n - 1)
    expected = [(v - mean) / math.sqrt(std**2 + 1e-8) + (0.0 if shift_mean else mean) for v in VALID]
    out = masked_whiten(with_garbage(VALUES, MASK, float("nan")), MASK, shift_mean=shift_mean)
    assert out[MASK.bool()].tolist() == pytest.approx(expected, abs=1e-6)
    assert (out[~MASK.bool()] == 0).all()


def test_masked_whiten_valid_entries_independent_of_padding_and_normalized():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(6, 9, generator=gen) * 3 + 2
    lengths = torch.tensor([9, 1, 4, 7, 2, 5])
    mask = (torch.arange(9)[None, :] < lengths[:, None]).float()
    base = masked_whiten(values, mask)
    for garbage in (float("nan"), float("inf"), 1e20, -3.0):
        out = masked_whiten(with_garbage(values, mask, garbage), mask)
        assert torch.equal(out, base)
    valid = base[mask.bool()]
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert valid.var(unbiased=True).item() == pytest.approx(1.0, abs=1e-5)
