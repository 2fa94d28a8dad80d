"""The Ulysses keys (``*.ulysses_sequence_parallel_size``) validated at load, each problem in one line, and the
engine layout the workers build from them (dp = ranks / sp; one dispatch chunk per dp group)."""

import json

import pytest

from hybridflow.config import ConfigError, load_config
from hybridflow.training import ParallelLayout, engine_layout

SP = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
REF_SP = "actor_rollout_ref.ref.ulysses_sequence_parallel_size"
CRITIC_SP = "critic.ulysses_sequence_parallel_size"


def _problems(*overrides):
    with pytest.raises(ConfigError) as err:
        load_config("quickstart", list(overrides))
    return err.value.problems


def test_sp_two_on_two_ranks_loads_and_lays_out_one_dp_group():
    cfg = load_config("quickstart", [f"{SP}=2", f"{REF_SP}=2"])
    actor = cfg.actor_rollout_ref.actor
    layout = engine_layout(actor.strategy, actor, 2, actor.tensor_model_parallel_size,
                           actor.ulysses_sequence_parallel_size)
    assert layout == ParallelLayout(dp=1, sp=2)
    # both ranks get dp chunk 0 (they share it); only rank 0 returns the group's results
    assert [layout.coords(r)[0] for r in range(2)] == [0, 0]
    assert [layout.collects(r) for r in range(2)] == [True, False]
    assert layout.weight_layout() == ParallelLayout(dp=2)  # the weights shard over both ranks
    assert engine_layout(cfg.critic.strategy, cfg.critic, 4, sp=cfg.critic.ulysses_sequence_parallel_size) == \
        ParallelLayout(dp=4)  # critic keeps sp=1


def test_sp_must_divide_the_ranks():
    problems = _problems(f"{SP}=3")
    assert f"{SP}=3 must divide the role's 2 ranks (dp = ranks / sp)" in problems, problems


def test_sp_must_divide_the_heads(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 3}))
    problems = _problems(f"{SP}=2", f"actor_rollout_ref.model.path={tmp_path}")
    assert any(p == f"{SP}=2 must divide the model's 3 attention heads ({tmp_path})" for p in problems), problems


def test_sp_needs_an_engine_with_it_and_no_tp():
    problems = _problems(f"{CRITIC_SP}=2", "critic.strategy=megatron", "critic.enable=true")
    assert any(p.startswith(f"{CRITIC_SP}=2: strategy=megatron has no Ulysses") for p in problems), problems
    problems = _problems(f"{SP}=2", "actor_rollout_ref.actor.tensor_model_parallel_size=2")
    assert any("sp and tp do not combine yet" in p for p in problems), problems


def test_reference_follows_the_actor():
    problems = _problems(f"{SP}=2", f"{REF_SP}=4")
    assert any(p.startswith(f"{REF_SP}=4 must equal {SP}=2") for p in problems), problems
    assert _problems(f"{SP}=0") == [f"{SP} must be >= 1, got 0"]


def test_megatron_context_parallelism_is_refused():
    # megatron-core 0.16.1's DotProductAttention asserts context_parallel_size == 1 without TransformerEngine
    key = "actor_rollout_ref.actor.megatron.context_parallel_size"
    problems = _problems(f"{key}=2")
    assert any(p.startswith(f"{key}=2: Megatron context parallelism needs TransformerEngine") for p in problems), \
        problems


def test_megatron_local_attention_has_no_context_parallelism():
    """The measurement behind the refusal: megatron-core's attention without TransformerEngine refuses cp=2."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, context_parallel_size=2)
    with pytest.raises(AssertionError, match="only supported by TEDotProductAttention"):
        DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
