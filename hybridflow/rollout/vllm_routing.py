"""Recording a mixture-of-experts model's routing inside a running vLLM engine, for routing replay in the trainer
(``actor.router_replay=rollout`` with ``rollout.name=vllm``; the ``hf`` rollout records it with
:mod:`hybridflow.rollout.routing_record`, the trainer replays it with :mod:`hybridflow.training.routing_replay`).

Worker side (:class:`RoutingRecordExtension`, mixed into the vLLM worker through
:class:`hybridflow.rollout.vllm_rollout.WeightSyncExtension`): each MoE layer's router (vLLM's ``MoERunner.router``,
a ``BaseRouter``) takes a capture callback that receives the layer's chosen experts ``topk_ids`` (T, k) of every
forward, before any expert-placement mapping (logical expert ids, as the Hugging Face model numbers them). A forward
pre-hook on the model notes which tokens of the flat forward batch belong to which request (vLLM's
``input_batch.req_ids`` and ``query_start_loc``) and their positions; after the forward the layers' ids are split
per request as (positions (t,) long, ids (t, Ly, k) int16) chunks. The engine's own routed-experts capture is not
used: on CPU it needs Triton.

Driver side (:func:`routing_rectangle`): the chunks of each request are laid out as the ``routed_experts`` batch
column (N, P+R, Ly, k) int16 the ``hf`` rollout produces: the token at position j of a row with L real prompt
tokens sits at column P - L + j (left padding first, then the response). Columns no forward fed (left padding, the
response's last token, slots after the end) hold experts 0..k-1, a placeholder the trainer's valid outputs never
depend on. Prompt tokens are only fed when vLLM's prefix cache is off (a cached prefix is not recomputed), so the
backend turns the prefix cache off when recording; a prompt position with no record is an error.

Shapes: T tokens of one engine forward, N rows, P prompt columns, R response slots, Ly MoE layers, k experts per
token.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch

from hybridflow.models.moe import ROUTING_KEY

__all__ = ["ROUTING_KEY", "RoutingRecordExtension", "recorded_routing", "routing_rectangle"]

Chunks = list[tuple[torch.Tensor, torch.Tensor]]  # per request: (positions (t,) long, ids (t, Ly, k) int16) chunks


class RoutingRecordExtension:
    """vLLM worker-extension methods (called through ``collective_rpc``): :meth:`hybridflow_routing_begin` before a
    generation, :meth:`hybridflow_routing_end` after it."""

    def hybridflow_routing_begin(self) -> int:
        """Start recording every forward's routing (again from nothing); returns the number of MoE layers bound
        (0: a dense model, nothing is recorded)."""
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        self.hybridflow_routing_end()
        model = self.model_runner.get_model()
        runners = sorted((m for m in model.modules() if isinstance(m, MoERunner)), key=lambda m: m.layer_id)
        state = {"layers": [None] * len(runners), "requests": {}, "step": None}
        self._hybridflow_routing = (state, runners, [])
        if not runners:
            return 0
        for slot, runner in enumerate(runners):
            runner.router.set_capture_fn(lambda ids, s=slot: state["layers"].__setitem__(s, ids.to("cpu", torch.int16)))
        hooks = self._hybridflow_routing[2]
        hooks.append(model.register_forward_pre_hook(lambda _m, _a, kw: _note_step(self.model_runner, state, kw),
                                                     with_kwargs=True))
        hooks.append(model.register_forward_hook(lambda *_: _split_step(state)))
        return len(runners)

    def hybridflow_routing_end(self) -> dict[str, Chunks]:
        """Stop recording; returns each engine request id's chunks (empty when nothing was recorded)."""
        state, runners, hooks = getattr(self, "_hybridflow_routing", None) or (None, [], [])
        for runner in runners:
            runner.router.set_capture_fn(None)
        for hook in hooks:
            hook.remove()
        self._hybridflow_routing = None
        return {} if state is None else state["requests"]


def _note_step(runner, state: dict, kwargs: dict) -> None:
    """Before a forward: which request owns which tokens of the flat batch, and the tokens' positions."""
    num_reqs = runner.input_batch.num_reqs
    starts = runner.query_start_loc.np[: num_reqs + 1].tolist()
    state["step"] = (list(runner.input_batch.req_ids[:num_reqs]), starts, kwargs["positions"].to("cpu", torch.long))
    state["layers"] = [None] * len(state["layers"])


def _split_step(state: dict) -> None:
    """After a forward: file the layers' captured ids (T, k) per request as (positions, ids (t, Ly, k)) chunks.
    A forward without captured routing (vLLM's warm-up or dummy runs) is dropped."""
    step, state["step"] = state["step"], None
    if step is None or any(ids is None for ids in state["layers"]):
        return
    req_ids, starts, positions = step
    ids = torch.stack(state["layers"], dim=1)  # (T, Ly, k)
    for req, lo, hi in zip(req_ids, starts[:-1], starts[1:]):
        if hi > lo:
            state["requests"].setdefault(req, []).append((positions[lo:hi].clone(), ids[lo:hi].clone()))


def routing_rectangle(records: dict[str, Chunks], request_ids: Sequence[str], prompt_lens: Sequence[int],
                      prompt_width: int, response_len: int) -> Optional[torch.Tensor]:
    """Lay out the recorded chunks of each row's request as (N, P+R, Ly, k) int16 (see the module docstring).

    Args:
        records: engine request id -> chunks, from :meth:`RoutingRecordExtension.hybridflow_routing_end`.
        request_ids: per row the id vLLM's output reports (the engine's id is it plus ``-`` and a random suffix).
        prompt_lens: per row its number of real prompt tokens L.
        prompt_width: P; response_len: R.

    Returns:
        the column, or None when nothing was recorded (a dense model).

    Raises:
        RuntimeError: a row's request has no record, or some prompt position of a row was not computed.
    """
    if not records:
        return None
    by_row = {rid: chunks for key, chunks in records.items() for rid in (key, key.rsplit("-", 1)[0])}
    first = next(iter(records.values()))[0][1]
    layers, k = first.shape[1:]
    out = torch.arange(k, dtype=torch.int16).expand(len(request_ids), prompt_width + response_len, layers, k).clone()
    for row, (rid, length) in enumerate(zip(request_ids, prompt_lens)):
        if rid not in by_row:
            raise RuntimeError(f"vllm rollout: no routing was recorded for request {rid}")
        seen = torch.zeros(prompt_width + response_len, dtype=torch.bool)
        for positions, ids in by_row[rid]:
            keep = positions < length + response_len - 1  # never beyond the last fed response token
            cols = positions[keep] + (prompt_width - length)
            out[row, cols] = ids[keep]
            seen[cols] = True
        if not seen[prompt_width - length:prompt_width].all():
            raise RuntimeError(f"vllm rollout: the routing of some prompt tokens of row {row} was not recorded "
                               "(computed from a cached prefix? the prefix cache must be off while recording)")
    return out


class EngineRouting:
    """The routing recorded during one generation (:func:`recorded_routing`)."""

    def __init__(self) -> None:
        self.records: dict[str, Chunks] = {}

    def rectangle(self, outputs, prompt_lens: Sequence[int], prompt_width: int,
                  response_len: int) -> Optional[torch.Tensor]:
        """:func:`routing_rectangle` for vLLM's ``outputs`` (one per row, in row order)."""
        return routing_rectangle(self.records, [o.request_id for o in outputs], prompt_lens, prompt_width,
                                 response_len)


@contextlib.contextmanager
def recorded_routing(llm, enabled: bool) -> Iterator[EngineRouting]:
    """Record the routing of the engine ``llm``'s forwards inside the context when ``enabled`` (the first worker's
    record: with tensor parallelism every rank routes the same tokens identically)."""
    routing = EngineRouting()
    if not enabled:
        yield routing
        return
    llm.collective_rpc("hybridflow_routing_begin")
    try:
        yield routing
    finally:
        routing.records = llm.collective_rpc("hybridflow_routing_end")[0]
