"""HF <-> Megatron conversion (hybridflow.models.megatron_convert): bit-exact round trips over every (tp, pp) rank
for Llama (GQA), a tied-embedding model and Qwen2 (q/k/v bias); a 1-rank GPTModel's logits equal the HF model's."""

from __future__ import annotations


import pytest
import torch
import transformers

pytest.importorskip("megatron.core")

from hybridflow.models.megatron_convert import (hf_params, hf_shard_from_local, local_from_hf, merge_tp_shards,
                                                stage_layers, tp_shard)
from tests.helpers.megatron import assert_gpt_logits_equal_hf
from tests.helpers.models import tiny_model

ARCHS = {
    "llama_gqa": (transformers.LlamaForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2,
                                                      hidden_size=32, num_hidden_layers=2)),
    "llama_tied": (transformers.LlamaForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2,
                                                       tie_word_embeddings=True)),
    "qwen2_bias": (transformers.Qwen2ForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2,
                                                       rope_theta=1e6)),
    "value": (transformers.LlamaForTokenClassification, dict(num_attention_heads=4, num_key_value_heads=2,
                                                             num_labels=1)),
}


def _kind(name: str) -> str:
    return "value" if name == "value" else "policy"


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (2, 2), (1, 2)])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_round_trip_is_bit_exact(arch: str, tp: int, pp: int) -> None:
    cls, overrides = ARCHS[arch]
    model = tiny_model(cls, **overrides)
    hf_state = dict(model.named_parameters())
    params = hf_params(model.config, _kind(arch), pp)
    assert [p.name for p in params] == list(hf_state)  # the table is every HF parameter, in HF order
    shards = {}  # (tp_rank, name) -> HF tp-shard recovered from the rank's Megatron local tensors
    for tp_rank in range(tp):
        for pp_rank in range(pp):
            local = local_from_hf(params, {p.name: tp_shard(hf_state[p.name], p.tp_dim, tp, tp_rank)
                                           for p in params if p.pp_stage == pp_rank}, model.config, tp, pp_rank)
            for p in params:
                if p.pp_stage == pp_rank:
                    shards[tp_rank, p.name] = hf_shard_from_local(p, local[p.mg_name], model.config, tp)
    for p in params:
        back = merge_tp_shards([shards[r, p.name] for r in range(tp)], p.tp_dim)
        assert torch.equal(back, hf_state[p.name]), p.name


def test_fused_qkv_layout_is_interleaved_per_kv_group() -> None:
    """Independent of the code: rows of linear_qkv are, per KV group, [q heads of the group, k, v]."""
    model = tiny_model(transformers.LlamaForCausalLM, num_attention_heads=4, num_key_value_heads=2)
    attn = model.model.layers[0].self_attn
    d = 32 // 4
    params = hf_params(model.config, "policy", 1)
    state = dict(model.named_parameters())
    local = local_from_hf(params, state, model.config, 1, 0)
    qkv = local["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
    expect = torch.cat([q[0:2 * d], k[0:d], v[0:d], q[2 * d:4 * d], k[d:2 * d], v[d:2 * d]])
    assert torch.equal(qkv, expect)
    fc1 = local["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([model.model.layers[0].mlp.gate_proj.weight,
                                       model.model.layers[0].mlp.up_proj.weight]))


def test_stage_layers_even_split() -> None:
    assert list(stage_layers(4, 2, 1)) == [2, 3]
    with pytest.raises(ValueError, match="not divisible"):
        stage_layers(3, 2, 0)


@pytest.mark.parametrize("arch", ["llama_gqa", "llama_tied", "qwen2_bias", "value"])
def test_gpt_model_logits_equal_hf(arch: str, megatron_1rank) -> None:
    cls, overrides = ARCHS[arch]
    assert_gpt_logits_equal_hf(tiny_model(cls, eval=True, **overrides), _kind(arch))
