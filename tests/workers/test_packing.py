"""Padding-free forwards (hybridflow/training/packing.py) equal the padded ones.

Single process: packed outputs equal an uncut padded HF forward at every valid position, for a causal LM and a value
model; tokens of one packed sequence never influence another; a module switched to the varlen attention still gives
the same padded forwards and greedy generations. Two gloo ranks (FSDP2): actor logprobs and critic values agree to
1e-5 and the applied gradients (SGD lr 1: the weight change is the gradient) to 1e-6, with fixed and token-budget
micro-batches, left-padded prompts and responses of different lengths.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForTokenClassification

from hybridflow.distributed.launch import spawn_ranks
from helpers.role_runs import all_variants, assert_variants_equal_padded
from hybridflow.protocol import DataProto
from hybridflow.training.packing import VARLEN_ATTENTION, pack, packed_forward, packed_response_forward

V, P, R = 40, 6, 5
PROMPT_LENS = [6, 3, 4, 2, 5, 6, 1, 3]
RESPONSE_LENS = [5, 1, 3, 2, 4, 5, 2, 1]


def _llama_config(**kw) -> LlamaConfig:
    return LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, tie_word_embeddings=True, **kw)


def _lm() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(_llama_config())


def _value_model() -> LlamaForTokenClassification:
    torch.manual_seed(0)
    model = LlamaForTokenClassification(_llama_config(num_labels=1))
    for module in model.modules():  # as hybridflow.models.hf.load_value_model: no dropout on the value head
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def _batch(prompt_lens=PROMPT_LENS, response_lens=RESPONSE_LENS) -> DataProto:
    """Left-padded prompts and right-padded responses, positions restarting at 0 per sequence."""
    g = torch.Generator().manual_seed(1)
    B = len(prompt_lens)
    ids = torch.randint(1, V, (B, P + R), generator=g)
    mask = torch.zeros(B, P + R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        mask[i, P - p: P + r] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    response_mask = mask[:, P:].clone()
    return DataProto.from_dict(tensors={
        "input_ids": ids, "attention_mask": mask, "position_ids": pos, "responses": ids[:, P:],
        "response_mask": response_mask, "advantages": torch.randn(B, R, generator=g),
        "old_log_probs": -torch.rand(B, R, generator=g) * 3, "returns": torch.randn(B, R, generator=g),
        "values": torch.randn(B, R, generator=g),
    })


def _padded_logits(model, data: DataProto) -> torch.Tensor:
    b = data.batch
    return model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"],
                 use_cache=False).logits


def test_pack_keeps_valid_tokens_with_their_positions():
    data = _batch(prompt_lens=[2, 1], response_lens=[1, 3])
    packed = pack(data)
    assert packed.cu_seqlens.tolist() == [0, 3, 7]  # 2 + 1 and 1 + 3 valid tokens
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3]]
    ids = data.batch["input_ids"]
    assert packed.input_ids.tolist() == [[*ids[0, P - 2: P + 1].tolist(), *ids[1, P - 1: P + 3].tolist()]]


def test_packed_forward_equals_padded_forward_for_lm_and_value_model():
    data = _batch()
    valid = data.batch["attention_mask"].bool()
    for model in (_lm().eval(), _value_model().eval()):
        with torch.no_grad():
            padded = _padded_logits(model, data)
            packed = packed_forward(model, data)
        assert model.config._attn_implementation == VARLEN_ATTENTION
        torch.testing.assert_close(packed[valid], padded[valid], atol=1e-5, rtol=0)
        assert (packed[~valid] == 0).all()
        assert padded[valid].abs().max() > 1e-2  # not vacuous


def test_packed_sequences_do_not_see_each_other():
    model = _lm().eval()
    data = _batch()
    changed = _batch()
    changed.batch["input_ids"][0] = (changed.batch["input_ids"][0] + 7) % V  # only sequence 0 changes
    with torch.no_grad():
        a, b = packed_forward(model, data), packed_forward(model, changed)
    assert (a[1:] == b[1:]).all()
    assert (a[0] - b[0]).abs().max() > 1e-3


def test_response_rows_match_and_varlen_module_still_runs_padded_forwards_and_generation():
    model = _lm().eval()
    data = _batch()
    prompts = data.batch["input_ids"][:, :P]
    prompt_mask = data.batch["attention_mask"][:, :P]
    with torch.no_grad():
        padded = _padded_logits(model, data)
        generated = model.generate(input_ids=prompts, attention_mask=prompt_mask, max_new_tokens=4, do_sample=False,
                                   pad_token_id=0)
        rows = packed_response_forward(model, data, R)  # switches the module to the varlen attention
        padded_after = _padded_logits(model, data)
        generated_after = model.generate(input_ids=prompts, attention_mask=prompt_mask, max_new_tokens=4,
                                         do_sample=False, pad_token_id=0)
    predicting = data.batch["attention_mask"][:, P - 1: -1].bool()
    torch.testing.assert_close(rows[predicting], padded[:, P - 1: -1][predicting], atol=1e-5, rtol=0)
    valid = data.batch["attention_mask"].bool()
    torch.testing.assert_close(padded_after[valid], padded[valid], atol=1e-6, rtol=0)
    assert torch.equal(generated_after, generated)


def test_masked_decode_attends_grouped_kv_heads_without_copies_and_same_logits(monkeypatch):
    """A varlen module's masked forwards on CPU (prompt prefill, each KV-cache decode step) run SDPA with
    ``enable_gqa`` instead of transformers' repeated key/value heads; the generation's logits are the plain sdpa
    module's, exactly."""
    from hybridflow.training import packing

    data = _batch()
    prompts, prompt_mask = data.batch["input_ids"][:, :P], data.batch["attention_mask"][:, :P]
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        plain = _lm().eval().generate(input_ids=prompts, attention_mask=prompt_mask, **kwargs)
        model = _lm().eval()
        packing.use_varlen_attention(model)
        calls = []
        real = packing._gqa_sdpa
        monkeypatch.setattr(packing, "_gqa_sdpa", lambda *a: calls.append(a[1].shape) or real(*a))
        grouped = model.generate(input_ids=prompts, attention_mask=prompt_mask, **kwargs)
    assert len(calls) == 4 * 2 and calls[-1][1] == 2  # 4 forwards x 2 layers, keys with their 2 kv heads
    assert torch.equal(grouped.sequences, plain.sequences)
    for a, b in zip(grouped.logits, plain.logits):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------------------- 2 gloo ranks, FSDP2
def _worker(rank: int, out: str) -> None:
    results = all_variants(rank, {"actor": _lm, "critic": _value_model}, _batch(), micro=2, forward_micro=3,
                           max_token_len=12, entropy_coeff=0.01)
    torch.save(results, f"{out}.{rank}")


def test_packed_equals_padded_logprobs_values_and_gradients_on_two_ranks(tmp_path):
    out = str(tmp_path / "res")
    spawn_ranks(_worker, out)
    per_rank = [torch.load(f"{out}.{r}") for r in range(2)]
    assert_variants_equal_padded(per_rank, _batch().batch["response_mask"].bool(),
                                 [(packed, dynamic) for packed in (False, True) for dynamic in (False, True)])
