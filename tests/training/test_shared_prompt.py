"""Shared-prompt packing (hybridflow/training/shared_prompt.py): a layout written out by hand; logits, values and
gradients equal to the padded forward (an independent path: transformers' own masks) for a causal LM and a value
model, in fp64 and fp32, with the forward run once per shared prompt; on two gloo ranks the actor's and critic's logprobs, values and one update's weight change
equal the padded path's with and without dynamic batch size."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForTokenClassification

from hybridflow.distributed.launch import spawn_ranks
from helpers.role_runs import all_variants, assert_variants_equal_padded
from hybridflow.protocol import DataProto
from hybridflow.training.micro import response_forward
from hybridflow.training.packing import add_token_counts, computed_tokens
from hybridflow.training.shared_prompt import shared_prompt_layout
from hybridflow.utils.metrics import Sum, finalize

V, P, R = 40, 6, 5
# rows 0-2 share prompt A (4 tokens), rows 3-4 prompt B (6 tokens), row 5 its own (2 tokens), rows 6-7 prompt C
PROMPT_OF = [0, 0, 0, 1, 1, 2, 3, 3]
PROMPT_LENS = [4, 6, 2, 3]
RESPONSE_LENS = [5, 1, 3, 2, 4, 5, 2, 1]


def _config(**kw) -> LlamaConfig:
    return LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, tie_word_embeddings=True, **kw)


def _lm(dtype=torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(_config()).to(dtype)


def _value_model(dtype=torch.float32) -> LlamaForTokenClassification:
    torch.manual_seed(0)
    model = LlamaForTokenClassification(_config(num_labels=1))
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.to(dtype)


def _batch() -> DataProto:
    """Left-padded prompts (rows of one prompt identical, padding included), right-padded responses."""
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, V, (len(PROMPT_LENS), P), generator=g)
    rows = len(PROMPT_OF)
    ids = torch.cat([prompts[PROMPT_OF], torch.randint(1, V, (rows, R), generator=g)], dim=1)
    mask = torch.zeros(rows, P + R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(PROMPT_OF, RESPONSE_LENS)):
        mask[i, P - PROMPT_LENS[p]: P + r] = 1
    ids = ids.masked_fill(mask == 0, 0)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(tensors={
        "input_ids": ids, "attention_mask": mask, "position_ids": pos, "responses": ids[:, P:],
        "response_mask": mask[:, P:].clone(), "advantages": torch.randn(rows, R, generator=g),
        "old_log_probs": -torch.rand(rows, R, generator=g) * 3, "returns": torch.randn(rows, R, generator=g),
        "values": torch.randn(rows, R, generator=g)})


def test_layout_by_hand():
    # two rows share the prompt [7, 8] (one left-padding column); responses of 2 and 1 tokens; R = 2
    ids = torch.tensor([[0, 7, 8, 5, 6], [0, 7, 8, 9, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 0]])
    layout = shared_prompt_layout(mask, ids, response_length=2)
    # packed row: p0 p1 | a0 a1 | b0, read from flat indices (row * 5 + column)
    assert layout.flat_index.tolist() == [1, 2, 3, 4, 8]
    assert (layout.groups, layout.longest) == (1, 5)
    assert layout.slot.tolist() == [0, 1, 2, 3, 4]
    want = torch.tensor([[1, 0, 0, 0, 0],   # p0
                         [1, 1, 0, 0, 0],   # p1
                         [1, 1, 1, 0, 0],   # a0: prompt + itself
                         [1, 1, 1, 1, 0],   # a1
                         [1, 1, 0, 0, 1]],  # b0: prompt + itself, not a0/a1
                        dtype=torch.bool)
    assert torch.equal(layout.mask[0, 0], want)
    # a0 <- p1, a1 <- a0, b0 <- p1; targets in the (B*R,) response rectangle
    assert layout.predictor.tolist() == [1, 2, 1]
    assert layout.target.tolist() == [0, 1, 2]


def test_no_shared_prompt_gives_no_layout():
    ids = torch.tensor([[1, 2, 3], [1, 4, 3]])
    assert shared_prompt_layout(torch.ones(2, 3, dtype=torch.long), ids, response_length=1) is None


# fp64 outputs agree to 1e-10; gradients to fp32 rounding even in fp64, since transformers' RMSNorm computes in fp32
# (summing n copies' gradients through it rounds differently from one backward of their sum: 2.4e-7 measured)
@pytest.mark.parametrize("dtype,atol,grad_atol", [(torch.float64, 1e-10, 1e-6), (torch.float32, 1e-5, 1e-5)])
@pytest.mark.parametrize("make", [_lm, _value_model], ids=["lm", "value"])
def test_outputs_and_gradients_equal_the_padded_forward(make, dtype, atol, grad_atol):
    data = _batch()
    mask = data.batch["response_mask"].bool()
    weights = torch.randn(*mask.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    results, rows_seen = [], []
    for packed in (False, True):
        model = make(dtype)
        model.model.embed_tokens.register_forward_hook(lambda mod, args, out: rows_seen.append(args[0].numel()))
        out = response_forward(model, data, R, remove_padding=packed)  # (B, R, V or 1)
        (out[..., 0] * weights)[mask].sum().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (padded, padded_grads), (shared, shared_grads) = results
    prompts = sum(PROMPT_LENS)
    assert rows_seen[1] == prompts + sum(RESPONSE_LENS)  # each prompt's tokens once in the packed row
    assert padded[mask].abs().max() > 0.1
    torch.testing.assert_close(shared[mask], padded[mask], atol=atol, rtol=0)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, atol=grad_atol, rtol=0, msg=name)


def test_long_responses_after_a_short_prompt_keep_the_unshared_path():
    # 4 samples of 20 tokens after one 2-token prompt: the grouped call would compute (2 + 80)^2 = 6724 scores
    # against 4 x 22^2 = 1936 for the rows' own calls (3.5x > 3): no layout, every row packed with its own prompt
    rows, p, r = 4, 2, 20
    ids = torch.cat([torch.tensor([[5, 6]] * rows), torch.randint(1, V, (rows, r))], dim=1)
    mask = torch.ones(rows, p + r, dtype=torch.long)
    assert shared_prompt_layout(mask, ids, response_length=r) is None
    data = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask})
    assert computed_tokens(data, r, remove_padding=True, shares_prompts=True) == (rows * (p + r), rows * (p + r))
    # a 6-token prompt and 3-token responses: (6 + 12)^2 = 324 against 4 x 9^2 = 324: shared, the prompt once
    ids = torch.cat([torch.tensor([[5, 6, 7, 8, 9, 10]] * rows), torch.randint(1, V, (rows, 3))], dim=1)
    mask = torch.ones(rows, 9, dtype=torch.long)
    assert shared_prompt_layout(mask, ids, response_length=3) is not None
    data = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask})
    assert computed_tokens(data, 3, remove_padding=True, shares_prompts=True) == (6 + rows * 3, rows * 9)


def _worker(rank: int, out: str) -> None:
    results = all_variants(rank, {"actor": _lm, "critic": _value_model}, _batch(), micro=4, forward_micro=4,
                           max_token_len=24)
    torch.save(results, f"{out}.{rank}")


def test_actor_and_critic_equal_the_padded_path_on_two_ranks(tmp_path):
    out = str(tmp_path / "res")
    spawn_ranks(_worker, out)
    per_rank = [torch.load(f"{out}.{r}") for r in range(2)]
    assert_variants_equal_padded(per_rank, _batch().batch["response_mask"].bool(), [(True, False), (True, True)])


def test_computed_tokens_count_each_shared_prompt_once():
    data = _batch()
    valid = sum(PROMPT_LENS[p] for p in PROMPT_OF) + sum(RESPONSE_LENS)
    # by hand: prompts 4 + 6 + 2 + 3 once each, plus every response token
    assert computed_tokens(data, R, remove_padding=True, shares_prompts=True) == (15 + sum(RESPONSE_LENS), valid)
    assert computed_tokens(data, R, remove_padding=True) == (valid, valid)
    stats = {}
    add_token_counts(stats, "actor", data, True, _lm())  # sdpa: shares
    assert finalize(stats) == {"perf/actor_computed_tokens": 15 + sum(RESPONSE_LENS), "perf/actor_valid_tokens": valid}
    model = _lm()
    model.config._attn_implementation = "flash_attention_2"  # its varlen kernel does not share
    add_token_counts(stats, "critic", data, True, model)
    assert stats["perf/critic_computed_tokens"] == Sum(valid)
