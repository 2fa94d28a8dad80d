"""Skipping the redundant old-logprob forward (hybridflow/trainer/old_log_prob.py): when it is skipped, and that an
update without ``old_log_probs`` applies the same gradient and logs the same metrics as one with them recomputed."""

import json

import pytest
import torch
from omegaconf import OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM

from hybridflow.algorithms import masked_mean
from hybridflow.algorithms.sampling import SamplingSpec
from hybridflow.config import load_config
from hybridflow.config.schema import ActorConfig
from hybridflow.distributed import iter_full_state
from hybridflow.protocol import DataProto
from hybridflow.trainer.old_log_prob import model_has_dropout, old_log_prob_is_current
from hybridflow.workers.ppo_actor import PPOActor

ONE_UPDATE = ["actor_rollout_ref.actor.ppo_mini_batch_size=16"]  # grpo_quickstart: train_batch_size 16


@pytest.mark.parametrize("overrides, expected", [
    ([], False),  # grpo_quickstart: mini-batches of 8 prompts, 2 updates per step
    (ONE_UPDATE, True),
    (ONE_UPDATE + ["actor_rollout_ref.actor.ppo_epochs=2"], False),
    (ONE_UPDATE + ["algorithm.recompute_old_log_prob=always"], False),
    (ONE_UPDATE + ["algorithm.use_kl_in_reward=true"], False),
    (ONE_UPDATE + ["algorithm.bypass_old_log_prob=true"], False),
    (ONE_UPDATE + ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_dropout=0.1"], False),
])
def test_skipped_only_for_one_update_on_fresh_samples(overrides, expected):
    assert old_log_prob_is_current(load_config("grpo_quickstart", overrides)) is expected


def test_not_skipped_for_the_async_driver_or_a_model_with_dropout(tmp_path):
    cfg = load_config("async_grpo_quickstart", ["actor_rollout_ref.actor.ppo_mini_batch_size=16"])
    assert cfg.data.train_batch_size == 16 and not old_log_prob_is_current(cfg)
    assert not model_has_dropout("builtin:tiny-arith")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "attention_dropout": 0.1}))
    assert model_has_dropout(str(tmp_path))
    cfg = load_config("grpo_quickstart", ONE_UPDATE)
    OmegaConf.set_readonly(cfg, False)
    cfg.actor_rollout_ref.model.path = str(tmp_path)
    assert not old_log_prob_is_current(cfg)


B, P, R, V = 6, 3, 5, 32


def _actor() -> PPOActor:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1))
    cfg = OmegaConf.structured(ActorConfig)
    cfg.grad_clip, cfg.ppo_micro_batch_size_per_gpu, cfg.use_kl_loss = 1e9, 4, True
    return PPOActor(model, torch.optim.SGD(model.parameters(), lr=1.0), cfg, SamplingSpec(temperature=0.7))


def _batch() -> DataProto:
    g = torch.Generator().manual_seed(2)
    lengths = torch.tensor([1, 5, 3, 2, 4, 5])
    response_mask = (torch.arange(R)[None, :] < lengths[:, None]).long()
    ids = torch.randint(0, V, (B, P + R), generator=g)
    return DataProto.from_dict(tensors={
        "input_ids": ids, "responses": ids[:, P:], "response_mask": response_mask,
        "attention_mask": torch.cat([torch.ones(B, P, dtype=torch.long), response_mask], dim=1),
        "position_ids": torch.arange(P + R).expand(B, -1).clone(), "advantages": torch.randn(B, R, generator=g),
        "ref_log_prob": -torch.rand(B, R, generator=g) * 3, "rollout_log_probs": -torch.rand(B, R, generator=g) * 3,
    })


def _update(actor: PPOActor, data: DataProto) -> tuple[dict, dict]:
    before = {k: v.clone() for k, v in iter_full_state(actor.module)}
    metrics = actor.update_policy(data, mini_batch_size=B)
    return {k: before[k] - v for k, v in iter_full_state(actor.module)}, metrics


def test_update_without_old_log_probs_equals_the_recomputed_one():
    recomputing = _actor()
    data = _batch()
    old, entropy = recomputing.compute_log_prob(data, 3, calculate_entropy=True)
    data.batch["old_log_probs"] = old
    mask = data.batch["response_mask"]
    # what the driver logs from the recomputed forward (hybridflow.trainer.steps.compute_data_metrics)
    expected_metrics = {"actor/entropy": masked_mean(entropy, mask).item(),
                        "rollout/kl": masked_mean(old - data.batch["ref_log_prob"], mask).item(),
                        "rollout/logprob_diff_max": (old - data.batch["rollout_log_probs"]).abs()[mask.bool()].max().item()}
    delta_ref, metrics_ref = _update(recomputing, data)
    delta, metrics = _update(_actor(), _batch())
    for name, d in delta_ref.items():
        torch.testing.assert_close(delta[name], d, atol=1e-6, rtol=0, msg=name)
    assert max(d.abs().max() for d in delta_ref.values()) > 1e-4
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/ppo_kl", "actor/pg_clipfrac"):
        assert metrics[key] == pytest.approx(metrics_ref[key], abs=1e-6), key
    for key in ("actor/entropy", "rollout/kl", "rollout/logprob_diff_max"):
        assert metrics[key] == pytest.approx(expected_metrics[key], abs=1e-5), key


def test_update_without_old_log_probs_refuses_several_mini_batches():
    with pytest.raises(ValueError, match="one update per batch"):
        _actor().update_policy(_batch(), mini_batch_size=B // 2)
