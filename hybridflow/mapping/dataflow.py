"""The RL dataflow of each algorithm as the cost model sees it: which role does what work, in which stage.

HybridFlow (Sheng et al. 2024, arXiv 2409.19256, §2.1 and §6) splits an iteration into three stages: generation
(the actor samples responses), preparation (one forward pass of each model that scores the sequences) and
training (the trained models update). Stages run one after the other; inside a stage, models on the same devices
take turns and models on different devices run at the same time.

What each algorithm runs is its registered :class:`~hybridflow.mapping.flows.Dataflow` (S = batch x n sampled
sequences, B = batch prompts): the actor generates S (and B greedy baseline responses with ``greedy_baseline``,
ReMax); the actor (old log-probs), the reference, the critic (with ``critic``: PPO, Safe-RLHF) and the reward forward
S (S + B with a greedy baseline), with ``cost_models`` (Safe-RLHF) the cost model and cost critic too; the actor, the
critic and the cost critic train on S.

A role without a model (a rule reward) does no device work; ``works`` leaves it out when its model is None.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.mapping.flows import dataflow_of
from hybridflow.mapping.specs import Workload

__all__ = ["STAGES", "VALUE_ROLES", "Work", "works"]

STAGES = ("generate", "prepare", "train")
#: roles whose model ends in a scalar head instead of the LM head
VALUE_ROLES = frozenset({"critic", "reward", "cost", "cost_critic"})


@dataclass(frozen=True)
class Work:
    """One model call of an iteration: ``role`` does ``kind`` (generate | infer | train) on ``sequences``
    sequences in ``stage``; ``greedy`` marks ReMax's baseline generation."""

    role: str
    kind: str
    stage: str
    sequences: int
    greedy: bool = False


def works(workload: Workload, roles_with_models: set[str] | frozenset[str] | None = None) -> tuple[Work, ...]:
    """The works of one iteration of ``workload.algorithm`` (its registered :class:`~hybridflow.mapping.flows.Dataflow`),
    restricted to ``roles_with_models`` when given."""
    s, b = workload.sequences, workload.batch
    flow = dataflow_of(workload.algorithm)
    out = [Work("actor", "generate", "generate", s)]
    if flow.greedy_baseline:
        out.append(Work("actor", "generate", "generate", b, greedy=True))
    if workload.actor_logprob:
        out.append(Work("actor", "infer", "prepare", s))
    out.append(Work("reference", "infer", "prepare", s))
    if flow.critic:
        out.append(Work("critic", "infer", "prepare", s))
    out.append(Work("reward", "infer", "prepare", s + b if flow.greedy_baseline else s))
    if flow.cost_models:
        out += [Work("cost", "infer", "prepare", s), Work("cost_critic", "infer", "prepare", s)]
    out.append(Work("actor", "train", "train", s))
    if flow.critic:
        out.append(Work("critic", "train", "train", s))
    if flow.cost_models:
        out.append(Work("cost_critic", "train", "train", s))
    if roles_with_models is not None:
        out = [w for w in out if w.role in roles_with_models]
    return tuple(out)
