"""Each worker is constructed from its own config section(s) and a small frozen set of derived values, never from the
whole run config (issue 14, item 5): what every role of every built-in driver receives, what it must not receive,
and the clear errors of a wrong or missing argument."""

from __future__ import annotations

import dataclasses
import pickle
import typing

import pytest

from hybridflow.config import load_config
from hybridflow.config.assemble import assembled_schema, central_class
from hybridflow.config.schema import ActorRolloutRefConfig, CostConfig, CriticConfig, HybridFlowConfig, RewardConfig
from hybridflow.trainer.driver import get_driver
from hybridflow.trainer.driver_config import AsyncTrainingConfig
from hybridflow.trainer.worker_inputs import actor_args, critic_args
from hybridflow.workers.inputs import ActorInputs, CriticInputs

MARK = "zz_only_in_trainer_section"  # a value that lives in `trainer` alone
COST_MODEL = ["cost_model.enable=true", "cost_model.model.path=builtin:tiny-arith"]
REWARD_MODEL = ["reward_model.enable=true", "reward_model.model.path=builtin:tiny-arith"]

# role -> the schema sections its worker may receive (written out by hand, from what each worker computes)
ALLOWED = {
    "actor": {ActorRolloutRefConfig},
    "critic": {CriticConfig},
    "cost_critic": {CriticConfig},
    "generator": {ActorRolloutRefConfig, AsyncTrainingConfig},
    "reward": {RewardConfig},
    "reward_model": {RewardConfig},
    "cost_model": {CostConfig},
}
# the run's top-level sections (the central ones and those registry entries declare, e.g. async_training)
SECTIONS = {name: hint for name, hint in typing.get_type_hints(assembled_schema()).items()}
SECTION_CLASSES = {central_class(cls) for cls in SECTIONS.values()}


def _runs():
    yield "quickstart", [f"trainer.experiment_name={MARK}"] + REWARD_MODEL
    yield "remax_quickstart", [f"trainer.experiment_name={MARK}"]
    yield "safe_rlhf_quickstart", [f"trainer.experiment_name={MARK}"] + COST_MODEL
    yield "async_grpo_quickstart", [f"trainer.experiment_name={MARK}"]


def _leaf_names(cls: type) -> set[str]:
    out = set()
    for name, hint in typing.get_type_hints(cls).items():
        out |= _leaf_names(hint) if dataclasses.is_dataclass(hint) else {name}
    return out


def _schema_objects(value):
    """Every schema dataclass object inside ``value`` (args tuple, derived values, sections), outermost first."""
    if isinstance(value, (tuple, list)):
        for v in value:
            yield from _schema_objects(v)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        yield value
        for f in dataclasses.fields(value):
            yield from _schema_objects(getattr(value, f.name))


@pytest.mark.parametrize("recipe,overrides", list(_runs()), ids=lambda x: x if isinstance(x, str) else "")
def test_each_worker_receives_its_own_sections_only(recipe, overrides):
    cfg = load_config(recipe, overrides)
    roles = get_driver(cfg.algorithm.driver).roles(cfg)
    assert {"reward_model", "cost_model", "generator"} & set(roles) or recipe == "remax_quickstart"
    for role, spec in roles.items():
        args = spec.constructor_args(cfg, 7)
        top = [central_class(type(a)) for a in args if dataclasses.is_dataclass(a) and not isinstance(a, type)]
        top = [cls for cls in top if cls in SECTION_CLASSES]
        assert top and set(top) <= ALLOWED[role], (role, top)
        # no OmegaConf node (it would pickle its root) and no other top-level section anywhere inside
        inner = list(_schema_objects(args))
        inner_classes = [central_class(type(o)) for o in inner]
        assert not any(c in SECTION_CLASSES and c not in ALLOWED[role] for c in inner_classes), role
        assert all(c is not HybridFlowConfig for c in inner_classes)
        blob = pickle.dumps(args)
        assert MARK.encode() not in blob, f"{role} received the trainer section"
        # no key name of the sections it was not given is in the pickle (a short str pickles as \x8c, length, utf-8)
        received = set().union(*({f.name for f in dataclasses.fields(o)} for o in inner))
        for name, cls in SECTIONS.items():
            if central_class(cls) in ALLOWED[role]:
                continue
            for key in _leaf_names(cls) - received:
                assert b"\x8c" + bytes([len(key)]) + key.encode() not in blob, (role, name, key)


def test_derived_values_are_computed_once_by_the_driver_layer():
    cfg = load_config("quickstart", ["trainer.seed=5", "data.max_response_length=12", "trainer.nonfinite_grad=error",
                                     "actor_rollout_ref.rollout.n=2", "critic.ppo_mini_batch_size=8"])
    section, inputs, role = actor_args(cfg, 9, "actor_ref")
    assert (inputs.seed, inputs.total_training_steps, inputs.nonfinite_grad, role) == (5, 9, "error", "actor_ref")
    assert inputs.loss_scale_factor == 12.0  # actor.loss_scale_factor unset: data.max_response_length (Dr. GRPO's L)
    assert inputs.max_response_length == 12 and inputs.max_prompt_length == cfg.data.max_prompt_length
    assert section.rollout.n == 2 and not inputs.rollout_lora_adapters
    critic, cinputs = critic_args(cfg, 9)
    assert cinputs.rollout_n == 2 and critic.ppo_mini_batch_size == 8
    assert cinputs.model.path == "builtin:tiny-arith"  # critic.model.path "" -> the actor's checkpoint
    # ... and nothing else of the actor's: the critic's own dtype, packing and LoRA keys hold
    mixed = load_config("quickstart", ["actor_rollout_ref.model.path=builtin:tiny-tool",
                                       "actor_rollout_ref.model.use_remove_padding=true",
                                       "actor_rollout_ref.model.dtype=bfloat16", "critic.model.dtype=float32",
                                       "actor_rollout_ref.model.trust_remote_code=true"])
    model = critic_args(mixed, 1)[1].model
    assert (model.path, model.dtype, model.use_remove_padding, model.trust_remote_code) == (
        "builtin:tiny-tool", "float32", False, True)
    packed = critic_args(load_config("quickstart", ["critic.model.use_remove_padding=true"]), 1)[1].model
    assert packed.use_remove_padding and packed.path == "builtin:tiny-arith"
    own = load_config("quickstart", ["critic.model.path=builtin:tiny-tool", "critic.model.lora_rank=4"])
    assert critic_args(own, 1)[1].model.path == "builtin:tiny-tool"
    with pytest.raises(dataclasses.FrozenInstanceError):
        inputs.seed = 6


def test_a_missing_or_wrong_argument_fails_clearly(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    from omegaconf import OmegaConf

    from hybridflow.workers.actor_worker import ActorRolloutRefWorker
    from hybridflow.workers.critic_worker import CriticWorker
    from hybridflow.workers.generator_worker import GeneratorWorker
    from hybridflow.workers.rm_worker import RewardModelWorker

    cfg = load_config("quickstart")
    section, inputs, _ = actor_args(cfg, 3)
    fields = {f.name: getattr(inputs, f.name) for f in dataclasses.fields(ActorInputs)}
    del fields["total_training_steps"]
    with pytest.raises(TypeError, match="total_training_steps"):
        ActorInputs(**fields)
    with pytest.raises(TypeError, match="whole run config"):  # the full config where the section belongs
        ActorRolloutRefWorker(OmegaConf.to_object(cfg), inputs)
    with pytest.raises(TypeError, match="dataclass object.*got DictConfig"):  # an OmegaConf node carries its root
        ActorRolloutRefWorker(cfg.actor_rollout_ref, inputs)
    with pytest.raises(TypeError, match="expected the critic section"):
        CriticWorker(section, critic_args(cfg, 3)[1])
    with pytest.raises(TypeError, match=r"inputs must be a hybridflow\.workers\.inputs\.CriticInputs .*got ActorInputs"):
        CriticWorker(critic_args(cfg, 3)[0], inputs)
    with pytest.raises(TypeError, match="GeneratorInputs .*got NoneType"):
        GeneratorWorker(section, OmegaConf.to_object(cfg.async_training), None)
    with pytest.raises(TypeError, match="expected the cost_model section"):
        RewardModelWorker(section, None, "cost_model")
    worker = CriticWorker(*critic_args(cfg, 3))  # the right arguments construct (no model is built before init_model)
    assert isinstance(worker.inputs, CriticInputs) and worker.inputs.total_training_steps == 3
