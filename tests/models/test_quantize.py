"""Weight-only int8 generator weights: hand-checked quantization, error bounds, logprob gap, weight reloads.

The logprob-gap tests log their measurements (``pytest -o log_cli=true --log-cli-level=INFO`` shows them).
"""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
import transformers
from torch import nn

from helpers.models import tiny_model as helper_model
from hybridflow.algorithms import logprobs_from_logits
from hybridflow.models.quantize import Int8Linear, load_weights_quantized, quantize_linear_layers

logger = logging.getLogger(__name__)
VOCAB = 64
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


def tiny_llama(seed: int = 0, tie: bool = True) -> transformers.LlamaForCausalLM:
    """2-layer Llama; initializer_range 0.1 makes the logits O(1) (std ~0.8) instead of near-uniform."""
    return helper_model(seed=seed, eval=True, vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                        max_position_embeddings=64, tie_word_embeddings=tie, initializer_range=0.1)


def random_ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits


# ------------------------------------------------------------------------------------------------ one layer


def test_quantization_by_hand():
    # row 0: max |w| = 127/128, so the scale is exactly 1/128 and q = w * 128 rounded (half to even):
    #   [127, -64, 32, 1.5 -> 2, 0.5 -> 0]; the two halves are off by exactly s / 2 = 1/256
    # row 1: all zero -> q = 0, scale 1 (any scale would do), dequantized exactly 0
    w = torch.tensor([[127 / 128, -0.5, 0.25, 3 / 256, 1 / 256], [0.0] * 5])
    layer = Int8Linear.from_linear(_linear_with(w, bias=torch.tensor([0.5, -1.0])))
    assert layer.qweight.dtype == torch.int8 and layer.scale.dtype == torch.float32
    assert layer.qweight.tolist() == [[127, -64, 32, 2, 0], [0, 0, 0, 0, 0]]
    assert layer.scale.tolist() == [1 / 128, 1.0]
    assert layer.dequantize().tolist() == [[127 / 128, -0.5, 0.25, 2 / 128, 0.0], [0.0] * 5]
    # y = x W'^T + b with x = ones: row 0 sums to (127 - 64 + 32 + 2) / 128 = 97/128; row 1 is the bias
    y = layer(torch.ones(1, 5))
    assert y.tolist() == [[97 / 128 + 0.5, -1.0]]


def _linear_with(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return linear


def test_error_is_at_most_half_a_step_per_element():
    # rows spanning 12 orders of magnitude, plus an all-zero row
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 300, generator=g) * torch.tensor([1e-6, 1e-3, 1.0, 10.0, 1e6, 0.0])[:, None]
    layer = Int8Linear.from_linear(_linear_with(w))
    err = (w - layer.dequantize()).abs()
    half_step = layer.scale[:, None] / 2
    assert (err <= half_step * (1 + 1e-6)).all()  # rounding to nearest; 1e-6: fp32 rounding of w / s
    q = layer.qweight.int()
    assert q.abs().amax(dim=1).tolist() == [127] * 5 + [0]  # the row max maps to +-127, nothing is clipped
    assert (layer.dequantize()[5] == 0).all() and torch.isfinite(layer(torch.randn(2, 300))).all()


def test_forward_matches_dequantized_linear_in_each_dtype():
    g = torch.Generator().manual_seed(1)
    linear = _linear_with(torch.randn(8, 16, generator=g), bias=torch.randn(8, generator=g))
    layer = Int8Linear.from_linear(linear)
    x = torch.randn(3, 5, 16, generator=g)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.dequantize(), linear.bias))
    y16 = layer(x.bfloat16())
    assert y16.dtype == torch.bfloat16 and y16.shape == (3, 5, 8)
    # the single-layer output bound: |y - y'|_i <= sum_j |x_j| s_i / 2
    bound = x.abs().sum(-1, keepdim=True) * layer.scale / 2
    assert ((linear(x) - layer(x)).abs() <= bound * (1 + 1e-5) + 1e-6).all()
    assert not any(p.requires_grad for p in layer.parameters())  # inference only: buffers, no parameters


def test_load_weight_requantizes_in_place_and_checks():
    layer = Int8Linear.from_linear(_linear_with(torch.ones(2, 3)))
    storage = layer.qweight.data_ptr()
    new = torch.tensor([[0.0, 1.5, -2.0], [4.0, 0.0, 0.0]], dtype=torch.bfloat16)
    layer.load_weight(new)
    assert layer.qweight.data_ptr() == storage
    assert layer.qweight.tolist() == [[0, 95, -127], [127, 0, 0]]  # 1.5 * 127 / 2 = 95.25 -> 95
    assert layer.scale.tolist() == pytest.approx([2 / 127, 4 / 127])
    with pytest.raises(ValueError, match=r"expected a weight of shape \(2, 3\).*got \(3, 2\)"):
        layer.load_weight(torch.ones(3, 2))
    with pytest.raises(ValueError, match="NaN or inf"):
        layer.load_weight(torch.tensor([[0.0, math.nan, 1.0], [1.0, 1.0, 1.0]]))


# ------------------------------------------------------------------------------------------------ a model


def test_quantize_linear_layers_names_and_ties():
    model = tiny_llama()
    names = quantize_linear_layers(model)
    assert names == [f"model.layers.{i}.{p}" for i in range(2) for p in PROJECTIONS]
    assert all(isinstance(model.get_submodule(n), Int8Linear) for n in names)
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.model.embed_tokens.weight
    assert quantize_linear_layers(model) == []  # nothing left to do
    # a tied lm_head stays full precision even when not skipped (a quantized copy would stop following the tie)
    tied = tiny_llama()
    assert "lm_head" not in quantize_linear_layers(tied, skip=())
    # untied, it is quantized unless skipped
    untied = tiny_llama(tie=False)
    assert quantize_linear_layers(untied, skip=())[-1] == "lm_head"
    assert quantize_linear_layers(tiny_llama(tie=False), skip=("lm_head", "up_proj")) == [
        f"model.layers.{i}.{p}" for i in range(2) for p in PROJECTIONS if p != "mlp.up_proj"]


def test_logprob_gap_of_int8_tiny_llama():
    """Estimates, each checked on the measurement:

    - per layer, the rounding error is ~uniform in [-s/2, s/2] (RMS s/sqrt(12), s = max|w_row| / 127); for
      Gaussian rows of 64-128 entries max|w| ~ 2.5-3 sigma, so eps = ||W - W'|| / ||W|| ~ 3 / (127 sqrt(12))
      ~ 0.7 % (asserted < 1 %);
    - 14 layers with independent errors and gains near 1 add in quadrature: the relative logit error is about
      sqrt(sum_l eps_l^2) ~ 2.3 % (asserted < 2x that, for the gains);
    - so |delta logit| is typically ~2.3 % of the logit RMS (~0.8), ~0.02; a logprob moves by
      delta z_y - E_p[delta z] (~sqrt(2) x 0.02) and by at most 2 max|delta z| (logsumexp is 1-Lipschitz in
      the max norm); the max over 60 tokens, ~3 typical, stays below 0.1.
    """
    model = tiny_llama()
    quantized = copy.deepcopy(model)
    names = quantize_linear_layers(quantized)
    weights = {n: model.get_submodule(n).weight.detach() for n in names}
    eps = [float((weights[n] - quantized.get_submodule(n).dequantize()).norm() / weights[n].norm()) for n in names]
    assert max(eps) < 0.01
    ids = random_ids()
    full, int8 = logits_of(model, ids), logits_of(quantized, ids)
    rel = float((full - int8).norm() / full.norm())
    assert rel < 2 * math.sqrt(sum(e * e for e in eps))
    gap = (logprobs_from_logits(full[:, :-1], ids[:, 1:]) - logprobs_from_logits(int8[:, :-1], ids[:, 1:])).abs()
    logger.info("int8 tiny Llama: per-layer weight error %.4f (mean), relative logit error %.4f, "
                "|logprob gap| max %.4f mean %.4f over %d tokens", sum(eps) / len(eps), rel, gap.max(), gap.mean(),
                gap.numel())
    assert gap.max() <= 2 * (full - int8).abs().max() + 1e-6
    assert gap.max() < 0.1


def test_logprob_gap_on_tokens_sampled_by_the_int8_builtin_model():
    """The case that matters for RL: the tokens an int8 generator samples, scored by the fp32 policy.

    On the shipped SFT model (tiny-arith) the sampled tokens are confident, so their logprobs barely move; the
    importance ratio pi_fp32 / mu_int8 stays within a few percent of 1, far below any AIPO cap rho.
    """
    from hybridflow.data.builtin_task import make_builtin_problems
    from hybridflow.models.builtin import resolve_model_path
    from hybridflow.models.hf import load_causal_lm, load_tokenizer

    path = resolve_model_path("builtin:tiny-arith")
    model, tokenizer = load_causal_lm(path, torch.float32).eval(), load_tokenizer(path)
    generator = copy.deepcopy(model)
    quantize_linear_layers(generator)
    tokenizer.padding_side = "left"
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p.question}], tokenize=False,
                                             add_generation_prompt=True)
               for p in make_builtin_problems("val", 16, seed=0)]
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(0)
    with torch.no_grad():
        out = generator.generate(**enc, do_sample=True, top_k=0, top_p=1.0, temperature=1.0, max_new_tokens=20,
                                 pad_token_id=tokenizer.pad_token_id)
    width = enc["input_ids"].shape[1]
    responses = out[:, width:]
    done = (responses == tokenizer.eos_token_id) | (responses == tokenizer.pad_token_id)
    response_mask = (done.long().cumsum(1) - done.long()) == 0  # through the first eos, inclusive
    attention = torch.cat([enc["attention_mask"], torch.ones_like(responses)], 1)
    positions = (attention.cumsum(1) - 1).clamp(min=0)

    def response_logprobs(m):
        with torch.no_grad():
            logits = m(input_ids=out, attention_mask=attention, position_ids=positions).logits[:, width - 1:-1]
        return logprobs_from_logits(logits, responses)[response_mask]

    pi, mu = response_logprobs(model), response_logprobs(generator)
    gap = (pi - mu).abs()
    logger.info("int8 tiny-arith, %d sampled tokens: |logprob gap| max %.5f mean %.6f; ratio pi/mu in [%.4f, %.4f]",
                gap.numel(), gap.max(), gap.mean(), torch.exp(pi - mu).min(), torch.exp(pi - mu).max())
    assert gap.numel() > 100
    assert gap.max() < 0.05 and gap.mean() < 0.005


def test_load_weights_quantized_equals_quantizing_the_new_weights():
    generator = tiny_llama(seed=0)
    quantize_linear_layers(generator)
    trained = tiny_llama(seed=1)  # "the trainer's new weights": every tensor differs
    reference = copy.deepcopy(trained)
    quantize_linear_layers(reference)
    # what a trainer sends: its parameters, tied ones once (no lm_head.weight)
    load_weights_quantized(generator, ((n, p.detach()) for n, p in trained.named_parameters()))
    _assert_same_state(generator, reference)
    assert generator.lm_head.weight is generator.model.embed_tokens.weight  # the tie survives
    ids = random_ids(1)
    assert torch.equal(logits_of(generator, ids), logits_of(reference, ids))
    # the full state dict (lm_head.weight too, the tied alias) and bf16 tensors also work
    third = tiny_llama(seed=2)
    load_weights_quantized(generator, third.state_dict().items())
    quantize_linear_layers(third)
    _assert_same_state(generator, third)
    ones = torch.ones(128, 64, dtype=torch.bfloat16)
    load_weights_quantized(generator, [("model.layers.0.mlp.up_proj.weight", ones)])
    assert (generator.model.layers[0].mlp.up_proj.dequantize() == 1).all()


def test_load_weights_quantized_untied_lm_head():
    generator, trained = tiny_llama(seed=0, tie=False), tiny_llama(seed=1, tie=False)
    quantize_linear_layers(generator, skip=())
    load_weights_quantized(generator, trained.state_dict().items())
    quantize_linear_layers(trained, skip=())
    _assert_same_state(generator, trained)


def test_load_weights_quantized_errors():
    generator = tiny_llama()
    quantize_linear_layers(generator)
    with pytest.raises(KeyError, match="no parameter 'model.layers.0.mlp.up_prj.weight'.*up_proj.weight"):
        load_weights_quantized(generator, [("model.layers.0.mlp.up_prj.weight", torch.zeros(128, 64))])
    with pytest.raises(ValueError, match=r"expected a weight of shape \(128, 64\)"):
        load_weights_quantized(generator, [("model.layers.0.mlp.up_proj.weight", torch.zeros(64, 128))])
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(64,\), got \(32,\)"):
        load_weights_quantized(generator, [("model.norm.weight", torch.zeros(32))])


def _assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key
