"""The sampling distribution (temperature, top-k, top-p) against hand-computed values and its gradient formula."""

import math

import pytest
import torch

from hybridflow.algorithms import entropy_from_logits, logprobs_from_logits
from hybridflow.algorithms.sampling import SamplingSpec, sampling_logits, truncation_mask

PROBS = [0.5, 0.3, 0.15, 0.05]  # mass before each token, by decreasing probability: 0, 0.5, 0.8, 0.95


def _logits():
    return torch.tensor([PROBS]).log()


def test_top_k_keeps_the_k_largest_and_ties():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    assert truncation_mask(logits, top_k=2).tolist() == [[False, True, False, True], [False, False, False, True]]
    assert truncation_mask(logits, top_k=-1) is None and truncation_mask(logits, top_k=4) is None


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    # top_p 0.75: tokens 0, 1 (mass 0.8 >= 0.75); token 2 has 0.8 before it -> removed
    assert truncation_mask(_logits(), top_p=0.75).tolist() == [[False, False, True, True]]
    assert truncation_mask(_logits(), top_p=0.9).tolist() == [[False, False, False, True]]
    assert truncation_mask(_logits(), top_p=0.3).tolist() == [[False, True, True, True]]  # the top one stays
    # top-k first, then the nucleus of the renormalised rest: top-2 -> (0.625, 0.375); top_p 0.6 keeps token 0
    assert truncation_mask(_logits(), top_k=2, top_p=0.6).tolist() == [[False, True, True, True]]


def test_keep_never_removes_the_given_token():
    keep = torch.tensor([3])
    assert truncation_mask(_logits(), top_p=0.75, keep=keep).tolist() == [[False, False, True, False]]


def test_sampling_logits_logprob_and_entropy_by_hand():
    logits = _logits()
    out = sampling_logits(logits, SamplingSpec(top_p=0.75))
    lp = logprobs_from_logits(out, torch.tensor([[1]]).squeeze(0))
    assert lp.item() == pytest.approx(math.log(0.3 / 0.8), abs=1e-6)
    q = [0.5 / 0.8, 0.3 / 0.8]
    assert entropy_from_logits(out).item() == pytest.approx(-sum(p * math.log(p) for p in q), abs=1e-6)
    # temperature 2 then top-k 2: probs proportional to sqrt(0.5), sqrt(0.3)
    out = sampling_logits(logits, SamplingSpec(temperature=2.0, top_k=2))
    expected = math.sqrt(0.5) / (math.sqrt(0.5) + math.sqrt(0.3))
    assert out.log_softmax(-1)[0, 0].item() == pytest.approx(math.log(expected), abs=1e-6)
    assert sampling_logits(logits, SamplingSpec()) is logits  # nothing to apply


def test_greedy_spec_is_the_plain_softmax():
    assert SamplingSpec.of(False, 0.7, 5, 0.9) == SamplingSpec()
    assert SamplingSpec.of(True, 0.0, 5, 0.9) == SamplingSpec()
    assert SamplingSpec.of(True, 0.7, 5, 0.9) == SamplingSpec(0.7, 5, 0.9)


def test_gradient_flows_to_kept_tokens_only():
    """d log pi_K(a) / dz_b = (1[a=b] - pi_K(b)) / T for b in K, 0 outside."""
    temperature = 2.0
    z = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]], requires_grad=True)
    out = sampling_logits(z, SamplingSpec(temperature=temperature, top_k=3))
    logprobs_from_logits(out, torch.tensor([1])).sum().backward()
    kept = torch.tensor([2.0, 1.0, 0.5]) / temperature
    pi = kept.softmax(-1)
    expected = torch.cat([(torch.tensor([0.0, 1.0, 0.0]) - pi) / temperature, torch.zeros(2)])
    assert torch.allclose(z.grad[0], expected, atol=1e-6)


def test_batched_leading_dims():
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 50)
    mask = truncation_mask(logits, top_k=7, top_p=0.8)
    flat = truncation_mask(logits.reshape(12, 50), top_k=7, top_p=0.8)
    assert mask.shape == (3, 4, 50) and torch.equal(mask.reshape(12, 50), flat)
    assert ((~mask).sum(-1) <= 7).all() and ((~mask).sum(-1) >= 1).all()
