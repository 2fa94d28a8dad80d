"""The ``*.megatron`` keys (strategy=megatron): defaults, load-time checks with one line each, the layout the
workers build, and the engine registration (no megatron-core needed for any of these)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from hybridflow.config import load_config
from hybridflow.config.loader import ConfigError
from hybridflow.training import ParallelLayout, engine_layout, get_engine_class

RECIPE = "recipes/megatron_quickstart.yaml"


def test_recipe_loads_with_pipeline_stages_for_actor_and_critic() -> None:
    cfg = load_config(RECIPE, [])
    assert cfg.actor_rollout_ref.actor.strategy == cfg.critic.strategy == "megatron"
    assert cfg.actor_rollout_ref.actor.megatron.pipeline_model_parallel_size == 2
    assert engine_layout("megatron", cfg.critic, 2) == ParallelLayout(dp=1, tp=1, pp=2)
    assert engine_layout("fsdp2", cfg.critic, 2, fsdp_tp=2) == ParallelLayout(dp=1, tp=2, pp=1)


def test_expert_parallel_size_is_read_into_the_layout() -> None:
    """verl's key: ``*.megatron.expert_model_parallel_size`` gives the layout's ep (world unchanged)."""
    cfg = load_config(RECIPE, ["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",
                               "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2"])
    layout = engine_layout("megatron", cfg.actor_rollout_ref.actor, 2)
    assert layout == ParallelLayout(dp=2, tp=1, pp=1, ep=2) and layout.world == 2


@pytest.mark.parametrize("overrides,message", [
    (["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=3"],
     "tensor_model_parallel_size * pipeline_model_parallel_size = 1 * 3 must divide the role's 2 ranks"),
    (["critic.strategy=fsdp2"], "critic.megatron (tp 1, pp 2) is read only with strategy=megatron"),
    (["actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2"],
     "must equal actor_rollout_ref.actor.megatron (1, 2, 1, 1)"),
    (["actor_rollout_ref.ref.megatron.expert_model_parallel_size=2"],
     "must equal actor_rollout_ref.actor.megatron (1, 2, 1, 1)"),
    (["critic.megatron.expert_model_parallel_size=2"],
     "critic.megatron.expert_model_parallel_size=2 must be >= 1 and divide data * tensor parallel = 1 ranks"),
    (["actor_rollout_ref.actor.megatron.expert_model_parallel_size=0"], "expert_model_parallel_size=0 must be >= 1"),
    (["critic.megatron.expert_tensor_parallel_size=2"], "expert_tensor_parallel_size=2: only 1 is supported"),
    (["critic.strategy=fsdp2", "critic.megatron.pipeline_model_parallel_size=1",
      "critic.megatron.expert_model_parallel_size=2"], "critic.megatron (tp 1, pp 1, ep 2, etp 1) is read only"),
    (["actor_rollout_ref.actor.tensor_model_parallel_size=2"], "with strategy=megatron set"),
    (["critic.megatron.tensor_model_parallel_size=0"], "must be >= 1"),
])
def test_bad_megatron_layouts_fail_at_load_with_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(RECIPE, overrides)
    assert message in str(err.value)


def test_missing_megatron_core_is_one_line_naming_the_extra(monkeypatch) -> None:
    from hybridflow.config import megatron_checks

    monkeypatch.setattr(megatron_checks, "_installed", lambda package: package != "megatron.core")
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[megatron\]"'):
        load_config(RECIPE, [])


def test_defaults_are_one_stage_and_registered() -> None:
    cfg = load_config("quickstart", [])
    for section in (cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.ref, cfg.critic):
        assert OmegaConf.to_container(section.megatron) == {
            "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "context_parallel_size": 1,
            "expert_model_parallel_size": 1, "expert_tensor_parallel_size": 1}
    assert get_engine_class("megatron").__name__ == "MegatronEngine"


def test_resume_refuses_another_megatron_layout(tmp_path) -> None:
    """A checkpoint written with pp=2 cannot be resumed with pp=1 (per-rank files); one line names the key."""
    from hybridflow.trainer.checkpoint import IncompatibleCheckpointError, check_resume_config, save_config

    save_config(load_config(RECIPE, []), str(tmp_path / "config.yaml"))
    check_resume_config(load_config(RECIPE, []), str(tmp_path))  # same layout: resumes
    with pytest.raises(IncompatibleCheckpointError, match="critic.megatron.pipeline_model_parallel_size: 2 in the "
                                                          "checkpoint, 1 now"):
        check_resume_config(load_config(RECIPE, ["critic.megatron.pipeline_model_parallel_size=1"]), str(tmp_path))
