"""Observation tokens carry no gradient through the actor's loss (policy loss + entropy bonus + KL loss, every
aggregation mode): the weight change of one SGD step (lr 1, no clipping: the change IS the gradient) is the same
when the observation tokens are replaced by other tokens, and when the logits at observation positions are
perturbed; the critic gives no value there and its loss ignores those positions. Model: a random tiny Llama;
trajectories of prompt, model turn, observation, model turn."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM

import hybridflow.training.fsdp2 as fsdp2_engine  # where the policy forward slices the response logits
from hybridflow.algorithms.sampling import SamplingSpec
from hybridflow.config.schema import ActorConfig
from hybridflow.distributed import iter_full_state
from hybridflow.protocol import DataProto
from hybridflow.workers.ppo_actor import PPOActor

B, P, R, V = 4, 3, 9, 32
MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
# response layout per row: model turn, observation, model turn, padding
SPANS = [(2, 3, 2), (1, 4, 3), (3, 2, 1), (2, 0, 0)]


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


def _masks():
    response_mask, attended = torch.zeros(B, R, dtype=torch.long), torch.zeros(B, R, dtype=torch.long)
    for row, (m1, obs, m2) in enumerate(SPANS):
        response_mask[row, :m1] = 1
        response_mask[row, m1 + obs:m1 + obs + m2] = 1
        attended[row, :m1 + obs + m2] = 1
    return response_mask, attended


def _batch(seed: int = 1) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    response_mask, attended = _masks()
    input_ids = torch.randint(0, V, (B, P + R), generator=g)
    return DataProto.from_dict(tensors={
        "input_ids": input_ids, "responses": input_ids[:, P:].clone(),
        "attention_mask": torch.cat([torch.ones(B, P, dtype=torch.long), attended], dim=1),
        "position_ids": torch.arange(P + R).expand(B, -1).clone(), "response_mask": response_mask,
        "old_log_probs": -torch.rand(B, R, generator=g) * 4, "advantages": torch.randn(B, R, generator=g),
        "ref_log_prob": -torch.rand(B, R, generator=g) * 4, "rollout_log_probs": -torch.rand(B, R, generator=g),
    })


def _step(data: DataProto, mode: str) -> dict[str, torch.Tensor]:
    model = _model()
    cfg = OmegaConf.structured(ActorConfig)
    cfg.loss_agg_mode, cfg.ppo_micro_batch_size_per_gpu, cfg.grad_clip = mode, 2, 1e9
    cfg.entropy_coeff, cfg.use_kl_loss, cfg.kl_loss_coef = 0.05, True, 0.5
    actor = PPOActor(model, torch.optim.SGD(model.parameters(), lr=1.0), cfg, SamplingSpec(), loss_scale_factor=R)
    before = {k: v.clone() for k, v in iter_full_state(model)}
    actor.update_policy(data, mini_batch_size=B)
    return {k: before[k] - v for k, v in iter_full_state(model)}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-7, msg=key)
    assert any(v.abs().max() > 0 for v in a.values())  # the step did move the weights


@pytest.mark.parametrize("mode", MODES)
def test_observation_tokens_as_targets_carry_no_gradient(mode):
    """Replace the observation tokens where they are the loss's targets (``responses``), and their per-token
    inputs to the loss (old/ref/rollout logprobs, advantages), by other values of the same length."""
    reference = _step(_batch(), mode)
    data = _batch()
    response_mask = data.batch["response_mask"]
    obs = (response_mask == 0) & (data.batch["attention_mask"][:, P:] == 1)
    g = torch.Generator().manual_seed(7)
    data.batch["responses"] = torch.where(obs, torch.randint(0, V, (B, R), generator=g), data.batch["responses"])
    for key in ("old_log_probs", "advantages", "ref_log_prob", "rollout_log_probs"):
        data.batch[key] = torch.where(obs, torch.randn(B, R, generator=g) * 50, data.batch[key])
    assert not torch.equal(data.batch["responses"], _batch().batch["responses"])
    _assert_same(reference, _step(data, mode))


def test_trailing_observation_tokens_change_nothing_even_as_inputs():
    """A trajectory that ends with an observation (model turn, then the tool output): replacing those tokens
    everywhere -- inputs and targets -- leaves the gradient unchanged (nothing after them is trained)."""
    first_turn = [m1 for m1, _, _ in SPANS]
    data = _batch()
    for row, m1 in enumerate(first_turn):  # the second model turn becomes code-made too: mask 0 after turn 1
        data.batch["response_mask"][row, m1:] = 0
    reference = _step(data, "token-mean")
    changed = _batch()
    changed.batch["response_mask"] = data.batch["response_mask"].clone()
    g = torch.Generator().manual_seed(9)
    for row, m1 in enumerate(first_turn):
        changed.batch["input_ids"][row, P + m1:] = torch.randint(0, V, (R - m1,), generator=g)
    changed.batch["responses"] = changed.batch["input_ids"][:, P:].clone()
    assert not torch.equal(changed.batch["input_ids"], data.batch["input_ids"])
    _assert_same(reference, _step(changed, "token-mean"))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_perturbed_logits_at_observation_positions_change_nothing(mode, monkeypatch):
    reference = _step(_batch(), mode)
    forward = fsdp2_engine.response_forward

    def perturbed(module, micro, response_length, remove_padding=False):
        logits = forward(module, micro, response_length, remove_padding)
        obs = (micro.batch["response_mask"] == 0).unsqueeze(-1)
        noise = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3)) * 10
        return torch.where(obs, logits + noise, logits)  # changes the logits the loss sees at observation slots

    monkeypatch.setattr(fsdp2_engine, "response_forward", perturbed)
    _assert_same(reference, _step(_batch(), mode))


def test_perturbed_logits_at_model_positions_do_change_the_step(monkeypatch):
    """Control: the same perturbation at model-token positions changes the step (the tests above can fail)."""
    reference = _step(_batch(), "token-mean")
    forward = fsdp2_engine.response_forward

    def perturbed(module, micro, response_length, remove_padding=False):
        logits = forward(module, micro, response_length, remove_padding)
        model_tokens = (micro.batch["response_mask"] == 1).unsqueeze(-1)
        return torch.where(model_tokens, logits + 3.0 * torch.arange(logits.shape[-1]) / logits.shape[-1], logits)

    monkeypatch.setattr(fsdp2_engine, "response_forward", perturbed)
    changed = _step(_batch(), "token-mean")
    assert any(not torch.allclose(reference[k], changed[k], rtol=1e-3, atol=1e-6) for k in reference)


def _critic_step(data: DataProto):
    from transformers import LlamaForTokenClassification

    from hybridflow.config.schema import CriticConfig
    from hybridflow.workers.ppo_critic import PPOCritic

    torch.manual_seed(0)
    model = LlamaForTokenClassification(LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_labels=1))
    cfg = OmegaConf.structured(CriticConfig)
    cfg.ppo_micro_batch_size_per_gpu, cfg.grad_clip = 2, 1e9
    critic = PPOCritic(model, torch.optim.SGD(model.parameters(), lr=1.0), cfg)
    values = critic.compute_values(data, micro_batch_size=2)
    before = {k: v.clone() for k, v in iter_full_state(model)}
    critic.update_critic(data, mini_batch_size=B)
    return values, {k: before[k] - v for k, v in iter_full_state(model)}


def test_critic_values_and_loss_only_on_model_tokens():
    """Values are 0 at observation positions; the value loss ignores what the returns/old values hold there."""
    data = _batch()
    g = torch.Generator().manual_seed(5)
    data.batch["returns"], data.batch["values"] = torch.randn(B, R, generator=g), torch.randn(B, R, generator=g)
    values, reference = _critic_step(data)
    assert torch.all(values[data.batch["response_mask"] == 0] == 0)
    assert torch.all(values[data.batch["response_mask"] == 1] != 0)
    obs = data.batch["response_mask"] == 0
    changed = _batch()
    for key in ("returns", "values"):
        changed.batch[key] = torch.where(obs, torch.randn(B, R, generator=g) * 100, data.batch[key])
    _assert_same(reference, _critic_step(changed)[1])
