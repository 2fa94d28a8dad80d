"""The hf rollout's preallocated KV cache: every decoding step's logits equal those of transformers' own
``DynamicCache`` (the reference, a separate implementation), within capacity and past it; layer kinds it does not
handle are left as transformers builds them."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.cache_utils import DynamicLayer

from helpers.models import tiny_model
from hybridflow.rollout.kv_cache import PreallocatedLayer, preallocated_cache


@torch.no_grad()
def _decode_logits(model, cache, input_ids: torch.Tensor, mask: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Greedy decoding of a left-padded batch through ``cache``; the last-position logits of every step."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    ids, pos, out = input_ids, positions, []
    for step in range(steps):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                       use_cache=True).logits[:, -1]
        out.append(logits)
        ids = logits.argmax(-1, keepdim=True)
        pos = positions[:, -1:] + step + 1
        mask = torch.cat([mask, mask.new_ones(len(mask), 1)], dim=1)
    return out


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    input_ids = torch.randint(1, 64, (3, 6))
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[0, :3] = 0  # left padding of different lengths
    mask[1, :1] = 0
    return input_ids, mask


@pytest.mark.parametrize("capacity", [6 + 9, 6 + 4])  # room for every token; full after 4 steps (then it grows)
def test_logits_equal_dynamic_cache(capacity):
    model = tiny_model(seed=1, eval=True, vocab_size=64, hidden_size=64, intermediate_size=128,
                       initializer_range=0.2)
    input_ids, mask = _batch()
    reference = _decode_logits(model, transformers.DynamicCache(config=model.config), input_ids, mask, 9)
    cache = preallocated_cache(model.config, capacity)
    assert all(type(layer) is PreallocatedLayer for layer in cache.layers)
    got = _decode_logits(model, cache, input_ids, mask, 9)
    for step, (a, b) in enumerate(zip(got, reference)):
        assert torch.equal(a, b), f"step {step}: max diff {(a - b).abs().max()}"
    assert cache.get_seq_length() == 6 + 9 - 1  # the last step's token is not fed back


def test_views_share_one_buffer_within_capacity():
    layer = PreallocatedLayer(capacity=5)
    first = torch.randn(2, 1, 3, 4)
    keys, values = layer.update(first, first + 1)
    step = torch.randn(2, 1, 1, 4)
    keys2, values2 = layer.update(step, step + 1)
    assert keys2.shape == (2, 1, 4, 4) and keys2.data_ptr() == keys.data_ptr()  # written in place, not copied
    assert torch.equal(keys2, torch.cat([first, step], dim=2))
    assert torch.equal(values2, torch.cat([first + 1, step + 1], dim=2))
    assert layer.get_seq_length() == 4


def test_other_layer_kinds_kept():
    config = transformers.MistralConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, sliding_window=4)
    cache = preallocated_cache(config, 16)
    kinds = [type(layer) for layer in cache.layers]
    assert PreallocatedLayer not in kinds and all(kind is not DynamicLayer for kind in kinds), kinds
    with pytest.raises(ValueError, match="capacity"):
        PreallocatedLayer(0)
