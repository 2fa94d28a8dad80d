"""Decode and score a whole rollout batch with the rule rewards (shared by the reward worker and ``hybridflow eval``).

Shape legend: ``N`` rows (responses), ``R`` response tokens.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from hybridflow.errors import UserCodeError
from hybridflow.protocol import DataProto
from hybridflow.rewards import ComputeScoreFn, get_reward_fn

__all__ = ["decode_responses", "multi_turn_info", "score_batch"]


def decode_responses(tokenizer: Any, data: DataProto) -> list[str]:
    """Text of each response: the tokens of ``responses`` (N, R) where ``response_mask`` (N, R) is 1, decoded
    with ``skip_special_tokens=True`` (so a closing eos is dropped).

    Raises:
        KeyError: ``responses`` or ``response_mask`` is missing from ``data.batch``.
    """
    responses = data.batch["responses"]
    mask = data.batch["response_mask"].bool()
    return [tokenizer.decode(responses[i][mask[i]].tolist(), skip_special_tokens=True) for i in range(len(data))]


def multi_turn_info(tokenizer: Any, data: DataProto, row: int, extra_info: Any) -> Any:
    """``extra_info`` of a multi-turn row (one with the rollout's ``turn_spans`` column) extended with the model
    turns and the tool results kept apart: ``model_turns`` (the decoded text of each model turn, special tokens
    skipped) and ``tool_calls`` (the rollout's list of dicts: name, arguments, result, error, latency_s, turn);
    a single-turn row's ``extra_info`` is returned unchanged. Never modifies the batch's own dict."""
    nt = data.non_tensor_batch
    if "turn_spans" not in nt or tokenizer is None:
        return extra_info
    ids = data.batch["responses"][row].tolist()
    turns = [tokenizer.decode(ids[start:end], skip_special_tokens=True)
             for kind, start, end in nt["turn_spans"][row] if kind == "model"]
    base = dict(extra_info) if isinstance(extra_info, dict) else {} if extra_info is None else {"extra_info": extra_info}
    return {**base, "model_turns": turns, "tool_calls": list(nt["tool_calls"][row]) if "tool_calls" in nt else []}


def score_batch(tokenizer: Any, data: DataProto, texts: Optional[Sequence[str]] = None,
                error_score: Optional[float] = None, return_errors: bool = False,
                compute_score: Optional[ComputeScoreFn] = None):
    """Per-row scores of a rollout batch by the reward registered for each row's ``data_source`` or by a user
    ``compute_score`` (``reward_model.compute_score``), both called as ``fn(data_source, solution_str,
    ground_truth, extra_info)``.
    ``solution_str`` is the text of the model's tokens (``response_mask`` 1); for a multi-turn row ``extra_info``
    also holds the model turns and the tool calls with their results, apart (:func:`multi_turn_info`).

    Args:
        tokenizer: the policy's tokenizer (used only when ``texts`` is None).
        data: N rows with tensors ``responses`` and ``response_mask`` (N, R) and non-tensor columns
            ``data_source`` and ``ground_truth`` (and optionally ``extra_info``, ``index``), e.g. the generated
            batch joined with its prompts repeated ``n`` times.
        texts: the already decoded responses (from :func:`decode_responses`), to avoid decoding twice.
        error_score: the score of a row whose scoring function raises; None (default) re-raises instead.
        return_errors: also return N bools marking the rows that got ``error_score``.
        compute_score: a user scoring function as :func:`hybridflow.rewards.load_compute_score` returns it (taking
            the four arguments by position) that replaces the registry lookup for every row; None (default) uses
            the registry.

    Returns:
        N floats in row order (and the N error flags with ``return_errors``).

    Raises:
        KeyError: a required column is missing.
        ValueError: ``len(texts) != N``, or (without ``compute_score``) a row's ``data_source`` has no registered
            reward.
        UserCodeError: a user's scoring function raised and ``error_score`` is None: one line naming the row (its
            ``index`` column when present), its data_source and the start of the response, and the user's frames
            (also a ``RuntimeError``).
        RuntimeError: one of hybridflow's own scorers raised (the same message; the traceback is kept).
    """
    if texts is None:
        texts = decode_responses(tokenizer, data)
    if len(texts) != len(data):
        raise ValueError(f"score_batch: got {len(texts)} texts for {len(data)} rows")
    nt = data.non_tensor_batch
    missing = [key for key in ("data_source", "ground_truth") if key not in nt]
    if missing:
        raise KeyError(f"score_batch needs non-tensor columns {missing}; has {sorted(nt)}")
    extra = nt.get("extra_info")
    scores, errors = [], []
    for i, text in enumerate(texts):
        source, truth = nt["data_source"][i], nt["ground_truth"][i]
        info = multi_turn_info(tokenizer, data, i, None if extra is None else extra[i])
        if compute_score is None:
            reward = get_reward_fn(source)  # an unknown data_source is a data error, never scored
        try:
            if compute_score is None:
                scores.append(float(reward(source, text, truth, info)))
            else:
                scores.append(float(compute_score(source, text, truth, info)))
            errors.append(False)
        except Exception as err:
            if error_score is None:
                raise _reward_error(err, compute_score or reward, nt, i, text) from err
            scores.append(float(error_score))
            errors.append(True)
    return (scores, errors) if return_errors else scores


def _reward_error(err: Exception, fn: Any, nt: dict, row: int, text: str) -> RuntimeError:
    """The error that stops scoring at row ``row``: a :class:`~hybridflow.errors.UserCodeError` (one line and the
    user's frames) when ``err`` came through the user's own code, else a ``RuntimeError`` (hybridflow's own
    scorer failed: a bug, with its traceback). Both name the sample (its ``index`` column when present), its
    data_source and the start of the response."""
    sample = nt["index"][row] if "index" in nt else row
    where = (f"reward function {getattr(fn, '__name__', fn)!s} failed on sample index={sample} "
             f"(data_source={nt['data_source'][row]!r}, response={text[:200]!r})")
    hint = "set reward_model.error_score to score such samples instead of stopping"
    return UserCodeError.wrap(err, where, hint) or RuntimeError(f"{where}: {type(err).__name__}: {err}; {hint}")
