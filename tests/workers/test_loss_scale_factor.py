"""Dr. GRPO's seq-mean-token-sum-norm in the actor update divides by the constant loss_scale_factor, so the update
does not depend on how wide the batch happens to be padded; the logged loss is worked out by hand."""

import pytest
import torch
from omegaconf import OmegaConf
from transformers import LlamaForCausalLM

from helpers.models import tiny_model
from hybridflow.algorithms.sampling import SamplingSpec
from hybridflow.config.schema import ActorConfig
from hybridflow.protocol import DataProto
from hybridflow.workers.ppo_actor import PPOActor

B, P, V = 4, 3, 32
LENGTHS = torch.tensor([1, 4, 2, 3])
ADV = torch.tensor([1.0, -0.5, 2.0, 1.0])


def _model() -> LlamaForCausalLM:
    return tiny_model(seed=0, vocab_size=V, num_hidden_layers=1, tie_word_embeddings=True)


def _batch(width: int) -> DataProto:
    """The same 4 responses padded to ``width`` response slots (the extra slots are padding)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (B, P + 4), generator=g)
    ids = torch.cat([ids, torch.zeros(B, width - 4, dtype=torch.long)], dim=1)
    response_mask = (torch.arange(width)[None] < LENGTHS[:, None]).long()
    return DataProto.from_dict(tensors={
        "input_ids": ids, "responses": ids[:, P:], "response_mask": response_mask,
        "attention_mask": torch.cat([torch.ones(B, P, dtype=torch.long), response_mask], dim=1),
        "position_ids": torch.arange(P + width).expand(B, -1).clone(),
        "advantages": ADV[:, None].expand(B, width).clone()})


def _update(width: int, scale):
    cfg = OmegaConf.structured(ActorConfig)
    cfg.loss_agg_mode, cfg.ppo_micro_batch_size_per_gpu, cfg.grad_clip = "seq-mean-token-sum-norm", 2, 1e9
    model = _model()
    actor = PPOActor(model, torch.optim.SGD(model.parameters(), lr=1.0), cfg, SamplingSpec(), loss_scale_factor=scale)
    data = _batch(width)
    data.batch["old_log_probs"] = actor.compute_log_prob(data, B)[0]  # ratio 1: per-token loss is -A
    before = [p.detach().clone() for p in model.parameters()]
    metrics = actor.update_policy(data, mini_batch_size=B)
    return [b - p.detach() for b, p in zip(before, model.parameters())], metrics


def test_constant_scale_factor_by_hand_and_independent_of_padding():
    # ratio 1, so the loss is sum_i |y_i| * (-A_i) / L / B = -(1 * 1 - 4 * 0.5 + 2 * 2 + 3 * 1) / 10 / 4 = -0.15
    narrow, m_narrow = _update(5, 10.0)
    wide, m_wide = _update(9, 10.0)
    expected = -0.15
    assert m_narrow["actor/pg_loss"] == pytest.approx(expected, abs=1e-6)
    assert m_wide["actor/pg_loss"] == pytest.approx(expected, abs=1e-6)
    for a, b in zip(narrow, wide):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=0)
    assert max(d.abs().max() for d in narrow) > 1e-5  # it trained


def test_without_the_constant_the_padded_width_changes_the_update():
    narrow, m_narrow = _update(5, None)  # L = the batch's width: 5 vs 9
    wide, m_wide = _update(9, None)
    assert max((a - b).abs().max() for a, b in zip(narrow, wide)) > 1e-6
    ref_narrow, _ = _update(5, 5.0)
    for a, b in zip(narrow, ref_narrow):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=0)
