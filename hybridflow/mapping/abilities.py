"""What ``hybridflow train`` can run, as the auto-mapper sees it: the one table of engine and worker abilities.

``hybridflow plan`` must never recommend what ``train`` cannot run, so the search (``MappingSearch``) drops every
layout and placement these abilities rule out and says why (``SearchResult.excluded``, ``--json`` field
``search.excluded``). The same table checks a config's ``layouts`` section at load
(``hybridflow.config.layouts``).

Each training engine declares what its workers run as ``abilities=`` metadata of its registration
(:data:`hybridflow.training.ENGINES`; the built-ins in ``hybridflow/training/fsdp2_config.py`` and
``megatron_config.py``, each with the code it was read from); :data:`ENGINE_ABILITIES` is built from the registered
engines (a plugin engine that declares abilities is planned for like a built-in one). Today:

- ``fsdp2``: the actor trains with FSDP2 over dp and DTensor tensor parallelism over tp
  (``actor.tensor_model_parallel_size``), on every rank of its pool: pp = 1, tp x dp = the pool's ranks; the
  critic, the reward and cost models and the cost critic shard over all ranks of their pool (pp = 1, tp = 1); the
  actor, reference and critic may split each sequence over sp of their dp ranks (Ulysses,
  ``*.ulysses_sequence_parallel_size``; pp = tp = 1), never while generating
  (:mod:`hybridflow.mapping.sequence_parallel`); no expert parallelism (FSDP shards the experts like any weight);
- ``megatron``: the actor and the critic train on Megatron-core tp x pp x dp of their ``megatron`` sections (+ ep
  for an MoE model, ``expert_model_parallel_size``; :mod:`hybridflow.mapping.expert_parallel`); the reward and
  cost models and the cost critic run dp only; no Ulysses sp;
- with both, the actor generates with tp_g x dp_g on the same ranks (``rollout.tensor_model_parallel_size``; the
  3D-HybridEngine needs tp and tp_g to divide one another, which the search already requires): no pipeline; the
  reference runs inside the actor's process (``ActorRolloutRefWorker``) on the actor's training layout: it must be
  in the actor's set, with the actor's training layout.

Megatron-LM (``unrestricted``, the paper's system) runs any layout for every role.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridflow.mapping.cost import Layout
from hybridflow.mapping.specs import SpecError
from hybridflow.training import ENGINES

__all__ = ["ENGINE_ABILITIES", "Abilities", "UNRESTRICTED", "get_abilities"]


@dataclass(frozen=True)
class Abilities:
    """What a training system runs: limits on the layouts of each role and on where the reference may sit.

    Attributes:
        name: the engine (``fsdp2``) or ``unrestricted`` (any layout; the HybridFlow paper's Megatron-LM + vLLM).
        max_pp: largest pipeline-parallel size of training and forward passes (None: no limit).
        max_gen_pp: largest pipeline-parallel size of the actor's generation (None: no limit).
        tp_roles: roles that can run tensor parallel (None: every role).
        pp_roles: roles that can run pipeline parallel, up to ``max_pp`` (None: every role).
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
    pp_roles: frozenset[str] | None = None

    def layout_reason(self, role: str, layout: Layout, generate: bool = False) -> str | None:
        """Why ``role`` cannot run on ``layout`` (its generation layout with ``generate``), or None if it can."""
        limit = self.max_gen_pp if generate else self.max_pp
        if limit is not None and layout.pp > limit:
            what = "generation" if generate else "training and forward passes"
            return f"pp > {limit}: {self.name} has no pipeline parallelism for {what} (max_pp={limit})"
        if not generate and layout.pp > 1 and self.pp_roles is not None and role not in self.pp_roles:
            return f"pp > 1 for {role}: its {self.name} worker runs no pipeline parallelism (pp=1)"
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


def _from_registry() -> dict[str, Abilities]:
    """Engine name -> its :class:`Abilities`, for every registered engine that declares ``abilities`` (a dict of
    plain values: ints, bools and tuples of role names; the role sets become frozensets)."""
    out = {}
    for name in ENGINES.names():
        declared = ENGINES.meta(name, "abilities")
        if declared is not None:
            values = {k: frozenset(v) if isinstance(v, (tuple, list, set, frozenset)) else v
                      for k, v in declared.items()}
            out[name] = Abilities(name, **values)
    return out


#: the registered engines' abilities at import (``--engine`` choices; :func:`get_abilities` reads the registry
#: when called, so it also finds an engine registered later)
ENGINE_ABILITIES: dict[str, Abilities] = _from_registry()
UNRESTRICTED = Abilities("unrestricted")


def get_abilities(name: str) -> Abilities:
    """The abilities of engine ``name`` (a registered engine that declares them) or ``unrestricted``.

    Raises:
        SpecError: unknown name (or an engine that declares no abilities); the message lists the known ones.
    """
    if name == UNRESTRICTED.name:
        return UNRESTRICTED
    registered = _from_registry()  # also a plugin engine registered after this module was imported
    if name not in registered:
        raise SpecError(f"unknown engine {name!r}; known: {sorted(registered) + [UNRESTRICTED.name]}")
    return registered[name]
