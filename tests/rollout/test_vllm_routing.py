"""The layout of the routing the vllm rollout records (:func:`hybridflow.rollout.vllm_routing.routing_rectangle`),
on hand-made engine records: each chunk's positions land at the row's left-padded columns, the engine's request ids
(the output's id plus a random suffix) are matched, unfed columns keep the placeholder experts 0..k-1, and a prompt
position with no record (a cached prefix) is an error. The engine-side record is tested against HF's routing in
tests/rollout/test_vllm_moe.py."""

import pytest
import torch

from hybridflow.rollout.vllm_routing import routing_rectangle

P, R, LY, K = 4, 3, 2, 2


def _ids(tokens: int, base: int) -> torch.Tensor:
    """(tokens, Ly, k) int16 with distinct values per token: base + 10 * token + layer (k copies)."""
    t = torch.arange(tokens).view(-1, 1, 1) * 10 + torch.arange(LY).view(1, -1, 1) + base
    return t.expand(tokens, LY, K).to(torch.int16)


def test_chunks_land_at_left_padded_columns():
    # row 0: 2 prompt tokens, prefill then two decode steps; row 1: 4 prompt tokens split over two chunks
    records = {
        "0-ab12cd34": [(torch.arange(2), _ids(2, 100)), (torch.tensor([2]), _ids(1, 200)),
                       (torch.tensor([3]), _ids(1, 300))],
        "1-ffff0000": [(torch.arange(3), _ids(3, 400)), (torch.tensor([3, 4]), _ids(2, 500))],
    }
    out = routing_rectangle(records, ["0", "1"], [2, 4], P, R)
    assert out.shape == (2, P + R, LY, K) and out.dtype == torch.int16
    placeholder = torch.arange(K, dtype=torch.int16).expand(LY, K)
    want0 = [placeholder, placeholder, _ids(2, 100)[0], _ids(2, 100)[1], _ids(1, 200)[0], _ids(1, 300)[0], placeholder]
    assert torch.equal(out[0], torch.stack(want0))
    want1 = [*_ids(3, 400), _ids(2, 500)[0], _ids(2, 500)[1], placeholder, placeholder]
    assert torch.equal(out[1], torch.stack(want1))


def test_nothing_recorded_is_none_and_missing_prompt_tokens_raise():
    assert routing_rectangle({}, ["0"], [2], P, R) is None
    with pytest.raises(RuntimeError, match="prefix cache must be off"):
        routing_rectangle({"0-x": [(torch.tensor([1, 2]), _ids(2, 0))]}, ["0"], [2], P, R)
    with pytest.raises(RuntimeError, match="no routing was recorded for request 1"):
        routing_rectangle({"0-x": [(torch.arange(2), _ids(2, 0))]}, ["0", "1"], [2, 2], P, R)
