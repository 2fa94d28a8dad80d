"""Each worker's constructor arguments, from the validated run config: one function per role, the only place that
reads another section on a worker's behalf (:mod:`hybridflow.workers.inputs`).

A function takes the run config and the run's total training steps (and its role's extra arguments,
:attr:`hybridflow.trainer.driver.Role.args`) and returns the worker constructor's positional arguments: the worker's
own section(s) as the schema's dataclass objects, its derived values, its role name where the class serves several.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import DictConfig, OmegaConf

from hybridflow.models import lora_sync
from hybridflow.workers.inputs import (ActorInputs, CriticInputs, GeneratorInputs, RuleRewardInputs,
                                       ScoreModelInputs, TokenizerSource)


def section(config: DictConfig, name: str) -> Any:
    """The run config's section ``name`` as a detached schema dataclass object (an OmegaConf node would pickle its
    root, so the worker would receive every section).

    Raises:
        TypeError: ``config`` is not a structured config of the schema (the section converts to no dataclass).
    """
    obj = OmegaConf.to_object(config[name])
    if isinstance(obj, dict):
        raise TypeError(f"{name}: expected a config loaded with hybridflow.config.load_config (a structured config "
                        "of the schema), got an untyped section")
    return obj


def actor_tokenizer(config: DictConfig) -> TokenizerSource:
    """The actor's tokenizer: ``actor_rollout_ref.model.tokenizer_path`` or ``.path``."""
    model = config.actor_rollout_ref.model
    return TokenizerSource(path=str(model.tokenizer_path or model.path), trust_remote_code=bool(model.trust_remote_code))


def rollout_lora_adapters(config: DictConfig) -> bool:
    """Whether the rollout receives LoRA adapters (:func:`hybridflow.models.lora_sync.rollout_takes_adapters`), with
    the registry facts it needs: the backend's ``lora_adapter_sync`` and whether the driver's generators are int8
    (driver metadata ``int8_generators_key``: the key that quantizes them, e.g. async_training.generator_quantization)."""
    from hybridflow.rollout import rollout_meta
    from hybridflow.trainer.driver import DRIVERS, driver_registry

    driver_registry()
    key = DRIVERS.meta(str(config.algorithm.driver), "int8_generators_key")
    int8 = key is not None and OmegaConf.select(config, key) == "int8"
    takes = bool(rollout_meta(str(config.actor_rollout_ref.rollout.name), "lora_adapter_sync", False))
    return lora_sync.rollout_takes_adapters(config, takes, int8)


def actor_args(config: DictConfig, total_steps: int, role: str = "actor_rollout_ref") -> tuple:
    """``ActorRolloutRefWorker(actor_rollout_ref, ActorInputs, role)``."""
    data = config.data
    actor = config.actor_rollout_ref.actor
    inputs = ActorInputs(
        seed=int(config.trainer.seed), total_training_steps=int(total_steps),
        nonfinite_grad=str(config.trainer.nonfinite_grad), max_prompt_length=int(data.max_prompt_length),
        max_response_length=int(data.max_response_length),
        loss_scale_factor=float(actor.loss_scale_factor or data.max_response_length),  # Dr. GRPO's constant L
        rollout_lora_adapters=rollout_lora_adapters(config),
        weight_sync_timeout_s=float(config.async_training.weight_sync_timeout_s))
    return section(config, "actor_rollout_ref"), inputs, role


def critic_args(config: DictConfig, total_steps: int) -> tuple:
    """``CriticWorker(critic, CriticInputs)`` (the reward critic and Safe-RLHF's cost critic alike)."""
    critic = section(config, "critic")
    model = critic.model
    if not model.path:  # the actor's checkpoint; every other key (dtype, use_remove_padding, LoRA) is the critic's
        actor = config.actor_rollout_ref.model
        model = dataclasses.replace(model, path=str(actor.path),
                                    tokenizer_path=model.tokenizer_path or actor.tokenizer_path,
                                    trust_remote_code=bool(model.trust_remote_code or actor.trust_remote_code))
    inputs = CriticInputs(seed=int(config.trainer.seed), total_training_steps=int(total_steps),
                          nonfinite_grad=str(config.trainer.nonfinite_grad),
                          rollout_n=int(config.actor_rollout_ref.rollout.n), model=model)
    return critic, inputs


def generator_args(config: DictConfig, total_steps: int) -> tuple:
    """``GeneratorWorker(actor_rollout_ref, async_training, GeneratorInputs)`` (generators never train:
    ``total_steps`` is unused)."""
    inputs = GeneratorInputs(max_prompt_length=int(config.data.max_prompt_length),
                             max_response_length=int(config.data.max_response_length),
                             rollout_lora_adapters=rollout_lora_adapters(config))
    return section(config, "actor_rollout_ref"), section(config, "async_training"), inputs


def rule_reward_args(config: DictConfig, total_steps: int) -> tuple:
    """``RuleRewardWorker(reward_model, RuleRewardInputs)``."""
    inputs = RuleRewardInputs(tokenizer=actor_tokenizer(config), cost_rule=config.cost_model.rule)
    return section(config, "reward_model"), inputs


def score_model_args(config: DictConfig, total_steps: int, role: str) -> tuple:
    """``RewardModelWorker(<role section>, ScoreModelInputs, role)`` for ``reward_model`` or ``cost_model``."""
    return section(config, role), ScoreModelInputs(actor_tokenizer=actor_tokenizer(config)), role
