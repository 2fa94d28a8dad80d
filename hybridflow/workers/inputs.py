"""What each worker is constructed from: its own config section(s), as the schema's dataclasses, plus a small frozen
set of values derived from the rest of the run config.

A worker never receives the whole run config. The driver layer (:mod:`hybridflow.trainer.worker_inputs`, one
function per role) cuts the sections out of the validated config and computes the derived values once, so a
worker's dependencies are its constructor's arguments and nothing a worker reads was re-derived in the worker.

Sections arrive as plain dataclass objects (``OmegaConf.to_object``), not as OmegaConf nodes: a node keeps a
reference to its root, so pickling it to a Ray worker would carry every other section along.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Optional

#: a section of the run config a worker is built from: a dataclass object of the config schema (e.g. the ``critic``
#: section, a ``CriticConfig``), checked by :func:`expect_section`. The schema classes live in the config package, a
#: higher layer the workers never import, so annotations name the section in words with this alias.
ConfigSection = Any


@dataclass(frozen=True)
class ActorInputs:
    """Derived values of the actor(+rollout+reference) worker (besides ``actor_rollout_ref``).

    Args:
        seed: ``trainer.seed``: the models' init seed; the update's mini-batch shuffle uses seed + global step.
        total_training_steps: the run's training steps (sizes the lr schedule: one step per ``update_actor``).
        nonfinite_grad: ``trainer.nonfinite_grad``: ``skip`` or ``error`` on a NaN/inf gradient norm.
        max_prompt_length / max_response_length: ``data.max_prompt_length`` / ``data.max_response_length``
            (tokens; the rollout's response budget and its engine's model length).
        loss_scale_factor: the constant L of ``seq-mean-token-sum-norm``: ``actor.loss_scale_factor`` or
            ``data.max_response_length``.
        rollout_lora_adapters: the rollout (or the async generators) receives LoRA adapters rather than merged
            weights (:func:`hybridflow.trainer.worker_inputs.rollout_lora_adapters` of the run config).
        weight_sync_timeout_s: ``async_training.weight_sync_timeout_s`` (the weight push of role ``actor_ref``).
    """

    seed: int
    total_training_steps: int
    nonfinite_grad: str
    max_prompt_length: int
    max_response_length: int
    loss_scale_factor: float
    rollout_lora_adapters: bool
    weight_sync_timeout_s: float


@dataclass(frozen=True)
class CriticInputs:
    """Derived values of a critic worker (besides ``critic``).

    Args:
        seed: ``trainer.seed`` (the value head's init seed is seed + 1; the shuffle's seed + global step).
        total_training_steps: the run's training steps (the lr schedule).
        nonfinite_grad: ``trainer.nonfinite_grad``.
        rollout_n: ``actor_rollout_ref.rollout.n``: samples per prompt (mini-batches are counted in prompts).
        model: ``critic.model``; when its ``path`` is empty, with the actor's ``path`` (and its ``tokenizer_path`` and
            ``trust_remote_code`` where the critic sets none), every other key (``dtype``, ``use_remove_padding``,
            LoRA, gradient checkpointing) still the critic's own.
    """

    seed: int
    total_training_steps: int
    nonfinite_grad: str
    rollout_n: int
    model: ConfigSection  # the backbone's ``model`` section (ModelConfig)


@dataclass(frozen=True)
class GeneratorInputs:
    """Derived values of an async generator worker (besides ``actor_rollout_ref`` and ``async_training``).

    Args:
        max_prompt_length / max_response_length: as for :class:`ActorInputs`.
        rollout_lora_adapters: as for :class:`ActorInputs` (the trainer and the generators agree on the payload).
    """

    max_prompt_length: int
    max_response_length: int
    rollout_lora_adapters: bool


@dataclass(frozen=True)
class TokenizerSource:
    """The actor's tokenizer (responses are actor token ids): ``model.tokenizer_path or model.path`` and
    ``model.trust_remote_code`` of ``actor_rollout_ref``."""

    path: str
    trust_remote_code: bool


@dataclass(frozen=True)
class RuleRewardInputs:
    """Derived values of the rule-reward worker (besides ``reward_model``).

    Args:
        tokenizer: the actor's tokenizer (to decode responses).
        cost_rule: ``cost_model.rule``: the registered rule cost of Safe-RLHF, None when none is used.
    """

    tokenizer: TokenizerSource
    cost_rule: Optional[str]


@dataclass(frozen=True)
class ScoreModelInputs:
    """Derived values of a reward- or cost-model worker (besides its ``reward_model`` / ``cost_model`` section).

    Args:
        actor_tokenizer: the actor's tokenizer (the scorer's vocabulary must equal it).
    """

    actor_tokenizer: TokenizerSource


#: the top-level sections of the run config; a worker's section has none of them as a field
RUN_SECTIONS = ("data", "actor_rollout_ref", "critic", "reward_model", "algorithm", "trainer", "resource_pool",
                "layouts", "cost_model", "async_training")


def expect_section(value: Any, name: str, fields: Iterable[str]) -> Any:
    """``value`` if it is the config section ``name`` as a dataclass object with the given ``fields`` (what a worker
    constructor accepts; the schema class is not imported here, the config package being a higher layer).

    Raises:
        TypeError: ``value`` is an OmegaConf node (it would carry the whole run config), the whole run config or
            another section, or misses one of ``fields``; the message names the section and what was given.
    """
    given = type(value).__name__
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        raise TypeError(f"the {name} section must be a dataclass object (OmegaConf.to_object of the validated "
                        f"config's {name}; hybridflow.trainer.worker_inputs builds it), got {given}")
    others = [f.name for f in dataclasses.fields(value) if f.name in RUN_SECTIONS]
    missing = [f for f in fields if not hasattr(value, f)]
    if others or missing:
        what = f"fields {others} of the whole run config" if others else f"no field(s) {missing}"
        raise TypeError(f"expected the {name} section, got a {given} with {what}")
    return value


def expect(value: Any, kind: type, what: str) -> Any:
    """``value`` if it is a ``kind`` (a worker constructor's derived values).

    Raises:
        TypeError: ``value`` is of another type; the message names the argument and both types.
    """
    if not isinstance(value, kind):
        raise TypeError(f"{what} must be a {kind.__module__}.{kind.__qualname__} (hybridflow.trainer.worker_inputs "
                        f"builds it), got {type(value).__name__}")
    return value
