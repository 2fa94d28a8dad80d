"""Rule rewards, looked up by a row's ``data_source``.

``register_reward(*data_sources)`` registers a scorer ``fn(solution_str, ground_truth, extra_info)
-> float`` for one or more data sources; ``default_compute_score`` dispatches to it (verl's name and
argument order). Built in: ``"openai/gsm8k"`` and ``"hybridflow/arith"`` -> GSM8K strict;
``MATH_DATA_SOURCES`` -> the MATH reward (last ``\\boxed{}``, equivalence through ``math-verify``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable

from hybridflow.errors import DataError
from hybridflow.rewards import gsm8k, math

RewardFn = Callable[[str, str, Any], float]
REWARD_REGISTRY: dict[str, RewardFn] = {}
MATH_DATA_SOURCES = ("DigitalLearningGmbH/MATH-lighteval", "lighteval/MATH", "HuggingFaceH4/MATH-500")


def register_reward(*data_sources: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register ``fn(solution_str, ground_truth, extra_info) -> float`` for data sources.

    Raises:
        ValueError: no data source given, or one is already registered.
    """
    if not data_sources:
        raise ValueError("register_reward needs at least one data_source")

    def decorator(fn: RewardFn) -> RewardFn:
        for source in data_sources:
            if source in REWARD_REGISTRY:
                raise ValueError(f"reward for data_source {source!r} is already registered")
            REWARD_REGISTRY[source] = fn
        return fn

    return decorator


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None
) -> float:
    """Score one decoded response with the reward registered for ``data_source``.

    Raises:
        ValueError: no reward is registered for ``data_source`` (the message lists the known ones).
    """
    return float(get_reward_fn(data_source)(solution_str, ground_truth, extra_info))


def get_reward_fn(data_source: str) -> RewardFn:
    """The scorer registered for ``data_source``.

    Raises:
        ValueError: none is registered (the message lists the known data sources).
    """
    try:
        return REWARD_REGISTRY[data_source]
    except KeyError:
        raise ValueError(
            f"no reward registered for data_source {data_source!r}; "
            f"known data sources: {sorted(REWARD_REGISTRY)}"
        ) from None


def check_data_sources(rows: Sequence[Mapping[str, Any]]) -> None:
    """Check, before anything is generated, that every row's ``data_source`` has a registered reward.

    Raises:
        DataError: the first row whose ``data_source`` has none (``error.row`` is its index; the message lists
            the known data sources).
    """
    checked: set[str] = set()
    for i, row in enumerate(rows):
        source = row.get("data_source")
        if source not in checked:
            try:
                get_reward_fn(source)
            except ValueError as exc:
                raise DataError(str(exc), row=i) from None
            checked.add(source)


@register_reward("openai/gsm8k", "hybridflow/arith")
def _gsm8k_strict(solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    return gsm8k.compute_score(solution_str, ground_truth, method="strict")


@register_reward(*MATH_DATA_SOURCES)
def _math_equiv(solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    return math.compute_score(solution_str, ground_truth)


__all__ = ["REWARD_REGISTRY", "MATH_DATA_SOURCES", "check_data_sources", "default_compute_score", "get_reward_fn",
           "register_reward", "gsm8k", "math"]
