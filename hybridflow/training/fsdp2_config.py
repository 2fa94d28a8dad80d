"""The ``fsdp2`` engine's registration: its config sub-section ``fsdp_config`` of the actor and the critic
(declared here, ``config=FSDPEngineConfig``), its load checks, what the auto-mapper may plan for it, and its other
metadata. The engine itself (:mod:`hybridflow.training.fsdp2`, torch.distributed and the model code) is imported by
the first ``get_engine_class("fsdp2")``; this module imports neither torch nor Ray, like
:mod:`hybridflow.rollout.vllm_config` for the vllm backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from hybridflow.training.engine_registry import ENGINES

__all__ = ["FSDPConfig", "FSDPEngineConfig", "fsdp_config_problems"]

Get = Callable[[str], Any]


@dataclass
class FSDPConfig:
    # actor: while generating (hf rollout's 3D-HybridEngine); critic: between its calls. A no-op on CPU
    param_offload: bool = False  # keep params (and grads) on host memory between phases
    optimizer_offload: bool = False  # keep optimizer state on host memory between phases
    # free each unit's gathered weights after its forward (true: ZeRO-3) or keep them to the backward (false: one
    # all-gather less per unit and micro-batch; a frozen reference keeps them); auto: false for a model whose
    # weights take <= 1/16 of a rank's memory, without param_offload or LoRA (false is refused with LoRA)
    reshard_after_forward: str = "auto"
    # the group a parameter is sharded over (verl's key): -1 = every dp rank (FSDP2), 1 = none (each rank holds the
    # whole model, gradients averaged once per optimizer step: no gathers per micro-batch); auto: 1 when weights,
    # gradients and AdamW state take <= 1/16 of a rank's memory, without param_offload, LoRA or tp
    fsdp_size: Any = "auto"


@dataclass
class FSDPEngineConfig:
    # the sub-section the fsdp2 engine reads, in actor_rollout_ref.actor and critic (the reference runs with the
    # actor's)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)  # strategy=fsdp2: sharding and host offload


def _fsdp_size_problems(get: Get) -> list[str]:
    problems = []
    for section in ("actor_rollout_ref.actor", "critic"):
        raw = get(f"{section}.fsdp_config.fsdp_size")
        value = str(raw).lower()
        if value not in ("auto", "-1", "1"):
            hybrid = " (sharding over groups of that many ranks, hybrid sharding, is not implemented)"
            problems.append(f"{section}.fsdp_config.fsdp_size must be auto, -1 (shard over every dp rank) or 1 "
                            f"(replicate), got {raw!r}{hybrid if value.isdigit() else ''}")
    tp = get("actor_rollout_ref.actor.tensor_model_parallel_size")
    if str(get("actor_rollout_ref.actor.fsdp_config.fsdp_size")) == "1" and tp > 1:
        problems.append(f"actor_rollout_ref.actor.fsdp_config.fsdp_size=1 (replicated) is not supported with "
                        f"actor_rollout_ref.actor.tensor_model_parallel_size={tp}: use -1 or auto")
    return problems


def _lora_problems(get: Get) -> list[str]:
    """``reshard_after_forward=false`` of a trained role with LoRA adapters whose engine reads ``fsdp_config``
    (refused by the engine, :func:`hybridflow.distributed.fsdp.resolve_reshard_after_forward`)."""
    from hybridflow.algorithms import need_critic_for  # here: the estimators import torch

    roles = [("actor_rollout_ref.model", "actor_rollout_ref.actor")]
    if need_critic_for(get("critic.enable"), get("algorithm.adv_estimator")):
        roles.append(("critic.model", "critic"))
    problems = []
    for model, trainer in roles:
        lora = (get(f"{model}.lora_rank") or 0) > 0
        if lora and str(get(f"{trainer}.fsdp_config.reshard_after_forward")).lower() == "false" and \
                ENGINES.declared(get(f"{trainer}.strategy"), "config") is FSDPEngineConfig:
            problems.append(f"{trainer}.fsdp_config.reshard_after_forward=false is not supported with LoRA "
                            f"adapters ({model}.lora_rank > 0): use auto or true")
    return problems


def fsdp_config_problems(get: Get) -> list[str]:
    """Load checks of the ``fsdp_config`` keys (``get(dotted key) -> value``), one line each: ``fsdp_size`` is
    ``auto``, ``-1`` (shard over every dp rank) or ``1`` (replicate; not with the actor's DTensor tp; hybrid sharding
    is not implemented); ``reshard_after_forward=false`` is refused with LoRA adapters under an engine that reads
    ``fsdp_config``."""
    return _fsdp_size_problems(get) + _lora_problems(get)


# fsdp2 (hybridflow/workers + distributed/fsdp.py): FSDP2 over dp x DTensor tp for the actor only (the critic, the
# reward and cost models shard over dp), no pipeline anywhere, the reference inside the actor's process on its
# training mesh, Ulysses sp for the actor, reference and critic, no expert parallelism (FSDP shards the experts)
ABILITIES = {"max_pp": 1, "max_gen_pp": 1, "tp_roles": ("actor", "reference"), "reference_with_actor": True,
             "sp_roles": ("actor", "reference", "critic"), "ep_roles": ()}

ENGINES.register_lazy("fsdp2", "hybridflow.training.fsdp2:FSDP2Engine", config=FSDPEngineConfig,
                      config_checks=fsdp_config_problems, abilities=ABILITIES, pipeline_parallel=False,
                      sequence_parallel=True, router_replay=("rollout", "recompute"))
