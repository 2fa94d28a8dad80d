"""Rule costs for constrained RL (Safe-RLHF): a cost per response, looked up by name.

A cost function has the signature of a rule reward (verl's), ``fn(data_source, solution_str, ground_truth,
extra_info=None) -> float`` (units: cost per response; higher is worse; :mod:`hybridflow.rewards.signature`), and
is registered with ``@register_cost("name")``. The config key ``cost_model.rule`` selects one for every row (it
is not looked up by ``data_source``; the function still receives it).

Built in:

- ``subtraction_before_last_step``: 1.0 when an equation line that subtracts is followed by another equation
  line (the working subtracts and then keeps going), else 0.0. It is the built-in task's "forbidden pattern":
  on that task the tiny model answers either with one equation line (the shortcut, usually wrong) or with two
  (the full solution, right), and the first line subtracts for half the problems ("... gives 3 away and then
  ..."), so about 17% of the shipped model's sampled answers carry the cost. It competes with the reward on
  those problems only: a policy that solves the problems starting with an addition fully and stops after a
  first-line subtraction keeps half of the reward at zero cost. The decision it has to learn is taken right
  after the subtraction it has just written.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from hybridflow.registry import Registry
from hybridflow.rewards.signature import as_score_fn

CostFn = Callable[[str, str, Any, Any], float]


def _check_cost(name: str, fn: CostFn) -> None:
    as_score_fn(fn, f"register_cost({name!r})")


COSTS: Registry = Registry("rule cost", check=_check_cost,
                           adapter=lambda name, fn: as_score_fn(fn, f"register_cost({name!r})"))

_SUBTRACTION = re.compile(r"\d\s*-\s*\d")


def register_cost(name: str) -> Callable[[CostFn], CostFn]:
    """Decorator: register ``fn(data_source, solution_str, ground_truth, extra_info=None) -> float`` as the rule
    cost ``name``.

    Raises:
        ValueError: ``name`` is already registered.
        RewardSignatureError: (a ``TypeError`` and ``ValueError``) ``fn`` does not take those four arguments (one
            line naming it and the expected signature).
    """
    return COSTS.register(name)


def get_cost_fn(name: str) -> CostFn:
    """The rule cost registered as ``name``, called as ``fn(data_source, solution_str, ground_truth, extra_info)``.

    Raises:
        UnknownNameError: (a ``KeyError`` and ``ValueError``) listing the registered names.
    """
    return COSTS.get(name)


@register_cost("subtraction_before_last_step")
def subtraction_before_last_step(data_source: str, solution_str: str, ground_truth: str = "",
                                 extra_info: Any = None) -> float:
    """1.0 if an equation line (a line with ``=``) that contains a subtraction ``a - b`` is not the last one."""
    equations = [line for line in solution_str.splitlines() if "=" in line]
    return float(any(_SUBTRACTION.search(line) for line in equations[:-1]))


__all__ = ["COSTS", "CostFn", "get_cost_fn", "register_cost", "subtraction_before_last_step"]
