"""Tensor-parallel plans per architecture (one process): which weights are split on which dim, and the size
checks with their messages. Multi-rank behaviour is tested in tests/engine/test_hybrid_engine.py."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from hybridflow.distributed.tp import check_tp_size, get_tp_plan, localize_attention, registered_tp_plans, tp_dims

KW = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=8,
          num_key_value_heads=2, tie_word_embeddings=True)


def test_llama_and_qwen2_are_registered():
    assert {"llama", "qwen2"} <= set(registered_tp_plans())


@pytest.mark.parametrize("cls,cfg", [(LlamaForCausalLM, LlamaConfig), (Qwen2ForCausalLM, Qwen2Config)])
def test_split_dims(cls, cfg):
    with torch.device("meta"):
        model = cls(cfg(**KW))
    train, gen = tp_dims(model, "train"), tp_dims(model, "generate")
    layer = "model.layers.0"
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        assert train[f"{layer}.{name}.weight"] == gen[f"{layer}.{name}.weight"] == 0
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        assert train[f"{layer}.{name}.weight"] == gen[f"{layer}.{name}.weight"] == 1
    assert train[f"{layer}.input_layernorm.weight"] is None and gen["model.norm.weight"] is None
    # tied embeddings: one parameter, replicated while training, vocabulary rows while generating
    assert "lm_head.weight" not in train and train["model.embed_tokens.weight"] is None
    assert gen["model.embed_tokens.weight"] == 0
    if cls is Qwen2ForCausalLM:  # q/k/v biases follow their rows
        assert train[f"{layer}.self_attn.q_proj.bias"] == 0 and train[f"{layer}.self_attn.v_proj.bias"] == 0


def test_kv_heads_must_split_evenly():
    with pytest.raises(ValueError, match=r"num_key_value_heads=2.*num_key_value_heads % tp must be 0"):
        check_tp_size(LlamaConfig(**KW), 4)
    check_tp_size(LlamaConfig(**KW), 2)


def test_vocab_is_checked_for_generation_only():
    cfg = LlamaConfig(**{**KW, "vocab_size": 63})
    check_tp_size(cfg, 2, "train")
    with pytest.raises(ValueError, match="vocab_size=63"):
        check_tp_size(cfg, 2, "generate")


def test_unknown_architecture():
    class Config:
        model_type = "gpt2"

    with pytest.raises(KeyError, match="no tensor-parallel plan for model_type 'gpt2'; known: .*llama"):
        get_tp_plan(Config())


def test_localize_attention_divides_head_attributes():
    class Attention(torch.nn.Module):
        num_heads, num_key_value_heads, head_dim = 8, 2, 4

    attention = Attention()
    localize_attention(attention, 2)
    assert (attention.num_heads, attention.num_key_value_heads, attention.head_dim) == (4, 1, 4)
