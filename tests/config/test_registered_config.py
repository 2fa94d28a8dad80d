"""Configuration travels with registration (issue 48 item 4): a registry entry's ``config=`` dataclass adds its keys
to its section and its ``config_checks=`` validate them, for the built-in entries (whose keys moved out of the
central schema at the paths users write) and for a plugin's entries, loaded through ``trainer.plugins``."""

from __future__ import annotations

import dataclasses
import pickle
import sys
import textwrap

import pytest

from hybridflow.config import load_config
from hybridflow.config.assemble import assembled_schema
from hybridflow.config.loader import ConfigError
from hybridflow.config.schema import ActorConfig, AlgorithmConfig, HybridFlowConfig
from hybridflow.errors import UserError
from hybridflow.registry import Registry
from hybridflow.trainer.worker_inputs import section

PLUGIN = textwrap.dedent('''
    """A plugin with a policy loss and a driver that each bring a hyper-parameter of their own."""
    from dataclasses import dataclass, field

    from hybridflow.algorithms import compute_policy_loss_vanilla, register_policy_loss
    from hybridflow.trainer.driver import Driver, register_driver


    @dataclass
    class ScaledLossConfig:
        pg_scale: float = 1.0  # multiplies the vanilla loss


    def scaled_checks(get):
        scale = get("actor_rollout_ref.actor.pg_scale")
        return [] if scale > 0 else [f"actor_rollout_ref.actor.pg_scale: must be > 0, got {scale}"]


    @register_policy_loss("cfg_scaled_vanilla", config=ScaledLossConfig, config_checks=scaled_checks)
    def scaled_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                       rollout_log_probs=None, **agg_kwargs):
        out = compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                                          rollout_log_probs=rollout_log_probs, **agg_kwargs)
        return (out[0] * config.pg_scale, *out[1:])


    @dataclass
    class DecaySection:
        decay: float = 0.5  # how fast the driver forgets


    @dataclass
    class DecayDriverConfig:
        cfg_decay_driver: DecaySection = field(default_factory=DecaySection)  # the driver's own section


    def decay_checks(get):
        decay = get("algorithm.cfg_decay_driver.decay")
        return [] if 0 <= decay <= 1 else [f"algorithm.cfg_decay_driver.decay: must be in [0, 1], got {decay}"]


    @register_driver("cfg_decay_driver", config=DecayDriverConfig, config_checks=decay_checks)
    class DecayDriver(Driver):
        ROLES = ("actor",)
''')


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """The plugin file (imported once by the first load that names it); its entries are removed afterwards."""
    path = tmp_path_factory.mktemp("plugin") / "cfg_plugin.py"
    path.write_text(PLUGIN)
    yield f"trainer.plugins=[{path}]"
    from hybridflow.algorithms import POLICY_LOSSES
    from hybridflow.trainer.driver import DRIVERS, _ORDER

    for registry, name in ((POLICY_LOSSES, "cfg_scaled_vanilla"), (DRIVERS, "cfg_decay_driver")):
        if name in registry:
            registry.unregister(name)
    if "cfg_decay_driver" in _ORDER:
        _ORDER.remove("cfg_decay_driver")
    sys.modules.pop("hybridflow_plugin_cfg_plugin", None)


def _problems(*overrides):
    with pytest.raises(ConfigError) as info:
        load_config("grpo_quickstart", list(overrides))
    return info.value.problems


def test_plugin_keys_are_set_like_built_in_ones(plugin):
    cfg = load_config("grpo_quickstart", [plugin, "actor_rollout_ref.actor.policy_loss=cfg_scaled_vanilla",
                                          "actor_rollout_ref.actor.pg_scale=2.5",
                                          "algorithm.cfg_decay_driver.decay=0.25"])
    assert cfg.actor_rollout_ref.actor.pg_scale == 2.5 and cfg.algorithm.cfg_decay_driver.decay == 0.25
    defaults = load_config("grpo_quickstart", [plugin])
    assert defaults.actor_rollout_ref.actor.pg_scale == 1.0 and defaults.algorithm.cfg_decay_driver.decay == 0.5
    # the actor's workers get the loss's key in their section, which survives plain pickling
    actor = pickle.loads(pickle.dumps(section(cfg, "actor_rollout_ref"))).actor
    assert isinstance(actor, ActorConfig) and actor.pg_scale == 2.5 and actor.clip_ratio == 0.2


def test_a_typo_in_a_plugin_drivers_key_is_refused_with_the_nearest_key(plugin):
    (problem,) = _problems(plugin, "algorithm.cfg_decay_driver.dacay=0.1")
    assert problem.startswith("algorithm.cfg_decay_driver.dacay: unknown key")
    assert problem.endswith("did you mean algorithm.cfg_decay_driver.decay?")


def test_plugin_checks_run_at_load(plugin):
    assert _problems(plugin, "algorithm.cfg_decay_driver.decay=1.5") == [
        "algorithm.cfg_decay_driver.decay: must be in [0, 1], got 1.5"]
    assert _problems(plugin, "actor_rollout_ref.actor.pg_scale=0") == [
        "actor_rollout_ref.actor.pg_scale: must be > 0, got 0.0"]


@pytest.mark.parametrize("key, overrides, message", [
    ("actor_rollout_ref.actor.aipo_rho", ["actor_rollout_ref.actor.aipo_rho=0"], "must be > 0"),
    ("actor_rollout_ref.actor.icepop_alpha", ["actor_rollout_ref.actor.policy_loss=icepop",
                                              "actor_rollout_ref.actor.icepop_alpha=6"], "must be < "),
    ("algorithm.lagrangian.lambda_init", ["algorithm.lagrangian.lambda_init=0"], "must be > 0"),
    ("algorithm.filter_groups.metric", ["algorithm.filter_groups.metric=acx"], "did you mean acc?"),
    ("async_training.generator_quantization", ["async_training.generator_quantization=int4"], "not one of none, int8"),
])
def test_built_in_entries_keys_keep_their_paths_and_checks(key, overrides, message):
    section_path, name = key.rsplit(".", 1)
    central = {"actor_rollout_ref.actor": ActorConfig, "algorithm": AlgorithmConfig}.get(section_path, HybridFlowConfig)
    assert name not in {f.name for f in dataclasses.fields(central)}  # declared by its registry entry, not centrally
    (problem,) = _problems(*overrides)
    assert problem.startswith(key) and message in problem


def test_built_in_entries_keys_have_their_defaults():
    cfg = load_config(None)
    assert (cfg.actor_rollout_ref.actor.aipo_rho, cfg.actor_rollout_ref.actor.icepop_beta) == (4.0, 5.0)
    assert (cfg.algorithm.lagrangian.lambda_lr, cfg.async_training.max_staleness) == (0.1, 1)
    assert cfg.actor_rollout_ref.rollout.enforce_eager is None  # vllm's: CUDA graphs on GPU, eager on CPU


NO_DEFAULT = dataclasses.make_dataclass("NoDefault", [("x", int)])


@pytest.mark.parametrize("config, message", [(dict, "must be a dataclass type"), (NO_DEFAULT, "needs a default")])
def test_a_malformed_config_is_refused_at_registration(config, message):
    registry = Registry("thing", config_section="algorithm")
    with pytest.raises(TypeError, match=message):
        registry.register("t", config=config)(object())
    with pytest.raises(TypeError, match="needs config_section"):
        Registry("thing").register("t", config=dataclasses.make_dataclass("Ok", [("x", int, 1)]))(object())


def test_an_entry_redeclaring_a_central_key_is_refused_at_load():
    from hybridflow.algorithms import POLICY_LOSSES, compute_policy_loss_vanilla

    clash = dataclasses.make_dataclass("Clash", [("clip_ratio", float, 0.3)])
    POLICY_LOSSES.register("cfg_clash", config=clash)(compute_policy_loss_vanilla)
    try:
        with pytest.raises(UserError, match="declares actor_rollout_ref.actor.clip_ratio, a key the schema already"):
            assembled_schema()
    finally:
        POLICY_LOSSES.unregister("cfg_clash")


def test_an_engines_registration_decides_which_layout_section_it_reads():
    """A user engine declaring ``layout_section="megatron"`` gets the ``*.megatron`` checks megatron gets; an
    engine without it (fsdp2) refuses a layout it would ignore, naming the engines that read one."""
    from hybridflow.training import ENGINES, FSDP2Engine, register_engine

    @register_engine("cfg_pp_engine", layout_section="megatron")
    class PipelinedEngine(FSDP2Engine):
        pass

    try:
        cfg = load_config("quickstart", ["critic.strategy=cfg_pp_engine",
                                         "critic.megatron.pipeline_model_parallel_size=2"])
        assert cfg.critic.megatron.pipeline_model_parallel_size == 2  # 2 ranks, pp 2: accepted
        (problem,) = _problems("critic.strategy=cfg_pp_engine", "critic.megatron.pipeline_model_parallel_size=3")
        assert problem.startswith("critic.megatron: tensor_model_parallel_size * pipeline_model_parallel_size = 1 *")
        (problem,) = _problems("critic.megatron.pipeline_model_parallel_size=2")  # critic.strategy=fsdp2
        assert problem == ("critic.megatron (tp 1, pp 2) is read only with strategy=cfg_pp_engine | megatron, but "
                           "critic.strategy=fsdp2")
    finally:
        ENGINES.unregister("cfg_pp_engine")


def test_engine_sections_keep_their_paths_and_defaults():
    """fsdp2's ``fsdp_config`` (actor, critic) and megatron's ``megatron`` (actor, ref, critic) are declared by the
    engines' registrations, not centrally, at the paths and with the defaults users write."""
    from hybridflow.config.schema import CriticConfig, RefConfig

    for central in (ActorConfig, RefConfig, CriticConfig):
        assert not {"fsdp_config", "megatron"} & {f.name for f in dataclasses.fields(central)}
    cfg = load_config(None)
    for role in (cfg.actor_rollout_ref.actor, cfg.critic):
        assert dict(role.fsdp_config) == {"param_offload": False, "optimizer_offload": False,
                                             "reshard_after_forward": "auto", "fsdp_size": "auto"}
    for role in (cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.ref, cfg.critic):
        assert dict(role.megatron) == {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                                          "context_parallel_size": 1, "expert_model_parallel_size": 1,
                                          "expert_tensor_parallel_size": 1}
    assert "fsdp_config" not in cfg.actor_rollout_ref.ref  # the reference runs with the actor's
    (problem,) = _problems("critic.fsdp_config.param_ofload=true")
    assert problem.endswith("did you mean critic.fsdp_config.param_offload?")
    (problem,) = _problems("actor_rollout_ref.ref.megatron.context_parallel_size=2")  # megatron's own check
    assert problem.startswith("actor_rollout_ref.ref.megatron.context_parallel_size=2: Megatron context parallelism")
    (problem,) = _problems("critic.fsdp_config.fsdp_size=4")  # fsdp2's own check
    assert problem.startswith("critic.fsdp_config.fsdp_size must be auto, -1")
    actor = pickle.loads(pickle.dumps(section(cfg, "actor_rollout_ref"))).actor
    assert actor.fsdp_config.param_offload is False and actor.megatron.pipeline_model_parallel_size == 1


ENGINE_PLUGIN = textwrap.dedent('''
    """A user engine with a sub-section of its own."""
    from dataclasses import dataclass, field

    from hybridflow.training import FSDP2Engine, register_engine


    @dataclass
    class MineKnobs:
        buckets: int = 4  # gradient buckets


    @dataclass
    class MineConfig:
        mine: MineKnobs = field(default_factory=MineKnobs)  # strategy=cfg_mine: the engine's knobs


    def mine_checks(get):
        return [f"{s}.mine.buckets: must be >= 1, got {get(s + '.mine.buckets')}"
                for s in ("actor_rollout_ref.actor", "critic") if get(s + ".mine.buckets") < 1]


    @register_engine("cfg_mine", config=MineConfig, config_checks=mine_checks)
    class MineEngine(FSDP2Engine):
        pass
''')


def test_a_plugin_engines_section_is_validated_like_the_built_in_ones(tmp_path):
    from hybridflow.training import ENGINES

    path = tmp_path / "cfg_engine_plugin.py"
    path.write_text(ENGINE_PLUGIN)
    plugin = f"trainer.plugins=[{path}]"
    try:
        cfg = load_config("quickstart", [plugin, "critic.strategy=cfg_mine", "critic.mine.buckets=2"])
        assert cfg.critic.mine.buckets == 2 and cfg.actor_rollout_ref.actor.mine.buckets == 4
        (problem,) = _problems(plugin, "critic.mine.bucket=2")
        assert problem.startswith("critic.mine.bucket: unknown key") and problem.endswith(
            "did you mean critic.mine.buckets?")
        assert _problems(plugin, "actor_rollout_ref.actor.mine.buckets=0") == [
            "actor_rollout_ref.actor.mine.buckets: must be >= 1, got 0"]
    finally:
        if "cfg_mine" in ENGINES:
            ENGINES.unregister("cfg_mine")
        sys.modules.pop("hybridflow_plugin_cfg_engine_plugin", None)


def test_loading_a_config_imports_neither_ray_nor_transformers():
    """The engines' config sections come from their light registrations (hybridflow/training/*_config.py): loading
    a config, megatron's included, leaves Ray and transformers unimported (each takes seconds)."""
    import subprocess
    from pathlib import Path

    code = ("import sys; from hybridflow.config import load_config; "
            "load_config('quickstart', ['actor_rollout_ref.actor.strategy=megatron', 'critic.strategy=megatron']); "
            "print(sorted(m for m in ('ray', 'transformers', 'hybridflow.training.fsdp2', "
            "'hybridflow.training.megatron') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_a_lazy_entry_is_imported_at_its_first_get():
    registry = Registry("thing", config_section="algorithm")
    config = dataclasses.make_dataclass("Knob", [("knob", int, 1)])
    registry.register_lazy("ordered", "collections:OrderedDict", config=config, flavour="sweet")
    assert "ordered" in registry and registry.names() == ["ordered"]
    assert registry.meta("ordered", "flavour") == "sweet"
    assert registry.config_entries() == [("ordered", "algorithm", config)]
    assert "ordered" in registry._lazy  # nothing imported by the metadata reads
    from collections import OrderedDict

    assert registry.get("ordered") is OrderedDict and "ordered" not in registry._lazy
    with pytest.raises(ValueError, match="already registered to collections:OrderedDict"):
        registry.register_lazy("ordered", "collections:Counter")
    with pytest.raises(ValueError, match="'module:attribute'"):
        registry.register_lazy("bad", "collections.Counter")
    multi = Registry("thing", config_section=("algorithm", "critic"))
    multi.register("t", config=config)(object())
    assert [s for _, s, _ in multi.config_entries()] == ["algorithm", "critic"]
