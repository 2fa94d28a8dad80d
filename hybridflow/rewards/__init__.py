"""Rule rewards, looked up by a row's ``data_source``.

``register_reward(*data_sources)`` registers a scorer with verl's reward signature ``fn(data_source,
solution_str, ground_truth, extra_info=None) -> float`` (:mod:`hybridflow.rewards.signature`; the same as a
``reward_model.compute_score`` function) for one or more data sources; ``default_compute_score`` dispatches to it
(verl's name and argument order). Built in: ``"openai/gsm8k"``, ``"hybridflow/arith"`` and
``"hybridflow/vlm_count"`` -> GSM8K strict; ``MATH_DATA_SOURCES`` and ``"hiyouga/geometry3k"`` -> the MATH reward
(last ``\\boxed{}``, equivalence through ``math-verify``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import importlib
import importlib.util
import os
from typing import Any, Callable, Optional

from hybridflow.errors import DataError
from hybridflow.registry import Registry
from hybridflow.rewards import gsm8k, math, tool_arith
from hybridflow.rewards.signature import SIGNATURE, RewardSignatureError, as_score_fn

# verl's reward function, registered or configured: fn(data_source, solution_str, ground_truth, extra_info=None)
RewardFn = Callable[[str, str, Any, Any], float]
ComputeScoreFn = RewardFn
AnswerFn = Callable[[str], Optional[str]]  # a response's final answer, canonical, or None
MATH_DATA_SOURCES = ("DigitalLearningGmbH/MATH-lighteval", "lighteval/MATH", "HuggingFaceH4/MATH-500")


def _check_reward(source: str, fn: RewardFn) -> None:
    as_score_fn(fn, f"reward for data_source {source!r}")


REWARDS: Registry = Registry("reward", missing="no reward registered for data_source {name!r}", check=_check_reward,
                             adapter=lambda source, fn: as_score_fn(fn, f"reward for data_source {source!r}"))
REWARD_REGISTRY = REWARDS  # the former name (it was a dict; the Registry keeps ``pop`` and ``in``)


def register_reward(*data_sources: str, extract_answer: Optional[AnswerFn] = None,
                    self_timed: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register ``fn(data_source, solution_str, ground_truth, extra_info=None) -> float`` (verl's
    signature, as ``reward_model.compute_score``) for data sources; returns ``fn`` unchanged.

    A data source has one scorer: registering one that is taken raises, even with the same function (two modules
    claiming one data source is a mistake worth a clear error). ``extract_answer(solution_str) -> str | None``, when
    given, returns the final answer a response gives, in a canonical form two responses can be compared by (the
    majority vote of validation's ``maj@n``; :func:`extract_answer`). ``self_timed=True`` declares a scorer that
    bounds its own time (the MATH reward's per-parse limit, which needs the calling thread): scoring then calls it
    directly instead of under ``reward_model.timeout_s`` (:func:`hybridflow.rewards.batch.score_batch`).

    Raises:
        ValueError: no data source given, or one is already registered.
        RewardSignatureError: (a ``TypeError``, ``ValueError`` and ``UserError``) ``fn`` does not take verl's four
            arguments (:func:`hybridflow.rewards.signature.as_score_fn`); one line naming it and the expected
            signature, before anything is registered.
    """
    if not data_sources:
        raise ValueError("register_reward needs at least one data_source")

    def decorator(fn: RewardFn) -> RewardFn:
        as_score_fn(fn, f"register_reward({', '.join(map(repr, data_sources))})")
        for source in data_sources:
            if source in REWARDS:
                raise ValueError(f"reward for data_source {source!r} is already registered")
            REWARDS.register(source, extract_answer=extract_answer, self_timed=self_timed)(fn)
        return fn

    return decorator


def extract_answer(data_source: str, solution_str: str) -> Optional[str]:
    """The final answer of a decoded response as the reward registered for ``data_source`` reads it (its
    ``extract_answer``), or None: no answer in the response, no reward for the data source, or a reward that
    declares no extractor (a user's ``reward_model.compute_score`` is a black box: its rows vote only when their
    data source has a registered extractor)."""
    if data_source not in REWARDS:
        return None
    fn = REWARDS.meta(data_source, "extract_answer")
    return None if fn is None else fn(solution_str)


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None
) -> float:
    """Score one decoded response with the reward registered for ``data_source``.

    Raises:
        UnknownNameError: (a ``ValueError``) no reward is registered for ``data_source`` (the message lists the
            known ones).
    """
    return float(get_reward_fn(data_source)(data_source, solution_str, ground_truth, extra_info))


def get_reward_fn(data_source: str) -> RewardFn:
    """The scorer registered for ``data_source``, called as ``fn(data_source, solution_str, ground_truth,
    extra_info)`` by position (a function that takes verl's arguments by keyword only comes wrapped).

    Raises:
        UnknownNameError: (a ``ValueError`` and ``KeyError``) none is registered (the message lists the known data
            sources and the nearest).
    """
    return REWARDS.get(data_source)


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


def split_compute_score(spec: str) -> tuple[str, str, bool]:
    """``"target:name"`` -> ``(target, name, target is a file path)``; ``name`` defaults to ``compute_score``."""
    target, colon, name = spec.rpartition(":")
    if not colon:
        target, name = spec, ""
    return target, name or "compute_score", target.endswith(".py") or os.sep in target


def load_compute_score(spec: str) -> ComputeScoreFn:
    """The scoring function named by ``reward_model.compute_score``.

    ``default`` is :func:`default_compute_score` (the reward registered for each row's ``data_source``). Anything
    else names a user function with verl's custom-reward signature ``fn(data_source, solution_str, ground_truth,
    extra_info=None) -> float``: ``path/to/file.py:name`` (the file is imported by path, like verl's
    ``custom_reward_function.path`` / ``.name``) or ``package.module:name`` (importable on every node); without
    ``:name`` the function is ``compute_score``.

    The function is returned as :func:`hybridflow.rewards.signature.as_score_fn` gives it (called by position).

    Raises:
        ValueError: the file or module cannot be imported, or it has no callable of that name.
        RewardSignatureError: (a ``ValueError``) the function does not take verl's four arguments (one line).
    """
    if spec == "default":
        return default_compute_score
    target, name, is_file = split_compute_score(spec)
    where = f"reward_model.compute_score={spec!r}"
    if is_file:
        if not os.path.isfile(target):
            raise ValueError(f"{where}: no such file {target!r} (expected path/to/file.py:function)")
        module_spec = importlib.util.spec_from_file_location(f"hybridflow_user_reward_{abs(hash(target))}", target)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:
            raise ValueError(f"{where}: importing {target} failed: {type(exc).__name__}: {exc}") from exc
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ValueError(f"{where}: cannot import module {target!r}: {exc} (expected package.module:function "
                             "or path/to/file.py:function)") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{where}: {target} has no function {name!r}")
    return as_score_fn(fn, where)


def _number_answer(solution_str: str) -> Optional[str]:
    """GSM8K strict extraction (the number after the last ``####``), as a plain decimal: ``"$1,000.50"`` ->
    ``"1000.5"``; a non-number as written."""
    answer = gsm8k.extract_solution(solution_str, method="strict")
    if answer is None:
        return None
    value = gsm8k.normalize_number(answer)
    return answer.strip() if value is None else format(value.normalize(), "f")


def _boxed_answer(solution_str: str) -> Optional[str]:
    """The last ``\\boxed{}`` of the response without whitespace (no mathematical normalisation)."""
    answer = math.extract_boxed_answer(solution_str)
    return None if answer is None else "".join(answer.split())


@register_reward("openai/gsm8k", "hybridflow/arith", "hybridflow/vlm_count", extract_answer=_number_answer)
def _gsm8k_strict(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    return gsm8k.compute_score(solution_str, ground_truth, method="strict")


@register_reward("hybridflow/tool_arith", extract_answer=_number_answer)
def _tool_arith(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    return tool_arith.compute_score(solution_str, ground_truth, extra_info)


# self_timed: PARSE_TIMEOUT_S per parse
@register_reward(*MATH_DATA_SOURCES, "hiyouga/geometry3k", extract_answer=_boxed_answer, self_timed=True)
def _math_equiv(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    return math.compute_score(solution_str, ground_truth)


__all__ = ["REWARDS", "REWARD_REGISTRY", "MATH_DATA_SOURCES", "SIGNATURE", "RewardSignatureError", "check_data_sources",
           "default_compute_score", "extract_answer", "get_reward_fn", "load_compute_score", "register_reward",
           "gsm8k", "math", "tool_arith"]
