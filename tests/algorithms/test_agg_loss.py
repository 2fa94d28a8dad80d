"""agg_loss: each mode by hand, and micro-batch gradient invariance with mini-batch totals."""

import pytest
import torch

from hybridflow.algorithms import LOSS_AGG_MODES, agg_loss

NAN = float("nan")
# row 0: valid [1, 2, 3] (sum 6, mean 2); row 1: valid [4] (sum 4, mean 4); padded entries hold garbage
LOSS = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, NAN, -50.0, 0.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])


@pytest.mark.parametrize("mode, kwargs, expected", [
    ("token-mean", {}, (1 + 2 + 3 + 4) / 4),
    ("token-mean", {"num_tokens": 8}, 10 / 8),
    ("seq-mean-token-sum", {}, (6 + 4) / 2),
    ("seq-mean-token-sum", {"num_seqs": 5}, 10 / 5),
    ("seq-mean-token-mean", {}, (2 + 4) / 2),
    ("seq-mean-token-mean", {"num_seqs": 4}, (2 + 4) / 4),
    ("seq-mean-token-sum-norm", {}, (6 / 4 + 4 / 4) / 2),  # L = T = 4
    ("seq-mean-token-sum-norm", {"loss_scale_factor": 2}, (6 / 2 + 4 / 2) / 2),
])
def test_modes_by_hand(mode, kwargs, expected):
    assert agg_loss(LOSS, MASK, mode, **kwargs).item() == pytest.approx(expected)


def test_empty_sequence_and_empty_mask():
    loss = torch.cat([LOSS, torch.full((1, 4), 9.0)])
    mask = torch.cat([MASK, torch.zeros(1, 4, dtype=MASK.dtype)])
    # the empty third row contributes 0 but still counts in N_seq = B = 3
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4 + 0) / 3)
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    for mode in LOSS_AGG_MODES:
        out = agg_loss(torch.ones(2, 3), torch.zeros(2, 3), mode)
        assert out.item() == 0.0, mode


def test_errors_list_modes_and_shapes():
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'sum'") as err:
        agg_loss(LOSS, MASK, "sum")
    for mode in ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]:
        assert mode in str(err.value)
    with pytest.raises(ValueError, match="shape mismatch"):
        agg_loss(LOSS, MASK[:, :3], "token-mean")
    with pytest.raises(ValueError, match="num_tokens must be > 0"):
        agg_loss(LOSS, MASK, "token-mean", num_tokens=0)


def minibatch():
    """4 sequences with different valid lengths [6, 2, 4, 1]; per-token loss depends on parameters w."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([6, 2, 4, 1])
    features = torch.randn(4, 6, 3, generator=gen)
    mask = (torch.arange(6)[None] < lengths[:, None]).float()
    w = torch.randn(3, generator=gen)
    return features, mask, w


def loss_mat(features, w):
    return torch.tanh(features @ w) ** 2 + 0.1 * (features @ w)


def grad_of(fn, w):
    w = w.clone().requires_grad_()
    fn(w).backward()
    return w.grad


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("split", [[4], [2, 2], [1, 3], [1, 1, 1, 1]])
def test_microbatch_gradients_sum_to_minibatch_gradient(mode, split):
    features, mask, w = minibatch()
    full = grad_of(lambda p: agg_loss(loss_mat(features, p), mask, mode), w)

    total_tokens, total_seqs, length = mask.sum(), mask.shape[0], mask.shape[1]

    def accumulated(p):
        total, start = 0.0, 0
        for size in split:
            f, m = features[start:start + size], mask[start:start + size]
            keep = int(m.sum(-1).max())  # each micro-batch padded only to its own longest row
            total = total + agg_loss(loss_mat(f[:, :keep], p), m[:, :keep], mode, num_tokens=total_tokens,
                                     num_seqs=total_seqs, loss_scale_factor=length)
            start += size
        return total

    assert torch.allclose(grad_of(accumulated, w), full, atol=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_without_totals_the_split_changes_the_gradient(mode):
    # sanity check that the invariance test above can fail: per-micro-batch counts reweight rows
    features, mask, w = minibatch()
    full = grad_of(lambda p: agg_loss(loss_mat(features, p), mask, mode), w)
    split = grad_of(lambda p: agg_loss(loss_mat(features[:1], p), mask[:1], mode) / 2
                    + agg_loss(loss_mat(features[1:], p), mask[1:], mode) / 2, w)
    assert not torch.allclose(split, full, atol=1e-4)
