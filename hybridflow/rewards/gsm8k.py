"""GSM8K rule reward: extract the final number of a response and compare it to the ground truth.

Two extraction methods (names follow verl's ``reward_score.gsm8k``):

* ``"strict"`` -- the number right after ``####`` (GSM8K's answer marker), wherever it stands in the
  response; if the marker occurs several times, the last one wins. No marker -> no answer.
* ``"flexible"`` -- the last number anywhere in the response.

Numbers are compared by value, after removing thousands commas and a ``$`` sign: ``"1,000"`` ==
``"1000"``, ``"3.50"`` == ``"3.5"``, ``"$-4"`` == ``"-4"``; a trailing period (end of sentence) is not
part of the number. A ground truth that is not a number is compared as a stripped string.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# A number: optional sign and/or "$" (either order), digits with optional thousands commas and an
# optional decimal part, or a bare ".5". Not preceded by a digit or "." so "12-3" reads "12", "3".
_NUMBER = r"(?<![\d.])(?:[-+]?\$?|\$[-+]?)(?:\d[\d,]*(?:\.\d+)?|\.\d+)"
_STRICT_RE = re.compile(r"####\s*(" + _NUMBER + ")")
_NUMBER_RE = re.compile(_NUMBER)
_METHODS = ("strict", "flexible")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """Return the answer string found in ``solution_str`` (as written, e.g. ``"$1,000"``), or None.

    Raises:
        ValueError: ``method`` is not ``"strict"`` or ``"flexible"``.
    """
    if method == "strict":
        matches = _STRICT_RE.findall(solution_str)
    elif method == "flexible":
        matches = _NUMBER_RE.findall(solution_str)
    else:
        raise ValueError(f"unknown method {method!r}; known methods: {list(_METHODS)}")
    return matches[-1] if matches else None


def normalize_number(text: str) -> Decimal | None:
    """Parse ``"$1,000.50"``-style text to a Decimal (commas and ``$`` removed); None if not numeric."""
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def _same_answer(answer: str, ground_truth: str) -> bool:
    truth_value = normalize_number(ground_truth)
    if truth_value is None:
        return answer.strip() == ground_truth.strip()
    return normalize_number(answer) == truth_value


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """Score a response against a GSM8K ground truth.

    Returns ``score`` if the extracted answer equals ``ground_truth`` by value, ``format_score`` if an
    answer was extracted but is wrong, and 0.0 if no answer was found.

    Raises:
        ValueError: unknown ``method``.
    """
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return score if _same_answer(answer, str(ground_truth)) else format_score
