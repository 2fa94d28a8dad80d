"""Decode and score a whole rollout batch with the rule rewards (shared by the reward worker and ``hybridflow eval``).

Each row's scoring call may be bounded in time (``reward_model.timeout_s``, :func:`call_bounded`): a call that does
not return in time is abandoned and the row gets ``reward_model.error_score``.

Shape legend: ``N`` rows (responses), ``R`` response tokens.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Optional, Sequence

from hybridflow.errors import UserCodeError, UserError
from hybridflow.protocol import DataProto
from hybridflow.rewards import REWARDS, ComputeScoreFn, get_reward_fn

logger = logging.getLogger(__name__)

__all__ = ["RewardTimeoutError", "call_bounded", "cost_batch", "decode_responses", "multi_turn_info", "score_batch"]


class RewardTimeoutError(UserError, TimeoutError):
    """A row's scoring call did not return within ``reward_model.timeout_s`` and ``reward_model.error_score`` is
    unset; ``str(error)`` is one line naming the function, the sample (``index``), its data_source and the limit."""


def call_bounded(fn: Callable[..., Any], args: tuple, timeout_s: Optional[float]) -> tuple[Any, bool]:
    """``(fn(*args), True)``, or ``(None, False)`` when ``fn`` has not returned after ``timeout_s`` seconds;
    ``timeout_s=None`` calls ``fn`` here, unbounded.

    How: a Python call cannot be stopped from outside its thread, so ``fn`` runs in a new daemon thread and the
    caller waits ``timeout_s`` for it (``Thread.join``). A call that runs past that is abandoned, not stopped: its
    thread lives on (holding what it holds, using CPU if it spins) until ``fn`` returns or the process exits (a
    daemon thread never holds up the exit). A thread, not a process pool: a user's reward function need not be
    picklable, and a call costs a thread start (~0.1 ms), not a process round trip. ``fn`` runs outside the calling
    thread, so it cannot use ``signal`` (see ``register_reward``'s ``self_timed``).

    Raises:
        Exception: whatever ``fn`` raised in time (the same object, its traceback kept).
    """
    if timeout_s is None:
        return fn(*args), True
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn(*args)
        except BaseException as err:  # noqa: BLE001 - handed to the caller below
            outcome["error"] = err

    thread = threading.Thread(target=run, name=f"reward-{getattr(fn, '__name__', 'call')}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return None, False
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"], True


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
                compute_score: Optional[ComputeScoreFn] = None, timeout_s: Optional[float] = None):
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
        error_score: the score of a row whose scoring function raises or times out; None (default) raises instead.
        return_errors: also return N bools marking the rows that got ``error_score`` and N bools marking those of
            them that timed out.
        compute_score: a user scoring function as :func:`hybridflow.rewards.load_compute_score` returns it (taking
            the four arguments by position) that replaces the registry lookup for every row; None (default) uses
            the registry.
        timeout_s: seconds each row's call may take (:func:`call_bounded`; a scorer registered ``self_timed`` is
            called directly); a row past it gets ``error_score``, is logged (one warning naming its ``index``
            and data_source) and flagged; the rows are scored one after another, so k hung rows cost k *
            ``timeout_s``. None (default): unbounded.

    Returns:
        N floats in row order (and, with ``return_errors``, the N error flags and the N timeout flags).

    Raises:
        KeyError: a required column is missing.
        ValueError: ``len(texts) != N``, or (without ``compute_score``) a row's ``data_source`` has no registered
            reward.
        UserCodeError: a user's scoring function raised and ``error_score`` is None: one line naming the row (its
            ``index`` column when present), its data_source and the start of the response, and the user's frames
            (also a ``RuntimeError``).
        RuntimeError: one of hybridflow's own scorers raised (the same message; the traceback is kept).
        RewardTimeoutError: a row's call ran past ``timeout_s`` and ``error_score`` is None (one line naming it).
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
    scores, errors, timeouts = [], [], []
    for i, text in enumerate(texts):
        source, truth = nt["data_source"][i], nt["ground_truth"][i]
        info = multi_turn_info(tokenizer, data, i, None if extra is None else extra[i])
        # an unknown data_source is a data error, never scored
        fn = compute_score if compute_score is not None else get_reward_fn(source)
        limit = None if compute_score is None and REWARDS.meta(source, "self_timed", False) else timeout_s
        score, error, timed_out = _score_row(fn, (source, text, truth, info), limit, error_score, nt, i)
        scores.append(score)
        errors.append(error)
        timeouts.append(timed_out)
    return (scores, errors, timeouts) if return_errors else scores


def cost_batch(fn: Callable[..., Any], name: str, data: DataProto, texts: Sequence[str],
               timeout_s: Optional[float]) -> list[float]:
    """The rule cost ``name`` (``fn``) of each decoded response ``texts[i]``, called as ``fn(data_source, text,
    ground_truth, extra_info)`` with ``data``'s non-tensor columns ("" / None where a column is missing), each call
    bounded by ``timeout_s`` seconds (:func:`call_bounded`, ``reward_model.timeout_s``; None: unbounded). Units:
    cost per response.

    Raises:
        RewardTimeoutError: a call did not return in time (one line naming the cost, the sample's ``index`` and
            data_source, and the limit). A rule cost has no error value to fall back on, so the run stops.
        Exception: whatever ``fn`` raised.
    """
    nt = data.non_tensor_batch
    sources, truths, extra = nt.get("data_source"), nt.get("ground_truth"), nt.get("extra_info")
    costs = []
    for i, text in enumerate(texts):
        args = ("" if sources is None else sources[i], text, "" if truths is None else truths[i],
                None if extra is None else extra[i])
        value, finished = call_bounded(fn, args, timeout_s)
        if not finished:
            sample = nt["index"][i] if "index" in nt else i
            raise RewardTimeoutError(f"rule cost {name!r} (cost_model.rule) did not return within {timeout_s:g} s on "
                                     f"sample index={sample} (data_source={args[0]!r}); raise reward_model.timeout_s "
                                     "or fix the cost function")
        costs.append(float(value))
    return costs


def _score_row(fn: Any, args: tuple, timeout_s: Optional[float], error_score: Optional[float], nt: dict,
               row: int) -> tuple[float, bool, bool]:
    """``(score, got error_score, timed out)`` of one row (``args``: data_source, text, ground truth, extra_info).

    Raises:
        UserCodeError, RuntimeError: ``fn`` raised and ``error_score`` is None (:func:`_reward_error`).
        RewardTimeoutError: ``fn`` ran past ``timeout_s`` and ``error_score`` is None.
    """
    try:
        value, finished = call_bounded(fn, args, timeout_s)
        if finished:
            return float(value), False, False
    except Exception as err:
        if error_score is None:
            raise _reward_error(err, fn, nt, row, args[1]) from err
        return float(error_score), True, False
    sample = nt["index"][row] if "index" in nt else row
    where = (f"reward function {getattr(fn, '__name__', fn)!s} did not return within {timeout_s:g} s on sample "
             f"index={sample} (data_source={args[0]!r})")
    if error_score is None:
        raise RewardTimeoutError(f"{where}; set reward_model.error_score to score such samples instead of stopping, "
                                 "or raise reward_model.timeout_s")
    logger.warning("%s: scored reward_model.error_score=%g (counted in reward/timeouts); its call is abandoned "
                   "and its thread left running", where, error_score)
    return float(error_score), True, True


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
