"""logprobs_from_logits and entropy_from_logits against hand values and torch.distributions."""

import math

import pytest
import torch

from hybridflow.algorithms import entropy_from_logits, logprobs_from_logits


def test_logprobs_by_hand():
    # logits [0, 0, ln 2] -> probs [1/4, 1/4, 1/2]
    logits = torch.tensor([[[0.0, 0.0, math.log(2.0)], [0.0, 0.0, math.log(2.0)]]])
    out = logprobs_from_logits(logits, torch.tensor([[2, 0]]))
    assert out.shape == (1, 2) and out.dtype == torch.float32
    assert out[0].tolist() == pytest.approx([math.log(0.5), math.log(0.25)], abs=1e-6)


def test_logprobs_match_categorical_and_bf16_is_float32():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 50, generator=gen) * 4
    labels = torch.randint(0, 50, (3, 5), generator=gen)
    expected = torch.distributions.Categorical(logits=logits.double()).log_prob(labels)
    assert torch.allclose(logprobs_from_logits(logits, labels).double(), expected, atol=1e-5)
    low = logits.bfloat16()
    expected_low = torch.distributions.Categorical(logits=low.double()).log_prob(labels)
    out_low = logprobs_from_logits(low, labels)
    assert out_low.dtype == torch.float32
    assert torch.allclose(out_low.double(), expected_low, atol=1e-5)  # exact math on the bf16 values


def test_logprobs_shape_error():
    with pytest.raises(ValueError, match="labels shape"):
        logprobs_from_logits(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


def test_entropy_by_hand_and_against_categorical():
    assert entropy_from_logits(torch.zeros(4, 8)).tolist() == pytest.approx([math.log(8)] * 4, abs=1e-6)
    # -inf logits (masked vocabulary) contribute nothing: uniform over 2 -> ln 2
    masked = torch.tensor([0.0, 0.0, -float("inf")])
    assert entropy_from_logits(masked).item() == pytest.approx(math.log(2), abs=1e-6)
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 40, generator=gen) * 3
    expected = torch.distributions.Categorical(logits=logits.double()).entropy()
    out = entropy_from_logits(logits)
    assert out.shape == (2, 3) and torch.allclose(out.double(), expected, atol=1e-5)
