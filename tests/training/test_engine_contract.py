"""The engine registry and the fsdp2 engine's contract on one process: strategy names checked at load for every
role, forward outputs against a hand-written computation, checkpoint round trip, the shard iterator."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hybridflow.algorithms.sampling import SamplingSpec
from hybridflow.config import load_config
from hybridflow.config.loader import ConfigError
from hybridflow.protocol import DataProto
from hybridflow.registry import UnknownNameError
from hybridflow.training import ENGINES, FSDP2Engine, get_engine_class, register_engine
from hybridflow.training.optim import build_lr_scheduler, build_optimizer
from hybridflow.config.schema import OptimConfig

V, P, R, B = 16, 3, 4, 2


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))


def _micro() -> DataProto:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (B, P + R), generator=g)
    mask = torch.ones(B, P + R, dtype=torch.long)
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask,
                                        "position_ids": torch.arange(P + R).expand(B, -1).clone(),
                                        "responses": ids[:, P:]})


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.strategy", "critic.strategy", "reward_model.strategy",
                                 "cost_model.strategy"])
def test_unknown_strategy_fails_at_load_listing_engines(key):
    with pytest.raises(ConfigError) as err:
        load_config("quickstart", [f"{key}=fsdp"])
    message = str(err.value)
    assert f"{key}: 'fsdp' is not implemented" in message
    assert "registered training engines: fsdp2" in message and "did you mean 'fsdp2'" in message


def test_registry_lookup_and_type_check():
    assert get_engine_class("fsdp2") is FSDP2Engine
    with pytest.raises(UnknownNameError, match="known: .*fsdp2"):
        get_engine_class("deepspeed")
    with pytest.raises(TypeError):
        register_engine("not_an_engine")(object)
    assert "not_an_engine" not in ENGINES


def test_policy_forward_is_the_sampled_distribution():
    """log_probs / entropy of the response tokens under temperature 2, from a plain forward by hand."""
    model, micro = _model(), _micro()
    engine = FSDP2Engine.from_module(model)
    engine.set_train(False)
    with torch.no_grad():
        out = engine.forward(micro, sampling=SamplingSpec(temperature=2.0), entropy=True)
        logits = model(input_ids=micro.batch["input_ids"]).logits[:, P - 1:-1].float() / 2.0
    logp = torch.log_softmax(logits, -1)
    expected = logp.gather(-1, micro.batch["responses"][..., None]).squeeze(-1)
    torch.testing.assert_close(out["log_probs"], expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(out["entropy"], -(logp.exp() * logp).sum(-1), rtol=0, atol=1e-6)


def test_checkpoint_round_trip_restores_weights_optimizer_schedule(tmp_path):
    model = _model()
    optim = OptimConfig(lr=1e-2, lr_warmup_steps=3)
    opt = build_optimizer(model, optim)
    engine = FSDP2Engine.from_module(model, opt, lr_scheduler=build_lr_scheduler(opt, optim, 10))

    def step() -> None:
        engine.zero_grad()
        engine.forward_backward(_micro(), lambda out: -out["log_probs"].mean())
        engine.optimizer_step()
        engine.lr_scheduler_step()

    step()
    engine.skipped_steps = 5
    engine.save_checkpoint(str(tmp_path / "ckpt"), {"note": 7})
    saved = {k: v.clone() for k, v in engine.iter_weights()}
    saved_lr = engine.lr_scheduler.get_last_lr()[0]
    step()
    assert any(not torch.equal(saved[k], v) for k, v in engine.iter_weights())
    extra = engine.load_checkpoint(str(tmp_path / "ckpt"))
    assert extra == {"note": 7} and engine.skipped_steps == 5
    assert engine.lr_scheduler.get_last_lr()[0] == saved_lr == pytest.approx(1e-2 * 2 / 4)  # warm-up step 1 of 3
    for k, v in engine.iter_weights():
        assert torch.equal(saved[k], v), k


def test_shards_single_process_are_the_parameters():
    model = _model()
    engine = FSDP2Engine.from_module(model)
    specs = engine.weight_specs()
    shards = dict(engine.iter_shards())
    assert list(specs) == list(shards) == [n for n, _ in model.named_parameters()]
    for name, p in model.named_parameters():
        assert shards[name].data_ptr() == p.data_ptr()  # a view, no copy
        assert specs[name].shape == tuple(p.shape) and specs[name].tp_dim is None
