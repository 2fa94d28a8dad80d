"""The common base of :class:`~hybridflow.workers.ppo_actor.PPOActor` and
:class:`~hybridflow.workers.ppo_critic.PPOCritic`: one model's computations on one dp rank over its training engine
(:class:`hybridflow.training.TrainEngine`), built from an engine or from a bare module."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from hybridflow.training import FSDP2Engine, TrainEngine


class EngineModel:
    """A model behind its training engine.

    Args:
        engine: the model's training engine, or a module (possibly FSDP2-sharded), which is wrapped in an ``fsdp2``
            engine of kind :attr:`KIND` with ``optimizer``, ``config.grad_clip`` and ``nonfinite_grad``.
        optimizer: with a module, the optimizer over its parameters (None for a frozen model); must be None with an
            engine (the engine owns its optimizer).
        config: the role's config section (``actor_rollout_ref.actor`` or ``critic``).
        nonfinite_grad: (with a module) ``skip`` drops an optimizer step whose gradient norm is NaN/inf (counted in
            :attr:`skipped_steps`); ``error`` raises ``FloatingPointError`` instead.
        use_remove_padding: (with a module) padding-free forwards (:mod:`hybridflow.training.packing`); an engine
            carries it in its spec.

    Raises:
        ValueError: an optimizer given with an engine.
    """

    KIND = "policy"  # the engine kind a wrapped module gets (``policy`` | ``value``)
    ROLE = "actor"  # the role name in the engine's messages

    def __init__(self, engine: Union[TrainEngine, torch.nn.Module], optimizer: Optional[torch.optim.Optimizer],
                 config: Any, nonfinite_grad: str = "skip", use_remove_padding: bool = False) -> None:
        if isinstance(engine, torch.nn.Module):
            engine = FSDP2Engine.from_module(engine, optimizer, kind=self.KIND, grad_clip=config.grad_clip,
                                             nonfinite_grad=nonfinite_grad, role=self.ROLE,
                                             remove_padding=use_remove_padding)
        elif optimizer is not None:
            raise ValueError(f"{type(self).__name__}: pass the optimizer with a module; an engine owns its optimizer")
        self.engine = engine
        self.config = config

    @property
    def module(self) -> torch.nn.Module:
        """The engine's model (FSDP2-sharded, possibly peft-wrapped)."""
        return self.engine.module

    @property
    def optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The engine's optimizer (None for a frozen model)."""
        return self.engine.optimizer

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps the non-finite guard dropped (the engine's count)."""
        return self.engine.skipped_steps


def compute_dtypes(**models: Optional[EngineModel]) -> dict[str, str]:
    """``{name: "float32" | "bfloat16" | ...}``: the dtype each given model's forwards compute in (its engine's
    ``compute_dtype``, what ``dtype=auto`` chose), leaving out absent models and engines that do not record one."""
    names = {}
    for name, model in models.items():
        dtype = getattr(getattr(model, "engine", None), "compute_dtype", None)
        if dtype is not None:
            names[name] = str(dtype).removeprefix("torch.")
    return names
