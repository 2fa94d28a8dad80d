"""Tests for the ``hf`` rollout backend, on tiny random Llama models built from a config (no downloads).

References are computed independently of the rollout's decoding loop: a naive greedy loop that re-runs
the full forward without a cache, one full forward over prompt + response for logprobs, and first-eos
positions read off an eos-free greedy run.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers

from helpers.models import tiny_model as helper_model
from hybridflow.protocol import DataProto
from hybridflow.rollout import BaseRollout, HFRollout, RolloutAsleepError, get_rollout_class, register_rollout

VOCAB = 64
PAD = 0
NO_EOS = VOCAB + 1  # an id the model can never emit, so rows run to response_length


def tiny_model(seed: int = 0) -> transformers.LlamaForCausalLM:
    # initializer_range: the default 0.02 makes greedy repeat the last prompt token forever
    return helper_model(seed=seed, eval=True, vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                        max_position_embeddings=128, tie_word_embeddings=True, initializer_range=0.2)


def rollout_config(**overrides) -> SimpleNamespace:
    values = dict(response_length=8, n=1, do_sample=False, temperature=1.0, top_p=1.0, top_k=-1, micro_batch_size=4)
    values.update(overrides)
    return SimpleNamespace(**values)


def left_pad(prompts: list[list[int]], meta_info: dict | None = None) -> DataProto:
    """Left-padded prompt batch with positions counting real tokens from 0 (pads at position 0)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    tensors = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    return DataProto.from_dict(tensors=tensors, meta_info=meta_info or {})


@torch.no_grad()
def naive_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding that re-runs the whole unpadded sequence every step, without a cache."""
    ids = list(prompt)
    for _ in range(steps):
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


@torch.no_grad()
def full_forward_log_probs(model, out: DataProto, temperature: float) -> torch.Tensor:
    """(N, R) logprobs of the response tokens from one forward over prompt + response."""
    batch = out.batch
    prompt_len, response_len = batch["prompts"].shape[1], batch["responses"].shape[1]
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        use_cache=False,
    ).logits.float()
    logits = logits[:, prompt_len - 1 : prompt_len - 1 + response_len] / temperature
    return logits.log_softmax(-1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)


PROMPTS = [[5, 9, 13, 2], [7, 7, 21, 30, 44, 3, 8], [11], [60, 1, 17]]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_registry():
    assert get_rollout_class("hf") is HFRollout
    with pytest.raises(KeyError, match="unknown rollout backend 'nope'.*hf"):
        get_rollout_class("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_rollout("hf")(type("Other", (HFRollout,), {}))
    with pytest.raises(TypeError, match="BaseRollout subclass"):
        register_rollout("x")(object)
    assert issubclass(HFRollout, BaseRollout)


def test_greedy_matches_naive_loop_and_output_layout():
    model = tiny_model()
    config = rollout_config(micro_batch_size=3, temperature=0.5)  # do_sample is False: temperature unused
    rollout = HFRollout(model, config, eos_token_id=NO_EOS, pad_token_id=PAD)
    prompts = left_pad(PROMPTS)
    out = rollout.generate_sequences(prompts)
    b, p, r = len(PROMPTS), prompts.batch["input_ids"].shape[1], 8
    assert len(out) == b
    for row, prompt in enumerate(PROMPTS):
        assert out.batch["responses"][row].tolist() == naive_greedy(model, prompt, r)
    assert torch.equal(out.batch["prompts"], prompts.batch["input_ids"])
    assert torch.equal(out.batch["input_ids"], torch.cat([out.batch["prompts"], out.batch["responses"]], 1))
    assert torch.equal(out.batch["response_mask"], torch.ones(b, r, dtype=torch.long))
    assert torch.equal(out.batch["attention_mask"][:, :p], prompts.batch["attention_mask"])
    assert torch.equal(out.batch["attention_mask"][:, p:], out.batch["response_mask"])
    expected_positions = torch.tensor([len(x) - 1 for x in PROMPTS]).unsqueeze(1) + torch.arange(1, r + 1)
    assert torch.equal(out.batch["position_ids"][:, p:], expected_positions)
    assert out.batch["rollout_log_probs"].dtype == torch.float32
    assert out.meta_info["num_generated_tokens"] == b * r
    assert out.meta_info["generate_seconds"] > 0
    # greedy logprobs are under the raw (temperature 1) distribution, whatever the configured temperature
    assert torch.allclose(out.batch["rollout_log_probs"], full_forward_log_probs(model, out, 1.0), atol=1e-5)
    assert model.training is False


def test_left_padding_invariance():
    model = tiny_model()
    rollout = HFRollout(model, rollout_config(), eos_token_id=NO_EOS, pad_token_id=PAD)
    short, long = [11, 4, 9], [3, 8, 19, 27, 40, 51, 2, 6, 33]
    alone = rollout.generate_sequences(left_pad([short]))
    batched = rollout.generate_sequences(left_pad([long, short]))
    assert torch.equal(batched.batch["responses"][1], alone.batch["responses"][0])
    diff = (batched.batch["rollout_log_probs"][1] - alone.batch["rollout_log_probs"][0]).abs().max()
    assert diff <= 1e-5


def test_sampling_log_probs_match_full_forward():
    model = tiny_model()
    config = rollout_config(do_sample=True, temperature=0.7, response_length=10)
    rollout = HFRollout(model, config, eos_token_id=[NO_EOS], pad_token_id=PAD)
    out = rollout.generate_sequences(left_pad(PROMPTS, {"seed": 1}))
    reference = full_forward_log_probs(model, out, 0.7)
    mask = out.batch["response_mask"].bool()
    assert (out.batch["rollout_log_probs"][mask] - reference[mask]).abs().max() <= 1e-5


def test_sampling_log_probs_with_top_k_are_renormalized():
    model = tiny_model()
    config = rollout_config(do_sample=True, temperature=0.7, top_k=5)
    out = HFRollout(model, config, eos_token_id=NO_EOS, pad_token_id=PAD).generate_sequences(
        left_pad(PROMPTS, {"seed": 3})
    )
    # reference: the same full forward, keep the 5 largest logits per position, renormalize
    batch = out.batch
    p = batch["prompts"].shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits[:, p - 1 : -1] / 0.7
    top_values, top_ids = logits.topk(5, dim=-1)
    chosen = batch["responses"].unsqueeze(-1)
    assert (top_ids == chosen).any(-1).all()  # every sample lies in the top 5
    reference = (top_values.log_softmax(-1) * (top_ids == chosen)).sum(-1)
    assert (batch["rollout_log_probs"] - reference).abs().max() <= 1e-5


def _greedy_without_eos(model, prompts):
    return HFRollout(model, rollout_config(), eos_token_id=NO_EOS, pad_token_id=PAD).generate_sequences(
        left_pad(prompts)
    )


def _expected_lengths(responses: torch.Tensor, eos_ids: list[int]) -> list[int]:
    lengths = []
    for row in responses.tolist():
        hits = [i for i, token in enumerate(row) if token in eos_ids]
        lengths.append(hits[0] + 1 if hits else len(row))
    return lengths


@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_eos_stops_rows_and_masks(pad_is_eos):
    model = tiny_model()
    free = _greedy_without_eos(model, PROMPTS).batch["responses"]
    # two eos ids that greedy emits mid-response in some rows: row 0's 3rd token and row 1's 2nd token
    eos_ids = [int(free[0, 2]), int(free[1, 1])]
    pad = eos_ids[0] if pad_is_eos else PAD
    lengths = _expected_lengths(free, eos_ids)
    stop_tokens = {int(free[row, n - 1]) for row, n in enumerate(lengths) if int(free[row, n - 1]) in eos_ids}
    assert stop_tokens == set(eos_ids)  # both ids really end some row early
    rollout = HFRollout(model, rollout_config(), eos_token_id=eos_ids, pad_token_id=pad)
    out = rollout.generate_sequences(left_pad(PROMPTS))
    for row, length in enumerate(lengths):
        mask_row = out.batch["response_mask"][row].tolist()
        assert mask_row == [1] * length + [0] * (8 - length)
        tokens = out.batch["responses"][row].tolist()
        assert tokens[:length] == free[row, :length].tolist()
        assert tokens[length:] == [pad] * (8 - length)
        assert (out.batch["rollout_log_probs"][row, length:] == 0).all()
    assert out.meta_info["num_generated_tokens"] == sum(lengths)
    # truncated: the eos-free run emitted none of the eos ids in its 8 tokens (the length limit cut the row)
    assert out.batch["truncated"].tolist() == [not set(row) & set(eos_ids) for row in free.tolist()]


def test_truncated_flag_by_hand():
    from hybridflow.rollout.batching import truncated_responses

    eos = [7, 9]
    responses = torch.tensor([[1, 2, 3], [1, 2, 9], [1, 7, PAD], [4, 5, 6]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]])
    # full without eos -> truncated; eos in the last slot -> finished; ended early -> finished
    assert truncated_responses(responses, mask, eos).tolist() == [True, False, False, True]
    assert truncated_responses(responses, mask, torch.tensor(eos)).tolist() == [True, False, False, True]


def test_eos_from_meta_info_is_added_to_constructor_ids():
    model = tiny_model()
    free = _greedy_without_eos(model, PROMPTS).batch["responses"]
    extra = int(free[1, 1])
    rollout = HFRollout(model, rollout_config(), eos_token_id=NO_EOS, pad_token_id=PAD)
    out = rollout.generate_sequences(left_pad(PROMPTS, {"eos_token_id": [extra]}))
    lengths = _expected_lengths(free, [extra])
    assert out.batch["response_mask"].sum(-1).tolist() == lengths


def test_top_k_one_and_tiny_top_p_equal_greedy():
    model = tiny_model()
    greedy = _greedy_without_eos(model, PROMPTS).batch["responses"]
    for overrides in ({"top_k": 1}, {"top_p": 1e-6}):
        config = rollout_config(do_sample=True, temperature=1.3, **overrides)
        out = HFRollout(model, config, eos_token_id=NO_EOS, pad_token_id=PAD).generate_sequences(
            left_pad(PROMPTS)
        )
        assert torch.equal(out.batch["responses"], greedy), overrides
        # the filtered distribution has one token, so its logprob is 0
        assert out.batch["rollout_log_probs"].abs().max() <= 1e-6


def test_n_samples_interleaved_distinct_and_seeded():
    model = tiny_model()
    config = rollout_config(do_sample=True, temperature=1.0, n=3, micro_batch_size=2)
    rollout = HFRollout(model, config, eos_token_id=NO_EOS, pad_token_id=PAD)
    prompts = left_pad(PROMPTS[:3], {"seed": 7})
    out = rollout.generate_sequences(prompts)
    assert len(out) == 9
    expected_prompts = prompts.batch["input_ids"].repeat_interleave(3, dim=0)
    assert torch.equal(out.batch["prompts"], expected_prompts)
    for group in range(3):
        samples = {tuple(out.batch["responses"][group * 3 + k].tolist()) for k in range(3)}
        assert len(samples) == 3
    again = rollout.generate_sequences(left_pad(PROMPTS[:3], {"seed": 7}))
    assert torch.equal(again.batch["responses"], out.batch["responses"])
    assert torch.equal(again.batch["rollout_log_probs"], out.batch["rollout_log_probs"])
    other = rollout.generate_sequences(left_pad(PROMPTS[:3], {"seed": 8}))
    assert not torch.equal(other.batch["responses"], out.batch["responses"])
    # per-call override of n and response_length
    short = rollout.generate_sequences(left_pad(PROMPTS[:3], {"n": 1, "response_length": 4}))
    assert short.batch["responses"].shape == (3, 4)


def test_load_weights_changes_outputs_and_ties_embeddings():
    model_a, model_b = tiny_model(0), tiny_model(1)
    rollout = HFRollout(model_a, rollout_config(), eos_token_id=NO_EOS, pad_token_id=PAD)
    before = rollout.generate_sequences(left_pad(PROMPTS)).batch["responses"]
    rollout.load_weights(model_b.state_dict().items())
    after = rollout.generate_sequences(left_pad(PROMPTS)).batch["responses"]
    assert not torch.equal(before, after)
    for row, prompt in enumerate(PROMPTS):
        assert after[row].tolist() == naive_greedy(model_b, prompt, 8)

    new_embedding = torch.randn(VOCAB, 64)
    rollout.load_weights([("lm_head.weight", new_embedding)])
    assert torch.equal(model_a.model.embed_tokens.weight, new_embedding)
    rollout.load_weights(iter([("model.embed_tokens.weight", 2 * new_embedding)]))
    assert torch.equal(model_a.lm_head.weight, 2 * new_embedding)

    with pytest.raises(KeyError, match="lm_head.weights.*lm_head.weight"):
        rollout.load_weights([("lm_head.weights", new_embedding)])
    with pytest.raises(ValueError, match="shape"):
        rollout.load_weights([("lm_head.weight", torch.zeros(3, 3))])


def test_sleep_and_wake():
    model = tiny_model()
    rollout = HFRollout(model, rollout_config(), eos_token_id=NO_EOS, pad_token_id=PAD)
    expected = rollout.generate_sequences(left_pad(PROMPTS)).batch["responses"]
    state = {k: v.clone() for k, v in model.state_dict().items()}

    rollout.sleep()
    with pytest.raises(RolloutAsleepError, match="asleep"):
        rollout.generate_sequences(left_pad(PROMPTS))
    with pytest.raises(RolloutAsleepError, match="asleep"):
        rollout.load_weights(state.items())
    rollout.wake()
    assert torch.equal(rollout.generate_sequences(left_pad(PROMPTS)).batch["responses"], expected)

    rollout.sleep(level=2)
    assert model.lm_head.weight.device.type == "meta"
    rollout.wake()
    with pytest.raises(RolloutAsleepError, match="load_weights"):
        rollout.generate_sequences(left_pad(PROMPTS))
    rollout.load_weights((k, v) for k, v in state.items() if k != "lm_head.weight")  # tied: covered by embed
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(rollout.generate_sequences(left_pad(PROMPTS)).batch["responses"], expected)

    with pytest.raises(ValueError, match="sleep level"):
        rollout.sleep(level=3)


def test_invalid_inputs():
    rollout = HFRollout(tiny_model(), rollout_config(), eos_token_id=NO_EOS, pad_token_id=PAD)
    batch = left_pad(PROMPTS)
    with pytest.raises(ValueError, match="top_p"):
        rollout.generate_sequences(left_pad(PROMPTS, {"top_p": 0.0}))
    with pytest.raises(KeyError, match="position_ids"):
        tensors = {key: batch.batch[key] for key in ("input_ids", "attention_mask")}
        rollout.generate_sequences(DataProto.from_dict(tensors=tensors))


@pytest.mark.parametrize("sampling", [
    {"temperature": 0.7, "top_k": 5},
    {"temperature": 1.0, "top_p": 0.9},
    {"temperature": 1.3, "top_k": 12, "top_p": 0.8},
])
def test_trainer_recomputes_the_rollout_logprobs_under_top_k_top_p(sampling):
    """The PPO ratio pi_old / mu is 1 on every token that enters the loss: the actor's recomputed logprobs (one
    full forward, PPOActor.compute_log_prob with the rollout's sampling spec) equal the sampling logprobs."""
    from hybridflow.algorithms.sampling import SamplingSpec
    from hybridflow.config.schema import ActorConfig
    from hybridflow.workers.ppo_actor import PPOActor

    model = tiny_model()
    config = rollout_config(do_sample=True, response_length=12, n=2, **sampling)
    out = HFRollout(model, config, eos_token_id=NO_EOS, pad_token_id=PAD).generate_sequences(
        left_pad(PROMPTS, {"seed": 7})
    )
    spec = SamplingSpec.of(True, config.temperature, config.top_k, config.top_p)
    actor = PPOActor(model, None, ActorConfig(), spec)
    old_log_probs, entropy = actor.compute_log_prob(out, micro_batch_size=3, calculate_entropy=True)
    mask = out.batch["response_mask"].bool()
    ratio = torch.exp(old_log_probs - out.batch["rollout_log_probs"])[mask]
    assert mask.sum() == len(PROMPTS) * 2 * 12 and (ratio - 1).abs().max() <= 1e-5
    assert torch.isfinite(entropy).all()
    # the truncation matters here: the untruncated tempered softmax gives a different distribution
    full = full_forward_log_probs(model, out, config.temperature)
    assert (full[mask] - out.batch["rollout_log_probs"][mask]).abs().max() > 1e-2
