"""What ``hybridflow train`` can run, as the auto-mapper sees it: the one table of engine and worker abilities.

``hybridflow plan`` must never recommend what ``train`` cannot run, so the search (``MappingSearch``) drops every
layout and placement these abilities rule out and says why (``SearchResult.excluded``, ``--json`` field
``search.excluded``). The same table checks a config's ``layouts`` section at load
(``hybridflow.config.layouts``).

What hybridflow's workers run today (``hybridflow/workers``):

- the actor trains with FSDP2 over dp and DTensor tensor parallelism over tp
  (``actor.tensor_model_parallel_size``), on every rank of its pool: pp = 1, tp x dp = the pool's ranks;
- the actor generates with tp_g x dp_g on the same ranks (``rollout.tensor_model_parallel_size``; the
  3D-HybridEngine needs tp and tp_g to divide one another, which the search already requires): no pipeline;
- the reference runs inside the actor's process (``ActorRolloutRefWorker``) on the actor's training mesh: it
  must be in the actor's set, with the actor's training layout;
- the critic, the reward and cost models and the cost critic shard with FSDP2 over all ranks of their pool:
  pp = 1, tp = 1;
- the actor, reference and critic may split each sequence over sp of their dp ranks (Ulysses,
  ``*.ulysses_sequence_parallel_size``; pp = tp = 1), never while generating
  (:mod:`hybridflow.mapping.sequence_parallel`);
- no role runs expert parallelism on fsdp2 (``ep_roles`` empty): an MoE model's experts shard with FSDP like any
  weight. Megatron-LM (``unrestricted``, the paper's system) runs it for every role
  (``expert_model_parallel_size``; :mod:`hybridflow.mapping.expert_parallel`).

TODO(merge): hybridflow/training (the TrainEngine registry) will carry each engine's abilities as registry
metadata (e.g. ``max_pp=1`` for fsdp2); ``ENGINE_ABILITIES`` below is the stand-in until then, and the only
place that states them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridflow.mapping.cost import Layout
from hybridflow.mapping.specs import SpecError

__all__ = ["ENGINE_ABILITIES", "Abilities", "UNRESTRICTED", "get_abilities"]


@dataclass(frozen=True)
class Abilities:
    """What a training system runs: limits on the layouts of each role and on where the reference may sit.

    Attributes:
        name: the engine (``fsdp2``) or ``unrestricted`` (any layout; the HybridFlow paper's Megatron-LM + vLLM).
        max_pp: largest pipeline-parallel size of training and forward passes (None: no limit).
        max_gen_pp: largest pipeline-parallel size of the actor's generation (None: no limit).
        tp_roles: roles that can run tensor parallel (None: every role).
        reference_with_actor: the reference runs in the actor's process, so it must share the actor's set and
            training layout.
        sp_roles: roles that can split sequences with Ulysses sequence parallelism (``Layout.sp > 1``) in training
            and forward passes, never in generation, with pp = tp = 1 (empty: none).
        ep_roles: roles whose MoE experts can be split over ``Layout.ep`` data ranks (expert parallelism) in
            training and forward passes (None: every role; empty: none).
    """

    name: str
    max_pp: int | None = None
    max_gen_pp: int | None = None
    tp_roles: frozenset[str] | None = None
    reference_with_actor: bool = False
    sp_roles: frozenset[str] = frozenset()
    ep_roles: frozenset[str] | None = None

    def layout_reason(self, role: str, layout: Layout, generate: bool = False) -> str | None:
        """Why ``role`` cannot run on ``layout`` (its generation layout with ``generate``), or None if it can."""
        limit = self.max_gen_pp if generate else self.max_pp
        if limit is not None and layout.pp > limit:
            what = "generation" if generate else "training and forward passes"
            return f"pp > {limit}: {self.name} has no pipeline parallelism for {what} (max_pp={limit})"
        if not generate and layout.tp > 1 and self.tp_roles is not None and role not in self.tp_roles:
            return f"tp > 1 for {role}: its {self.name} worker shards over data parallelism only (tp=1)"
        return self.sp_reason(role, layout, generate) or self.ep_reason(role, layout, generate)

    def ep_reason(self, role: str, layout: Layout, generate: bool = False) -> str | None:
        """Why ``role`` cannot split its experts over ``layout.ep`` ranks, or None if it can (or ``ep == 1``)."""
        if layout.ep == 1:
            return None
        if generate or (self.ep_roles is not None and role not in self.ep_roles):
            return f"ep > 1 for {role}{' generation' if generate else ''}: {self.name} has no expert parallelism there"
        if layout.dp % layout.ep or layout.sp > 1:
            return f"ep={layout.ep} needs ep dividing dp and sp = 1, got {layout}"
        return None

    def sp_reason(self, role: str, layout: Layout, generate: bool = False) -> str | None:
        """Why ``role`` cannot split sequences over ``layout.sp`` ranks, or None if it can (or ``sp == 1``)."""
        if layout.sp == 1:
            return None
        if generate or role not in self.sp_roles:
            return f"sp > 1 for {role}{' generation' if generate else ''}: {self.name} has no sequence parallelism there"
        if layout.tp > 1 or layout.pp > 1 or layout.dp % layout.sp:
            return f"sp={layout.sp} needs pp = tp = 1 and sp dividing dp ({self.name}), got {layout}"
        return None

    def placement_reason(self, placement: Sequence[Sequence[str]]) -> str | None:
        """Why ``placement`` (sets of roles) cannot run, or None if it can."""
        if self.reference_with_actor:
            for s in placement:
                if "reference" in s and "actor" not in s:
                    return ("reference apart from the actor: it runs inside the actor's process "
                            "(ActorRolloutRefWorker), on the actor's devices")
        return None


# fsdp2 (hybridflow/workers + distributed/fsdp.py): FSDP2 x DTensor tp for the actor only, no pipeline anywhere,
# the reference inside the actor's process. Values from the workers' code (see the module docstring).
ENGINE_ABILITIES: dict[str, Abilities] = {
    "fsdp2": Abilities("fsdp2", max_pp=1, max_gen_pp=1, tp_roles=frozenset({"actor", "reference"}),
                       reference_with_actor=True, sp_roles=frozenset({"actor", "reference", "critic"}),
                       ep_roles=frozenset()),
}
UNRESTRICTED = Abilities("unrestricted")


def get_abilities(name: str) -> Abilities:
    """The abilities of engine ``name`` (a key of ``ENGINE_ABILITIES``) or ``unrestricted``.

    Raises:
        SpecError: unknown name; the message lists the known ones.
    """
    if name == UNRESTRICTED.name:
        return UNRESTRICTED
    if name not in ENGINE_ABILITIES:
        raise SpecError(f"unknown engine {name!r}; known: {sorted(ENGINE_ABILITIES) + [UNRESTRICTED.name]}")
    return ENGINE_ABILITIES[name]
