"""The shipped builtin:tiny-moe and its build script: a Qwen3-MoE model (8 experts, top-2, head_dim 32) with
tiny-arith's tokenizer; the sparse upcycling keeps the dense MLP as the expectation over a uniformly random
expert pair."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from hybridflow.models.builtin import resolve_model_path
from hybridflow.models.hf import load_causal_lm
from hybridflow.models.moe import routers

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_tiny_moe.py"


def _script():
    spec = importlib.util.spec_from_file_location("build_tiny_moe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shipped_model_is_a_qwen3_moe_with_tiny_arith_s_tokenizer():
    model = load_causal_lm("builtin:tiny-moe", torch.float32)
    config = model.config
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert (config.num_experts, config.num_experts_per_tok, config.head_dim) == (8, 2, 32)
    assert len(routers(model)) == config.num_hidden_layers
    mine = AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny-moe"))
    arith = AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny-arith"))
    text = "Question: Ann has 7 apples. She buys 5 more.\nAnswer: 7 + 5 = 12\n#### 12"
    assert mine(text).input_ids == arith(text).input_ids and mine.eos_token_id == arith.eos_token_id
    size = sum(f.stat().st_size for f in Path(resolve_model_path("builtin:tiny-moe")).iterdir())
    assert size < 4 << 20


def test_upcycled_experts_average_to_the_dense_mlp():
    build = _script()
    dense = LlamaForCausalLM.from_pretrained(resolve_model_path("builtin:tiny-arith"), dtype=torch.float32)
    moe = build.upcycle(dense, seed=0)
    hidden = torch.randn(5, dense.config.hidden_size, generator=torch.Generator().manual_seed(0))
    experts = moe.model.layers[1].mlp.experts
    pairs = list(itertools.combinations(range(8), 2))
    total = torch.zeros_like(hidden)
    for pair in pairs:  # each token to the pair, gate weights 1/2 each (a uniform router renormalised)
        idx = torch.tensor(pair).expand(5, 2)
        total += experts(hidden, idx, torch.full((5, 2), 0.5))
    with torch.no_grad():
        torch.testing.assert_close(total / len(pairs), dense.model.layers[1].mlp(hidden), atol=1e-5, rtol=1e-4)
        assert torch.equal(moe.model.embed_tokens.weight, dense.model.embed_tokens.weight)
