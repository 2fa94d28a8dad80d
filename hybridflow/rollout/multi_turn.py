"""The multi-turn, tool-calling rollout loop, over any rollout backend (``hf``, ``vllm``).

Per batch (N = B*n trajectories, each a :class:`~hybridflow.rollout.trajectory.Trajectory`):

1. every active trajectory's context (prompt + response so far, as ids) is sent to the backend for one model
   turn, which stops at an eos, at a tool-call stop string (a single-token stop such as Qwen's ``</tool_call>``
   is passed to the backend as a stop id; a multi-token one is cut after the token that completes it, the
   sampled tokens after it discarded) or at the turn's token limit: ``max_tokens_per_turn`` and what is left of
   the response budget ``data.max_response_length``;
2. the turn's sampled ids and sampling logprobs are appended (mask 1); its text is parsed for tool calls (the
   ``format`` registry). No call: the trajectory is done (``eos``, ``stop`` or ``length``). A call at the
   ``max_assistant_turns``-th model turn or after ``max_user_turns`` observations: done (``max_turns``);
3. the calls of all trajectories run concurrently (asyncio), each under ``tool_timeout_s``; failures become
   ``Error: ...`` observations and count in ``tool/errors``;
4. the observation -- the end-of-turn markup the model did not sample, the ``tool`` messages and the next
   generation prompt, rendered by the chat template as a delta (:class:`ChatDelta`) -- is appended with mask 0,
   unless it would leave no room for a model token in the budget (then done: ``length``, or ``tool_error``
   when a call of that round failed).

Trajectories of one batch finish at different turns; each turn re-sends the full context of the active ones
(the backend prefills it again: there is no KV cache across turns). The output has the single-turn layout of
:meth:`~hybridflow.rollout.base.BaseRollout.generate_sequences` (see :func:`trajectories_to_batch`), so every
driver consumes it unchanged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Coroutine, Optional, Sequence

import numpy as np
import torch

from hybridflow.protocol import DataProto
from hybridflow.rollout.base import BaseRollout
from hybridflow.rollout.batching import as_id_list, prompt_tensors, resolve_sampling_params
from hybridflow.rollout.multi_turn_template import ChatDelta
from hybridflow.rollout.trajectory import FINISH_REASONS, Trajectory, trajectories_to_batch
from hybridflow.rollout.vision import add_rollout_positions, vision_rows, with_context_vision
from hybridflow.tools import Tool, ToolCall, get_tool_format, load_tools, run_calls

logger = logging.getLogger(__name__)

__all__ = ["MultiTurnLoop", "MultiTurnSettings", "generate", "multi_turn_metrics"]


@dataclass(frozen=True)
class MultiTurnSettings:
    """The loop's limits (the ``actor_rollout_ref.rollout.multi_turn`` keys of the same names)."""

    max_assistant_turns: int = 5
    max_user_turns: int = 5
    max_tokens_per_turn: Optional[int] = None
    format: str = "hermes"
    tool_timeout_s: float = 10.0
    max_tool_response_length: int = 256

    @classmethod
    def from_config(cls, cfg: Any) -> "MultiTurnSettings":
        return cls(max_assistant_turns=int(cfg.max_assistant_turns), max_user_turns=int(cfg.max_user_turns),
                   max_tokens_per_turn=None if cfg.max_tokens_per_turn is None else int(cfg.max_tokens_per_turn),
                   format=str(cfg.format), tool_timeout_s=float(cfg.tool_timeout_s),
                   max_tool_response_length=int(cfg.max_tool_response_length))


def _run_async(coro: Coroutine) -> Any:
    """Run ``coro`` to completion from synchronous code, also when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _left_pad(rows: Sequence[Sequence[int]], pad_token_id: int, meta_info: dict) -> DataProto:
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row):] = torch.tensor(list(row), dtype=torch.long)
        attention_mask[i, width - len(row):] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(tensors={"input_ids": input_ids, "attention_mask": attention_mask,
                                        "position_ids": position_ids}, meta_info=meta_info)


class MultiTurnLoop:
    """Runs multi-turn rollouts with the tools and the chat template of one tokenizer.

    Args:
        tokenizer: the policy's tokenizer (its chat template renders observations).
        tools: tools by the name the model calls (:func:`hybridflow.tools.load_tools`).
        settings: the loop's limits.

    Raises:
        ValueError: see :class:`ChatDelta`; ``max_assistant_turns < 1`` or ``max_user_turns < 0``.
        UnknownNameError: unknown ``settings.format``.
    """

    def __init__(self, tokenizer: Any, tools: dict[str, Tool], settings: MultiTurnSettings) -> None:
        if settings.max_assistant_turns < 1 or settings.max_user_turns < 0:
            raise ValueError(f"multi_turn needs max_assistant_turns >= 1 and max_user_turns >= 0, got "
                             f"{settings.max_assistant_turns} and {settings.max_user_turns}")
        self.tokenizer = tokenizer
        self.tools = tools
        self.settings = settings
        self.format = get_tool_format(settings.format)
        self.delta = ChatDelta(tokenizer, [tool.schema for tool in tools.values()])
        # stop strings that are one token are stop ids for the backend; others are cut from the decoded text
        self.stop_ids: list[int] = []
        self.stop_texts: list[str] = []
        for stop in self.format.stop:
            ids = tokenizer.encode(stop, add_special_tokens=False)
            (self.stop_ids.append(ids[0]) if len(ids) == 1 else self.stop_texts.append(stop))

    @classmethod
    def from_config(cls, config: Any, tokenizer: Any) -> Optional["MultiTurnLoop"]:
        """The loop of the run config's ``actor_rollout_ref.rollout.multi_turn`` section; None when disabled."""
        return cls.from_section(config.actor_rollout_ref.rollout.multi_turn, tokenizer)

    @classmethod
    def from_section(cls, cfg: Any, tokenizer: Any) -> Optional["MultiTurnLoop"]:
        """The loop of a ``rollout.multi_turn`` section (what a worker holds); None when disabled."""
        if not cfg.enable:
            return None
        return cls(tokenizer, load_tools(cfg.tool_config_path), MultiTurnSettings.from_config(cfg))

    @property
    def tool_schemas(self) -> list[dict]:
        """The schemas the prompts must be rendered with (``apply_chat_template(..., tools=...)``)."""
        return [tool.schema for tool in self.tools.values()]

    def generate(self, backend: BaseRollout, prompts: DataProto) -> DataProto:
        """Multi-turn rollouts of left-padded ``prompts`` with ``backend`` (contract of
        :meth:`BaseRollout.generate_sequences`; multi-turn layout in :func:`trajectories_to_batch`).

        ``prompts.meta_info`` may override sampling (``n``, ``temperature``, ... as for the backend) and carry
        ``seed``: turn t of the batch is generated with seed ``seed * 1009 + t``. The non-tensor columns of
        ``prompts`` (if any) are handed to each tool's ``create`` as the sample.
        """
        params = resolve_sampling_params(backend.config, prompts.meta_info)
        n, budget = params["n"], params["response_length"]
        input_ids, attention_mask, position_ids = (t.repeat_interleave(n, dim=0) for t in prompt_tensors(prompts))
        mask = attention_mask.bool().cpu()
        trajs = [Trajectory(input_ids[i][mask[i]].tolist()) for i in range(input_ids.shape[0])]
        samples = [{k: v[i // n] for k, v in prompts.non_tensor_batch.items()} for i in range(len(trajs))]
        ids = [f"{uuid.uuid4().hex}-{i}" for i in range(len(trajs))]
        vision = vision_rows(prompts, n)  # image prompts: each turn's context gets the images and mrope positions
        start = time.perf_counter()
        _run_async(self._each_tool("create", [(iid, sample) for iid, sample in zip(ids, samples)]))
        try:
            self._loop(backend, trajs, ids, budget, prompts.meta_info, vision)
        finally:
            _run_async(self._each_tool("release", [(iid,) for iid in ids]))
        seconds = time.perf_counter() - start
        return add_rollout_positions(trajectories_to_batch(trajs, input_ids, attention_mask, position_ids, budget,
                                                           backend.pad_token_id, seconds), vision)

    async def _each_tool(self, method: str, args: list[tuple]) -> None:
        await asyncio.gather(*(getattr(tool, method)(*a) for tool in self.tools.values() for a in args))

    def _loop(self, backend: BaseRollout, trajs: list[Trajectory], ids: list[str], budget: int,
              meta_info: dict, vision: Optional[DataProto] = None) -> None:
        s = self.settings
        active = list(range(len(trajs)))
        failed = [False] * len(trajs)  # the last tool round of each trajectory had an error
        eos = set(as_id_list(backend.eos_token_ids)) | set(as_id_list(meta_info.get("eos_token_id")))
        for turn in range(s.max_assistant_turns):
            if not active:
                break
            limits = [budget - len(trajs[i].response_ids) for i in active]
            if s.max_tokens_per_turn is not None:
                limits = [min(limit, s.max_tokens_per_turn) for limit in limits]
            turns = self._model_turn(backend, [trajs[i].context_ids for i in active], limits, meta_info, turn,
                                     None if vision is None else vision[active])
            pending: list[tuple[int, list[ToolCall]]] = []
            for i, (turn_ids, turn_lps) in zip(active, turns):
                traj = trajs[i]
                traj.add_model_turn(turn_ids, turn_lps)
                calls = self.format.parse(self.tokenizer.decode(turn_ids, skip_special_tokens=False))
                if not calls:
                    traj.finish_reason = ("eos" if turn_ids[-1] in eos else
                                          "stop" if self._stopped(turn_ids) else "length")
                elif turn + 1 >= s.max_assistant_turns or traj.num_observations >= s.max_user_turns:
                    traj.finish_reason = "tool_error" if failed[i] else "max_turns"
                else:
                    pending.append((i, calls))
            _run_async(run_calls([(ids[i], calls) for i, calls in pending], self.tools, s.tool_timeout_s,
                                 s.max_tool_response_length))
            active = []
            for i, calls in pending:
                traj = trajs[i]
                traj.tool_calls += calls
                traj.turns_of_calls += [turn] * len(calls)
                failed[i] = any(call.error is not None for call in calls)
                last_turn = traj.span_ids("model")[-1]
                observation = self.delta.close_turn(last_turn) + self.delta.tool_observation(
                    [(call.name, call.result) for call in calls])
                if len(traj.response_ids) + len(observation) + 1 > budget:
                    traj.finish_reason = "tool_error" if failed[i] else "length"
                    continue
                traj.add_observation(observation)
                active.append(i)
        assert all(t.finish_reason in FINISH_REASONS for t in trajs), "a trajectory left the loop unfinished"

    def _model_turn(self, backend: BaseRollout, contexts: list[list[int]], limits: list[int], meta_info: dict,
                    turn: int, vision: Optional[DataProto] = None) -> list[tuple[list[int], list[float]]]:
        """One model turn for each context: (sampled ids, sampling logprobs), cut at a stop and at its limit.
        ``vision``: the contexts' rows of :func:`~hybridflow.rollout.vision.vision_rows` (image prompts)."""
        meta = {k: v for k, v in meta_info.items() if k not in ("seed", "eos_token_id")}
        meta.update(n=1, response_length=max(limits),
                    eos_token_id=sorted(set(as_id_list(meta_info.get("eos_token_id")) + self.stop_ids)))
        if meta_info.get("seed") is not None:
            meta["seed"] = int(meta_info["seed"]) * 1009 + turn
        out = backend.generate_sequences(with_context_vision(_left_pad(contexts, backend.pad_token_id, meta), vision))
        responses, mask = out.batch["responses"].cpu(), out.batch["response_mask"].bool().cpu()
        log_probs = out.batch["rollout_log_probs"].cpu()
        turns = []
        for row, limit in enumerate(limits):
            ids, lps = responses[row][mask[row]].tolist()[:limit], log_probs[row][mask[row]].tolist()[:limit]
            end = self._stop_end(ids)
            turns.append((ids[:end], lps[:end]))
        return turns

    def _stopped(self, ids: list[int]) -> bool:
        """Whether a (cut) turn ends at a stop id or contains a stop string."""
        if ids[-1] in self.stop_ids:
            return True
        text = self.tokenizer.decode(ids, skip_special_tokens=False) if self.stop_texts else ""
        return any(stop in text for stop in self.stop_texts)

    def _stop_end(self, ids: list[int]) -> int:
        """Tokens to keep of a sampled turn: through the first stop id, or through the token that completes a
        multi-token stop string; all of them when there is no stop."""
        stop_at = next((k + 1 for k, token in enumerate(ids) if token in self.stop_ids), len(ids))
        if not self.stop_texts:
            return stop_at
        text = self.tokenizer.decode(ids[:stop_at], skip_special_tokens=False)
        if not any(t in text for t in self.stop_texts):
            return stop_at
        for k in range(1, stop_at + 1):
            if any(t in self.tokenizer.decode(ids[:k], skip_special_tokens=False) for t in self.stop_texts):
                return k
        return stop_at


def generate(rollout: BaseRollout, prompts: DataProto, loop: Optional[MultiTurnLoop]) -> DataProto:
    """``rollout.generate_sequences(prompts)``, or the multi-turn ``loop`` over ``rollout`` when one is given
    (the call the workers make)."""
    return rollout.generate_sequences(prompts) if loop is None else loop.generate(rollout, prompts)


def multi_turn_metrics(data: DataProto) -> dict[str, float]:
    """Step metrics of a multi-turn batch (empty for a single-turn one): ``multi_turn/turns_mean`` (model turns
    per trajectory), ``tool/calls_mean`` (calls per trajectory), ``tool/errors`` (failed calls in the batch),
    ``tool/latency_s_mean`` (mean seconds of the calls that ran), ``multi_turn/finish/<reason>`` (fraction of
    trajectories per finish reason)."""
    nt = data.non_tensor_batch
    if "num_turns" not in nt or "tool_calls" not in nt or len(data) == 0:
        return {}
    calls = [call for row in nt["tool_calls"] for call in row]
    latencies = [call["latency_s"] for call in calls if call["latency_s"] > 0]
    reasons = np.asarray(nt["finish_reason"])
    metrics = {"multi_turn/turns_mean": float(np.mean(nt["num_turns"].astype(np.float64))),
               "tool/calls_mean": len(calls) / len(data),
               "tool/errors": float(sum(call["error"] is not None for call in calls)),
               "tool/latency_s_mean": float(np.mean(latencies)) if latencies else 0.0}
    metrics.update({f"multi_turn/finish/{r}": float(np.mean(reasons == r)) for r in FINISH_REASONS})
    return metrics
