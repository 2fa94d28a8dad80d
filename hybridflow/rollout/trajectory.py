"""The token-exact trajectory record of a multi-turn rollout, one per sample, and its batch layout.

A record never holds text that is tokenized again: each model turn keeps the ids it sampled (with their sampling
logprobs), each observation (the end-of-turn markup, the tool messages and the next generation prompt, rendered by
the chat template once) is appended as ids. So the ids the trainer sees are exactly the ids the model saw.

Per token of the response (every token after the prompt, model turns and observations interleaved):
``response_mask`` is 1 on tokens the model sampled and 0 on everything code appended (observations, the
template's end-of-turn markup after a stop string or an eos); ``rollout_log_probs`` is the sampling logprob on
mask-1 tokens and 0 elsewhere. The lengths of ids, mask and logprobs are equal by construction and checked by
:meth:`Trajectory.check` whenever a span is added.

Shape legend: N trajectories, P prompt tokens (left-padded), R = response_length response slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from hybridflow.protocol import DataProto
from hybridflow.rollout.batching import build_rollout_output
from hybridflow.tools.base import ToolCall

__all__ = ["FINISH_REASONS", "MODEL", "OBSERVATION", "Trajectory", "TurnSpan", "trajectories_to_batch"]

MODEL, OBSERVATION = "model", "observation"
# eos: the last model turn ended with an eos token and no tool call; stop: it ended at a tool-call stop string
# but held no complete call; length: the response budget
# (data.max_response_length) or the per-turn token limit ran out; max_turns: the model still called a tool when
# max_assistant_turns / max_user_turns were reached; tool_error: like max_turns/length, but the last tool round
# had a failed call (its error observation was the model's last feedback)
FINISH_REASONS = ("eos", "stop", "length", "max_turns", "tool_error")


@dataclass(frozen=True)
class TurnSpan:
    """Response positions ``[start, end)`` of one span; ``kind`` is ``"model"`` or ``"observation"``."""

    kind: str
    start: int
    end: int


@dataclass
class Trajectory:
    """One sample's record (see the module docstring). ``num_turns`` counts model turns; ``tool_calls`` holds
    every call in order with ``turn`` (the model turn, 0-based, that made it) in ``turns_of_calls``."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    rollout_log_probs: list[float] = field(default_factory=list)
    spans: list[TurnSpan] = field(default_factory=list)
    num_turns: int = 0
    num_observations: int = 0
    finish_reason: Optional[str] = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    turns_of_calls: list[int] = field(default_factory=list)

    @property
    def context_ids(self) -> list[int]:
        """Prompt + response so far: what the next model turn is conditioned on."""
        return self.prompt_ids + self.response_ids

    def add_model_turn(self, ids: Sequence[int], log_probs: Sequence[float]) -> None:
        """Append a model turn: its sampled ``ids`` and their sampling ``log_probs`` (mask 1).

        Raises:
            ValueError: lengths differ, the turn is empty, or a logprob is not finite.
        """
        if len(ids) != len(log_probs) or not ids:
            raise ValueError(f"a model turn needs one logprob per token and >= 1 token; got {len(ids)} ids, "
                             f"{len(log_probs)} logprobs")
        bad = [i for i, lp in enumerate(log_probs) if not math.isfinite(float(lp))]
        if bad:
            raise ValueError(f"model turn has non-finite sampling logprobs at positions {bad[:5]}")
        self._append(MODEL, [int(i) for i in ids], [1] * len(ids), [float(lp) for lp in log_probs])
        self.num_turns += 1

    def add_observation(self, ids: Sequence[int]) -> None:
        """Append code-made tokens (observation, template markup): mask 0, logprob 0.

        Raises:
            ValueError: ``ids`` is empty.
        """
        if not ids:
            raise ValueError("an observation needs at least one token")
        self._append(OBSERVATION, [int(i) for i in ids], [0] * len(ids), [0.0] * len(ids))
        self.num_observations += 1

    def _append(self, kind: str, ids: list[int], mask: list[int], log_probs: list[float]) -> None:
        start = len(self.response_ids)
        self.response_ids += ids
        self.response_mask += mask
        self.rollout_log_probs += log_probs
        self.spans.append(TurnSpan(kind, start, start + len(ids)))
        self.check()

    def check(self) -> None:
        """Assert the record's invariants.

        Raises:
            AssertionError: ids, mask and logprobs differ in length; spans do not tile the response; a span's
                mask disagrees with its kind; a mask-0 token has a non-zero logprob.
        """
        n = len(self.response_ids)
        assert len(self.response_mask) == n == len(self.rollout_log_probs), (
            f"record lengths differ: ids {n}, mask {len(self.response_mask)}, logprobs {len(self.rollout_log_probs)}")
        position = 0
        for span in self.spans:
            assert span.start == position and span.end > span.start, f"spans do not tile the response: {self.spans}"
            want = 1 if span.kind == MODEL else 0
            assert all(m == want for m in self.response_mask[span.start:span.end]), f"mask disagrees with {span}"
            position = span.end
        assert position == n, f"spans cover {position} of {n} response tokens"
        assert all(lp == 0.0 for lp, m in zip(self.rollout_log_probs, self.response_mask) if not m), (
            "a code-appended token has a non-zero logprob")

    def span_ids(self, kind: str) -> list[list[int]]:
        """The ids of each span of ``kind``, in order."""
        return [self.response_ids[s.start:s.end] for s in self.spans if s.kind == kind]


def _object_column(values: list) -> np.ndarray:
    column = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        column[i] = value
    return column


def trajectories_to_batch(trajectories: Sequence[Trajectory], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                          position_ids: torch.Tensor, response_length: int, pad_token_id: int,
                          seconds: float) -> DataProto:
    """The rollout batch of :meth:`~hybridflow.rollout.base.BaseRollout.generate_sequences` from N records.

    Args:
        trajectories: N finished records, in output row order.
        input_ids, attention_mask, position_ids: (N, P) left-padded prompts (row i is record i's prompt).
        response_length: R, the response width (every record has <= R response tokens).
        pad_token_id: written after a record's end.
        seconds: generation wall time (``meta_info["generate_seconds"]``).

    Returns:
        The single-turn layout (``responses`` (N, R), ``response_mask`` (N, R) 1 on model tokens only,
        ``rollout_log_probs`` (N, R), ``input_ids``/``position_ids`` (N, P+R), ``truncated`` (N,) = finish
        reason ``length``) except that ``attention_mask``'s response part is 1 on every record token (model and
        observation: the trainer's forward must see the observations), and non-tensor columns ``num_turns``
        (int), ``finish_reason`` (str), ``turn_spans`` (list of ``(kind, start, end)``) and ``tool_calls`` (list
        of dicts: name, arguments, result, error, latency_s, turn).

    Raises:
        ValueError: a record is longer than R, or unfinished.
    """
    n = len(trajectories)
    responses = torch.full((n, response_length), pad_token_id, dtype=torch.long)
    mask = torch.zeros((n, response_length), dtype=torch.long)
    attention = torch.zeros((n, response_length), dtype=torch.long)
    log_probs = torch.zeros((n, response_length), dtype=torch.float32)
    for row, traj in enumerate(trajectories):
        traj.check()
        length = len(traj.response_ids)
        if length > response_length or traj.finish_reason not in FINISH_REASONS:
            raise ValueError(f"trajectory {row}: {length} response tokens (max {response_length}), finish reason "
                             f"{traj.finish_reason!r}")
        responses[row, :length] = torch.tensor(traj.response_ids, dtype=torch.long)
        mask[row, :length] = torch.tensor(traj.response_mask, dtype=torch.long)
        attention[row, :length] = 1
        log_probs[row, :length] = torch.tensor(traj.rollout_log_probs, dtype=torch.float32)
    out = build_rollout_output(input_ids, attention_mask, position_ids, responses, mask, log_probs, seconds, [],
                               response_attention=attention)
    out.batch["truncated"] = torch.tensor([t.finish_reason == "length" for t in trajectories], dtype=torch.bool)
    out.non_tensor_batch.update(
        num_turns=np.array([t.num_turns for t in trajectories], dtype=np.int64),
        finish_reason=np.array([t.finish_reason for t in trajectories], dtype=object),
        turn_spans=_object_column([[(s.kind, s.start, s.end) for s in t.spans] for t in trajectories]),
        tool_calls=_object_column([[dict(c.as_dict(), turn=turn) for c, turn in zip(t.tool_calls, t.turns_of_calls)]
                                   for t in trajectories]),
    )
    return out
