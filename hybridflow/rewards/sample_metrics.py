"""Metrics of k sampled responses per prompt, the ones papers and leaderboards compare by: ``best@k``, ``pass@k`` and
``maj@k`` (``mean@k`` is :func:`hybridflow.rewards.validation.mean_by_source`'s).

With n responses sampled for a prompt (``rollout.val_kwargs.n``), scores ``s_1 .. s_n`` and k <= n:

- ``pass@k``: the probability that at least one of k responses drawn without replacement from the n is correct
  (score >= a threshold), by the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained
  on Code", arXiv 2107.03374, eq. 1): ``pass@k = 1 - C(n - c, k) / C(n, k)`` with c correct of n. The ratio is
  computed as the product ``prod_{i<k} (n - c - i) / (n - i)`` of factors in [0, 1], never as two huge binomials;
- ``best@k``: the expected best score of k responses drawn without replacement, exactly (no bootstrap): with the
  scores sorted ascending ``s_(1) <= .. <= s_(n)``, the best of a random k-subset is ``s_(j)`` with probability
  ``C(j - 1, k - 1) / C(n, k)``, so ``best@k = sum_j s_(j) C(j - 1, k - 1) / C(n, k)``. On 0/1 scores it equals
  ``pass@k`` (the same estimator, for any score);
- ``maj@n``: majority voting (self-consistency, Wang et al. 2022, arXiv 2203.11171): the answer extracted from most
  of the n responses wins, and the prompt scores the mean score of the responses that gave it. Responses without an
  extracted answer do not vote; when none has one the prompt scores the mean of all n. Ties go to the answer that
  appears first. Answers are compared as the strings the extractor returns (``hybridflow.rewards.extract_answer``;
  numbers normalised, LaTeX only stripped of spaces, so ``\\frac12`` and ``0.5`` are two answers).

Every metric is the mean over prompts, overall and per data source. Shapes: N = B * n responses, prompt-major
(the n responses of prompt j are rows ``j*n .. j*n + n - 1``, as :func:`generate_and_score` yields them).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Optional

__all__ = ["best_at_k", "k_values", "majority_score", "pass_at_k", "sampled_metrics"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. 2021, eq. 1, for one prompt: ``1 - C(n - c, k) / C(n, k)``, the chance that k of the n samples
    drawn without replacement hold at least one of the c correct ones.

    Raises:
        ValueError: not ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    all_wrong = 1.0
    for i in range(k):
        all_wrong *= (n - c - i) / (n - i)
    return 1.0 - all_wrong


def best_at_k(scores: Sequence[float], k: int) -> float:
    """The expected maximum of ``k`` of ``scores`` (one prompt's n) drawn without replacement:
    ``sum_j s_(j) C(j - 1, k - 1) / C(n, k)`` over the ascending scores (exact integer binomials).

    Raises:
        ValueError: not ``1 <= k <= len(scores)``.
    """
    n = len(scores)
    if not 1 <= k <= n:
        raise ValueError(f"best@k needs 1 <= k <= n, got n={n}, k={k}")
    total = math.comb(n, k)
    return sum(s * (math.comb(j - 1, k - 1) / total) for j, s in enumerate(sorted(scores), start=1) if j >= k)


def majority_score(scores: Sequence[float], answers: Sequence[Optional[str]]) -> float:
    """maj@n of one prompt: the mean score of the responses whose answer won the vote (None does not vote; no
    answer at all: the mean of every score; a tie: the answer seen first).

    Raises:
        ValueError: ``scores`` and ``answers`` differ in length, or are empty.
    """
    if len(scores) != len(answers) or not scores:
        raise ValueError(f"majority vote needs one answer per score, got {len(scores)} scores, {len(answers)} answers")
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return sum(scores) / len(scores)
    top = max(votes.values())
    winner = next(a for a in answers if a is not None and votes[a] == top)
    won = [s for s, a in zip(scores, answers) if a == winner]
    return sum(won) / len(won)


def k_values(n: int) -> list[int]:
    """The k reported for n samples: the powers of two below n, and n (1, 2, 4, ..., n)."""
    return sorted({2 ** i for i in range(max(n, 1).bit_length()) if 2 ** i < n} | {n})


def sampled_metrics(prefix: str, scores: Sequence[float], sources: Sequence[str],
                    answers: Optional[Sequence[Optional[str]]], n: int, threshold: float) -> dict[str, float]:
    """``{prefix}/pass@k`` (k in :func:`k_values`; correct: score >= ``threshold``), ``{prefix}/best@k`` (k >= 2) and
    ``{prefix}/maj@n``, each also as ``{metric}/{data_source}``, means over prompts. maj@n only over the data sources
    where some response has an extracted answer (``answers`` None: none).

    Raises:
        ValueError: the lengths differ, N is not a multiple of ``n``, or a prompt's rows name two data sources.
    """
    if len(scores) != len(sources) or (answers is not None and len(answers) != len(scores)) or len(scores) % n:
        raise ValueError(f"need N = prompts x n={n} scores, sources and answers, got {len(scores)} scores, "
                         f"{len(sources)} sources, {None if answers is None else len(answers)} answers")
    if not scores:
        return {}
    per_prompt: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))  # source -> metric -> values
    voted: set[str] = set()
    for start in range(0, len(scores), n):
        group, source = list(scores[start:start + n]), sources[start]
        if any(s != source for s in sources[start:start + n]):
            raise ValueError(f"rows {start}..{start + n - 1} should be the {n} responses of one prompt, but name "
                             f"several data sources: {sorted(set(sources[start:start + n]))}")
        correct = sum(s >= threshold for s in group)
        for k in k_values(n):
            per_prompt[source][f"pass@{k}"].append(pass_at_k(n, correct, k))
            if k >= 2:
                per_prompt[source][f"best@{k}"].append(best_at_k(group, k))
        group_answers = [None] * n if answers is None else list(answers[start:start + n])
        per_prompt[source][f"maj@{n}"].append(majority_score(group, group_answers))
        if any(a is not None for a in group_answers):
            voted.add(source)
    out: dict[str, float] = {}
    for metric in next(iter(per_prompt.values())):
        kept = {src: values[metric] for src, values in sorted(per_prompt.items())
                if not metric.startswith("maj@") or src in voted}
        if kept:
            every = [v for values in kept.values() for v in values]
            out[f"{prefix}/{metric}"] = sum(every) / len(every)
            out.update({f"{prefix}/{metric}/{src}": sum(v) / len(v) for src, v in kept.items()})
    return out
