"""The auto-mapper's registry of planned algorithms (``Workload.algorithm``): what one iteration of each runs, declared
as a :class:`Dataflow` (the roles, which models each stage runs, the advantage estimator a plan writes), so that no
code of the mapper decides on an algorithm's name.

A dataflow names the driver that runs it (``Dataflow.driver``, the ``algorithm.driver`` a plan writes); a user driver
that wants ``hybridflow plan`` registers its own dataflow with ``register_driver(..., dataflow={"name":
Dataflow(...)})`` (which fills in the driver) or here from its plugin module (:func:`register_dataflow`). The built-in
ones are registered below, so the mapper works without importing the drivers (it is the lower layer).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Optional

from hybridflow.registry import Registry

__all__ = ["DATAFLOWS", "Dataflow", "RolesByAlgorithm", "dataflow_of", "register_dataflow"]


@dataclass(frozen=True)
class Dataflow:
    """One iteration of an algorithm as the cost model sees it (S = batch x n sampled sequences, B = batch prompts).

    Every dataflow: the actor generates S, the actor (old log-probs), the reference and the reward forward S, the
    actor trains on S.

    Attributes:
        critic: a critic forwards S (values) and trains on S (PPO's GAE).
        greedy_baseline: the actor also generates B greedy responses, which the reward scores too (ReMax).
        cost_models: a cost model and a cost critic forward S, and the cost critic trains on S (Safe-RLHF).
        adv_estimator: the ``algorithm.adv_estimator`` a plan writes for it; None: the user chooses.
        driver: the ``algorithm.driver`` a plan writes for it (a registered driver's name); None: the user chooses.
    """

    critic: bool = False
    greedy_baseline: bool = False
    cost_models: bool = False
    adv_estimator: Optional[str] = None
    driver: Optional[str] = None

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles whose models one iteration runs, in the order the cost model reports them."""
        return (("actor",) + (("critic",) if self.critic else ()) + ("reference", "reward")
                + (("cost", "cost_critic") if self.cost_models else ()))


def _check_dataflow(name: str, obj: object) -> None:
    if not isinstance(obj, Dataflow):
        raise TypeError(f"dataflow {name!r} must be a hybridflow.mapping.flows.Dataflow, got {obj!r}")


DATAFLOWS: Registry = Registry("planned algorithm", check=_check_dataflow)


def register_dataflow(name: str, flow: Dataflow) -> Dataflow:
    """Register ``flow`` as the planned algorithm ``name`` (``Workload.algorithm``, ``hybridflow plan --algorithm``).

    Raises:
        TypeError: ``flow`` is not a :class:`Dataflow`.
        ValueError: ``name`` is taken by a different dataflow.
    """
    return DATAFLOWS.register(name)(flow)


def dataflow_of(name: str) -> Dataflow:
    """The dataflow registered as ``name``.

    Raises:
        UnknownNameError: no such planned algorithm (the message lists the known ones and the nearest).
    """
    return DATAFLOWS.get(name)


class RolesByAlgorithm(Mapping):
    """A read-only view: planned algorithm name -> the roles of its dataflow (the registry's current entries)."""

    def __getitem__(self, name: str) -> tuple[str, ...]:
        if name not in DATAFLOWS:
            raise KeyError(name)
        return DATAFLOWS.get(name).roles

    def __iter__(self) -> Iterator[str]:
        return iter(DATAFLOWS.names())

    def __len__(self) -> int:
        return len(DATAFLOWS)


register_dataflow("ppo", Dataflow(critic=True, adv_estimator="gae", driver="ppo"))
# as PPO without a critic; n responses per prompt
register_dataflow("grpo", Dataflow(adv_estimator="grpo", driver="ppo"))
register_dataflow("remax", Dataflow(greedy_baseline=True, adv_estimator="remax", driver="remax"))  # Li et al. 2023
# Dai et al. 2023: its estimator is the driver's choice (reward and cost GAE)
register_dataflow("safe-rlhf", Dataflow(critic=True, cost_models=True, driver="safe_rlhf"))
