"""The one calling convention of every reward (and rule cost) function: verl's
``fn(data_source, solution_str, ground_truth, extra_info=None) -> float``.

verl calls a custom reward function with keywords (``compute_score(data_source=..., solution_str=...,
ground_truth=..., extra_info=...)``); hybridflow does the same for a function that takes those names, and calls
positionally a function whose first four positional parameters carry other names (``fn(src, text, truth,
info=None)``). A function that fits neither, or whose parameters would receive another argument's value by
position (``fn(solution_str, ground_truth, extra_info, info=None)`` would get ``data_source`` in
``solution_str``), is refused when it is registered or loaded, in one line: a shifted call scores every sample 0
without an error.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from hybridflow.errors import UserError

ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")
SIGNATURE = "fn(data_source, solution_str, ground_truth, extra_info=None) -> float"
ScoreFn = Callable[[str, str, Any, Any], float]

__all__ = ["ARGUMENTS", "SIGNATURE", "RewardSignatureError", "as_score_fn"]


class RewardSignatureError(UserError, TypeError, ValueError):
    """A reward or cost function whose parameters do not take verl's four arguments; ``str(error)`` is one line
    naming the function, its signature and the expected one. A ``TypeError`` (a wrong kind of function) and a
    ``ValueError`` (a bad config value), so either ``except`` clause catches it."""


def _bound(sig: inspect.Signature, *args: Any, **kwargs: Any) -> dict[str, Any] | None:
    try:
        return dict(sig.bind(*args, **kwargs).arguments)
    except TypeError:
        return None


def as_score_fn(fn: Callable[..., Any], where: str) -> ScoreFn:
    """``fn`` as a callable taking ``(data_source, solution_str, ground_truth, extra_info)`` by position: ``fn``
    itself when it takes them in that order under those names (or under other names, positionally), else a
    wrapper (``functools.wraps``) that passes them by keyword. A callable whose signature cannot be read (some
    builtins) is taken as it is.

    Args:
        fn: the user's (or a built-in) scoring function.
        where: who asks, for the message (``"register_reward('my/source')"``, ``"reward_model.compute_score=..."``).

    Raises:
        RewardSignatureError: ``fn`` cannot take the four arguments by keyword, nor by position without one of its
            parameters named after another argument receiving a different one (one line).
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn
    by_keyword = _bound(sig, **{name: name for name in ARGUMENTS})
    by_position = _bound(sig, *ARGUMENTS)
    if by_keyword is not None:
        if by_keyword == by_position:  # the same call either way: no wrapper
            return fn

        @functools.wraps(fn)
        def by_name(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> Any:
            return fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                      extra_info=extra_info)

        return by_name
    if by_position is not None and not any(param in ARGUMENTS and value != param
                                           for param, value in by_position.items()):
        return fn
    name = getattr(fn, "__qualname__", None) or repr(fn)
    raise RewardSignatureError(f"{where}: {name}{sig} does not take verl's reward arguments; expected "
                               f"{SIGNATURE}, called as fn(data_source=..., solution_str=..., ground_truth=..., "
                               "extra_info=...)")
