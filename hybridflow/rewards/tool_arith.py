"""Reward of the built-in tool-use task ``hybridflow/tool_arith`` (:mod:`hybridflow.data.tool_task`).

1.0 when the number after the last ``####`` of the response equals the ground truth (GSM8K strict extraction,
:func:`hybridflow.rewards.gsm8k.extract_solution`), else 0.0. Whether the model used the calculator does not
enter the score: the tool only makes the right answer reachable. Observation text (``<tool_response>``) holds no
``####``, so the score is the same whether the response text includes the tool results or only the model turns.
"""

from __future__ import annotations

from typing import Any

from hybridflow.rewards import gsm8k


def compute_score(solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    """1.0 for the right final answer after the last ``####`` in ``solution_str``, else 0.0."""
    answer = gsm8k.extract_solution(solution_str, method="strict")
    if answer is None:
        return 0.0
    return 1.0 if gsm8k.normalize_number(answer) == gsm8k.normalize_number(ground_truth) else 0.0
