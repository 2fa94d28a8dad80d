"""The packed row's attention (hybridflow/training/packing.py ``varlen_sdpa_attention``): one right-padded batched
SDPA call and one call per sequence give the same outputs and gradients, against a slow reference that runs each
sequence alone through plain causal attention written out (softmax of masked scores); which of the two runs
follows the lengths (close lengths: batched; one long sequence among short ones: per sequence)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.training import packing

H, H_KV, D = 4, 2, 8


class _Attn(torch.nn.Module):  # what transformers' sdpa path reads from the attention module
    num_key_value_groups = H // H_KV
    training = True


def _reference(q, k, v, lengths):
    """Per sequence: causal softmax(q k^T / sqrt(D)) v with repeated kv heads; (1, T, H, D)."""
    outs, start = [], 0
    for n in lengths:
        qs = q[0, :, start:start + n]
        ks = k[0, :, start:start + n].repeat_interleave(H // H_KV, dim=0)
        vs = v[0, :, start:start + n].repeat_interleave(H // H_KV, dim=0)
        scores = qs @ ks.transpose(-1, -2) / D ** 0.5
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        outs.append((scores.softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(outs)[None]


def _inputs(lengths):
    g = torch.Generator().manual_seed(len(lengths))
    T = sum(lengths)
    q = torch.randn(1, H, T, D, generator=g, requires_grad=True)
    k = torch.randn(1, H_KV, T, D, generator=g, requires_grad=True)
    v = torch.randn(1, H_KV, T, D, generator=g, requires_grad=True)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return q, k, v, cu


def _grads(out, q, k, v, weight):
    return torch.autograd.grad((out * weight).sum(), (q, k, v))


@pytest.mark.parametrize("lengths, batched", [([7, 5, 6, 7], True), ([9, 1, 2, 1, 3], False), ([4, 0, 4], True)])
def test_batched_and_per_sequence_attention_equal_the_reference(monkeypatch, lengths, batched):
    calls = []
    real = packing._batched_causal
    monkeypatch.setattr(packing, "_batched_causal", lambda *a: calls.append(1) or real(*a))
    q, k, v, cu = _inputs(lengths)
    weight = torch.randn(1, sum(lengths), H, D, generator=torch.Generator().manual_seed(9))
    out, _ = packing.varlen_sdpa_attention(_Attn(), q, k, v, torch.ones(1, 1, 1, 1, dtype=torch.bool),
                                           cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert bool(calls) is batched
    expected = _reference(q, k, v, [n for n in lengths if n])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    for got, ref in zip(_grads(out, q, k, v, weight), _grads(expected, q, k, v, weight)):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
