"""The hf rollout's lean decoding forward (hybridflow/rollout/fast_decode.py) against transformers' own forward, the
reference: for every supported architecture, every step's last-position logits equal the full (uncached) forward of
the sequence so far, in fp64 to 1e-9 (the same arithmetic) and in fp32 to rounding; the prompt forward shared by a
group of identical rows gives the same logits as one forward per row; unsupported architectures are refused, and
the rollout then decodes with the module's forward."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers

from helpers.models import tiny_model
from helpers.moe import ARCHITECTURES, tiny_moe
from hybridflow.models.moe import ROUTING_KEY
from hybridflow.protocol import DataProto
from hybridflow.rollout.fast_decode import LeanDecoder, lean_decoder
from hybridflow.rollout.hf_rollout import HFRollout

ARCHS = {  # model class, config overrides: GQA (4 query heads, 2 kv heads), biases (qwen2), q/k norms (qwen3)
    "llama": (transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3ForCausalLM, {"head_dim": 16}),
    "mistral": (transformers.MistralForCausalLM, {"sliding_window": None}),
}
STEPS = 6


def _model(arch: str, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    model_class, overrides = ARCHS[arch]
    model = tiny_model(model_class, seed=3, eval=True, num_attention_heads=4, num_key_value_heads=2,
                       initializer_range=0.2, **overrides)
    return model.to(dtype)


def _prompts(rows: int = 3, width: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompts of different lengths (row 0 keeps 4 tokens, row 1 six, the rest all 7)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 64, (rows, width), generator=generator)
    mask = torch.ones(rows, width, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, :1] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def _reference_logits(model, ids, mask, tokens) -> list[torch.Tensor]:
    """transformers' forward over the whole sequence at every step (no cache): the last position's logits after
    the prompt and after each of ``tokens`` (steps, N)."""
    out = []
    for step in range(len(tokens) + 1):
        seq = torch.cat([ids, tokens[:step].T], dim=1)
        full_mask = torch.cat([mask, mask.new_ones(len(ids), step)], dim=1)
        positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
        out.append(model(input_ids=seq, attention_mask=full_mask, position_ids=positions).logits[:, -1].float())
    return out


def _lean_logits(decoder: LeanDecoder, ids, mask, positions, tokens, copies: int = 1) -> list[torch.Tensor]:
    decoder.start(mask, ids.shape[1] + len(tokens), copies)
    out = [decoder.step(ids, positions)]
    for step, token in enumerate(tokens):
        out.append(decoder.step(token[:, None], positions[:, -1:] + step + 1))
    return out


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_step_equals_the_uncached_forward_in_fp64(arch):
    model = _model(arch)
    decoder = lean_decoder(model)
    assert decoder is not None
    ids, mask, positions = _prompts()
    tokens = torch.randint(1, 64, (STEPS, len(ids)), generator=torch.Generator().manual_seed(1))
    got = _lean_logits(decoder, ids, mask, positions, tokens)
    want = _reference_logits(model, ids, mask, tokens)
    assert want[0].abs().max() > 1.0  # not vacuous: logits far from zero
    for step, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=0, msg=f"{arch} step {step}")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fp32_agrees_to_rounding(arch):
    model = _model(arch, torch.float32)
    ids, mask, positions = _prompts()
    tokens = torch.randint(1, 64, (STEPS, len(ids)), generator=torch.Generator().manual_seed(2))
    got = _lean_logits(lean_decoder(model), ids, mask, positions, tokens)
    for step, (a, b) in enumerate(zip(got, _reference_logits(model, ids, mask, tokens))):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"step {step}")


def test_prompt_copies_run_one_prompt_forward_and_equal_separate_rows():
    model = _model("llama")
    ids, mask, positions = (t.repeat_interleave(2, dim=0) for t in _prompts())  # 3 prompts x 2 copies
    tokens = torch.randint(1, 64, (STEPS, len(ids)), generator=torch.Generator().manual_seed(4))
    rows_seen = []
    hook = model.model.embed_tokens.register_forward_hook(lambda mod, args, out: rows_seen.append(len(args[0])))
    shared = _lean_logits(lean_decoder(model), ids, mask, positions, tokens, copies=2)
    hook.remove()
    assert rows_seen[0] == 3 and rows_seen[1:] == [6] * STEPS  # the prompt forward once per group
    separate = _lean_logits(lean_decoder(model), ids, mask, positions, tokens, copies=1)
    for step, (a, b) in enumerate(zip(shared, separate)):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=0, msg=f"step {step}")


def test_rows_that_are_not_copies_are_not_shared():
    model = _model("llama")
    ids, mask, positions = _prompts(rows=4)  # four different prompts, told they are pairs of copies
    tokens = torch.randint(1, 64, (2, 4), generator=torch.Generator().manual_seed(5))
    got = _lean_logits(lean_decoder(model), ids, mask, positions, tokens, copies=2)
    for a, b in zip(got, _reference_logits(model, ids, mask, tokens)):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=0)


def test_unsupported_architectures_are_refused():
    assert lean_decoder(tiny_model(transformers.MistralForCausalLM, sliding_window=4)) is None
    assert lean_decoder(tiny_model(transformers.Qwen2ForCausalLM, use_sliding_window=True, sliding_window=4,
                                   max_window_layers=0)) is None
    assert lean_decoder(tiny_model(transformers.GPT2LMHeadModel, n_embd=32, n_layer=1, n_head=2)) is None
    assert lean_decoder(tiny_model(transformers.LlamaForSequenceClassification, num_labels=1)) is None


def test_step_before_start_and_past_capacity_raise():
    decoder = lean_decoder(_model("llama"))
    ids, mask, positions = _prompts()
    with pytest.raises(ValueError, match="start"):
        decoder.step(ids, positions)
    decoder.start(mask, ids.shape[1] + 1)
    decoder.step(ids, positions)
    decoder.step(ids[:, :1], positions[:, -1:] + 1)
    with pytest.raises(ValueError, match="capacity"):
        decoder.step(ids[:, :1], positions[:, -1:] + 2)
    with pytest.raises(ValueError, match="below the prompt length"):
        decoder.start(mask, ids.shape[1] - 1)


def _rollout(model, fast_decode: bool) -> HFRollout:
    config = SimpleNamespace(response_length=8, n=2, do_sample=False, temperature=1.0, top_p=1.0, top_k=-1,
                             micro_batch_size=8, fast_decode=fast_decode)
    return HFRollout(model, config, eos_token_id=999, pad_token_id=0)


def test_rollout_greedy_outputs_equal_with_and_without_fast_decode(monkeypatch):
    model = tiny_model(seed=5, eval=True, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)
    ids, mask, positions = _prompts()
    prompts = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": positions})
    calls = []
    original = LeanDecoder.step
    monkeypatch.setattr(LeanDecoder, "step", lambda self, *a: calls.append(1) or original(self, *a))
    fast = _rollout(model, True).generate_sequences(prompts)
    assert len(calls) == 8  # the lean forward decoded every step
    plain = _rollout(model, False).generate_sequences(prompts)
    assert len(calls) == 8  # fast_decode=false: the module's own forward only
    assert torch.equal(fast.batch["responses"], plain.batch["responses"])
    assert fast.batch["responses"].ne(0).any()  # not vacuous
    torch.testing.assert_close(fast.batch["rollout_log_probs"], plain.batch["rollout_log_probs"], atol=1e-5,
                               rtol=0)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_moe_steps_equal_the_uncached_forward_and_the_rollout_records_the_same_routing(arch):
    """Mixture-of-experts (8 experts, top-2): every lean step equals transformers' uncached forward in fp32 (the
    experts' grouped matmul has no fp64) to rounding, and a
    greedy hf rollout recording the routing gives the same responses, logprobs and routed_experts with the lean
    decoder as with the module's own forward."""
    model = tiny_moe(arch, seed=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     initializer_range=0.2).eval()
    decoder = lean_decoder(model)
    assert decoder is not None
    ids, mask, positions = _prompts()
    tokens = torch.randint(1, 64, (STEPS, len(ids)), generator=torch.Generator().manual_seed(1))
    for step, (a, b) in enumerate(zip(_lean_logits(decoder, ids, mask, positions, tokens),
                                      _reference_logits(model, ids, mask, tokens))):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"{arch} step {step}")
    prompts = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": positions})
    outs = []
    for fast in (True, False):
        rollout = _rollout(model, fast)
        rollout.config.record_routing = True
        outs.append(rollout.generate_sequences(prompts).batch)
    fast, plain = outs
    assert torch.equal(fast["responses"], plain["responses"]) and fast["responses"].ne(0).any()
    torch.testing.assert_close(fast["rollout_log_probs"], plain["rollout_log_probs"], atol=1e-5, rtol=0)
    assert fast[ROUTING_KEY].shape == plain[ROUTING_KEY].shape == (6, 7 + 8, 2, 2)
    fed = fast["attention_mask"].bool().clone()  # real tokens a forward fed (left padding routes arbitrarily:
    fed[:, -1] = False  # the lean decoder's padding queries attend to themselves only; nothing valid reads them)
    assert torch.equal(fast[ROUTING_KEY][fed], plain[ROUTING_KEY][fed])
