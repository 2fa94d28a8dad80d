"""The ``megatron`` engine's registration: its config sub-section ``megatron`` of the actor, the reference and the
critic (declared here, ``config=MegatronEngineConfig``), its own load checks, what the auto-mapper may plan for it,
and its other metadata. The engine (:mod:`hybridflow.training.megatron`, megatron-core) is imported by the first
``get_engine_class("megatron")``; this module imports neither torch, megatron-core nor Ray.

The checks of a role's layout against its pool (tp x pp dividing the ranks, the reference on the actor's layout,
no VLM) are made for every engine that reads a layout section, from the registrations' ``layout_section``
(:mod:`hybridflow.config.megatron_checks`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from hybridflow.training.engine_registry import ENGINES

__all__ = ["MEGATRON_SECTIONS", "MegatronConfig", "MegatronEngineConfig", "context_parallel_problems"]

#: the role sections that hold a ``megatron`` sub-section (the reference's must equal the actor's, or stay 1s)
MEGATRON_SECTIONS = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")


@dataclass
class MegatronConfig:
    # strategy=megatron (Megatron-core; pip install -e ".[megatron]"): tp x pp must divide the role's ranks, dp =
    # ranks / (tp * pp). The actor and its reference share one process, so they share one (tp, pp)
    tensor_model_parallel_size: int = 1  # Megatron tensor parallel size (heads, MLP and vocabulary split)
    pipeline_model_parallel_size: int = 1  # Megatron pipeline stages (layers split evenly; 1F1B schedule)
    # Megatron context parallelism: must stay 1 (megatron-core 0.16.1 runs it only in TransformerEngine's attention;
    # long sequences: ulysses_sequence_parallel_size with strategy=fsdp2)
    context_parallel_size: int = 1
    # Megatron expert parallelism of a mixture-of-experts model (Qwen3-MoE / Qwen2-MoE / Mixtral): each layer's
    # experts split over ep ranks (all-to-all token dispatch); must divide dp * tp and the number of experts
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1  # tp inside each expert; only 1 (experts whole on their EP rank)


@dataclass
class MegatronEngineConfig:
    # the sub-section the megatron engine reads, in actor_rollout_ref.actor, actor_rollout_ref.ref (which must equal
    # the actor's or stay 1s) and critic
    megatron: MegatronConfig = field(default_factory=MegatronConfig)  # the layout of strategy=megatron


def context_parallel_problems(get: Callable[[str], Any]) -> list[str]:
    """``*.megatron.context_parallel_size`` > 1 is refused (``get(dotted key) -> value``; one line per section):
    megatron-core 0.16.1's own attention (``DotProductAttention``, the one without TransformerEngine) asserts
    ``context_parallel_size == 1``, and TransformerEngine has no CPU build (measured:
    docs/how-to/long-sequences.md)."""
    problems = []
    for section in MEGATRON_SECTIONS:
        size = get(f"{section}.megatron.context_parallel_size")
        if size != 1:
            problems.append(f"{section}.megatron.context_parallel_size={size}: Megatron context parallelism needs "
                            "TransformerEngine (not supported); use strategy=fsdp2 with ulysses_sequence_parallel_size")
    return problems


# megatron (hybridflow/workers + training/megatron*.py): the actor and the critic train on Megatron-core tp x pp x dp
# of their own ``megatron`` sections (+ ep for an MoE model; engine_layout), the reference runs in the actor's
# process on the actor's layout; the actor generates with the hf/vLLM rollout after the 3D-HybridEngine's reshard
# (tp_g x dp_g: no pipeline, engine/plan.py); the reward and cost models are built over dp only (rm_worker); no
# Ulysses sp (config/sp_checks.py refuses it without sequence_parallel)
ABILITIES = {"max_gen_pp": 1, "tp_roles": ("actor", "reference", "critic"),
             "pp_roles": ("actor", "reference", "critic"), "reference_with_actor": True, "sp_roles": (),
             "ep_roles": ("actor", "reference", "critic")}

# process_wide_state: megatron-core keeps its parallel state (and its RNG tracker) per process, so two megatron
# engines of colocated roles would share one layout and seed (the trainer keeps such roles in separate processes);
# layout_section: a role's (tp, pp) come from its ``megatron`` sub-section (hybridflow.training.engine_layout)
ENGINES.register_lazy("megatron", "hybridflow.training.megatron:MegatronEngine", config=MegatronEngineConfig,
                      config_section=MEGATRON_SECTIONS, config_checks=context_parallel_problems,
                      abilities=ABILITIES, pipeline_parallel=True, process_wide_state=True,
                      layout_section="megatron", router_replay=("rollout",), requires_package="megatron.core",
                      install_hint='megatron-core: pip install -e ".[megatron]"')
