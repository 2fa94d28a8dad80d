"""MATH rule reward: the last ``\\boxed{...}`` of a response, compared with the ground truth by mathematical
equivalence (Hendrycks et al. 2021, "Measuring Mathematical Problem Solving With the MATH Dataset").

Extraction: the last ``\\boxed{...}`` or ``\\fbox{...}`` in the text, with nested braces
(``\\boxed{\\frac{1}{2}}`` -> ``\\frac{1}{2}``); also the brace-less form ``\\boxed 5``.

Equivalence: both sides are parsed from LaTeX to SymPy by the ``math-verify`` package and compared with its
``verify`` (numbers, fractions vs decimals, radicals, intervals with their open/closed ends, tuples, sets,
matrices, equations, ``\\text{...}`` answers as symbols). A ground truth that ``math-verify`` cannot parse never
scores ``score``: there is no fallback to string equality.

Parsing and comparison are time-limited (``PARSE_TIMEOUT_S``) through ``signal.alarm`` when called from the
main thread; in other threads ``math-verify`` cannot use signals and runs without a time limit.
"""

from __future__ import annotations

import functools
import re
import threading
from typing import Optional

PARSE_TIMEOUT_S = 5  # seconds per parse / per comparison (main thread only)
_BOX_COMMANDS = ("\\boxed", "\\fbox")
_BOX_START = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")

__all__ = ["last_boxed_only_string", "remove_boxed", "extract_boxed_answer", "is_equiv", "compute_score"]


def last_boxed_only_string(string: str) -> Optional[str]:
    """The last ``\\boxed{...}`` / ``\\fbox{...}`` (braces balanced) or ``\\boxed X`` in ``string``, or None.

    Returns the command with its argument, e.g. ``"\\boxed{\\frac{1}{2}}"``. An opening brace that is never
    closed is not a box. A box nested inside another box's argument is part of the outer one.
    """
    found = None
    pos = 0
    while True:
        match = _BOX_START.search(string, pos)
        if match is None:
            return found
        box = _box_at(string, match.start(), match.end())
        if box is not None:
            found = box
            pos = match.start() + len(box)
        else:
            pos = match.end()


def _box_at(string: str, start: int, after_command: int) -> Optional[str]:
    """The box starting at ``start`` whose command ends at ``after_command``, or None if malformed."""
    i = after_command
    if i < len(string) and string[i] == "{":
        depth = 0
        for j in range(i, len(string)):
            if string[j] == "{":
                depth += 1
            elif string[j] == "}":
                depth -= 1
                if depth == 0:
                    return string[start : j + 1]
        return None
    if i < len(string) and string[i] == " ":  # "\boxed 5": the argument runs to the next space or "$"
        arg = re.match(r" +([^\s$]+)", string[i:])
        return string[start : i + arg.end()] if arg else None
    return None


def remove_boxed(s: str) -> str:
    """The argument of a box from :func:`last_boxed_only_string`: ``"\\boxed{x}"`` -> ``"x"``,
    ``"\\boxed 5"`` -> ``"5"``.

    Raises:
        ValueError: ``s`` is not a single ``\\boxed{...}``, ``\\fbox{...}`` or ``\\boxed X``.
    """
    for command in _BOX_COMMANDS:
        if s.startswith(command + "{") and s.endswith("}"):
            return s[len(command) + 1 : -1]
        if s.startswith(command + " "):
            return s[len(command) :].strip()
    raise ValueError(f"not a boxed expression: {s[:80]!r}")


def extract_boxed_answer(text: str) -> Optional[str]:
    """The argument of the last box in ``text`` (stripped), or None when there is no box."""
    box = last_boxed_only_string(text)
    return None if box is None else remove_boxed(box).strip()


def _timeout() -> Optional[int]:
    return PARSE_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _parse(latex: str) -> list:
    """``math-verify`` parse of a bare LaTeX answer; ``[]`` when it does not parse."""
    try:
        from math_verify import LatexExtractionConfig, parse
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("the MATH reward needs the math-verify package: pip install 'math-verify>=0.7'") from exc
    if not latex.strip():
        return []
    return parse(f"${latex}$", extraction_config=[LatexExtractionConfig()], fallback_mode="no_fallback",
                 parsing_timeout=_timeout())


@functools.lru_cache(maxsize=4096)
def _parse_ground_truth(ground_truth: str) -> tuple:
    # ground truths repeat n times per prompt (mean@k, GRPO groups): parse each once
    return tuple(_parse(ground_truth))


def is_equiv(answer: str, ground_truth: str) -> bool:
    """Whether two bare LaTeX answers (no ``\\boxed``) are mathematically equivalent per ``math-verify``.

    False when either side does not parse.
    """
    from math_verify import verify

    gold = list(_parse_ground_truth(ground_truth))
    if not gold:
        return False
    pred = _parse(answer)
    if not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=_timeout()))


def compute_score(solution_str: str, ground_truth: str, format_score: float = 0.0, score: float = 1.0) -> float:
    """Score a response against a MATH ground truth (a bare LaTeX answer, e.g. ``"\\frac{1}{2}"``).

    Returns ``score`` if the last box of ``solution_str`` is equivalent to ``ground_truth``, ``format_score``
    if there is a box but it is not (or either side does not parse), and 0.0 if there is no box.
    """
    answer = extract_boxed_answer(solution_str)
    if answer is None:
        return 0.0
    return score if is_equiv(answer, str(ground_truth)) else format_score

