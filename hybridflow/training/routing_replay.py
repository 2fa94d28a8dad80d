"""Mixture-of-experts forwards of the training engines: the router's load-balancing loss and load metrics of each
forward, and routing replay (``actor.router_replay``).

Routing replay: the rollout records, per token of the full sequence (prompt + response) and per MoE layer, the
experts its router chose (the ``routed_experts`` batch column, (B, P+R, Ly, k) int16); a forward of
a micro-batch that carries the column routes each token to exactly those experts instead of its own top-k (the
gate weights stay the trainer's softmax probabilities of those experts, so the router still gets gradients). The
trainer then evaluates the same sparse function the rollout sampled from, which removes the mismatch that a
different top-k choice (a near tie flipped by bf16 vs fp32, kernels, or a weight update) adds to pi_old / mu.

``actor.router_replay`` (what the actor does with the column): ``off`` drops it (every forward routes by its own
top-k); ``rollout`` keeps the rollout's routing for the actor's old-logprob and update forwards (the reference and
the critic are not sent the column: they route by their own top-k); ``recompute`` records the routing of the
old-logprob forward (the trainer's own routing under pi_old) and replays it in the update's forwards, so every
mini-batch and epoch evaluates pi_theta with the experts pi_old chose (the update's weight changes flip no expert
choice inside the ratio pi_theta / pi_old).

Shapes: B rows, P+R prompt + response columns, Ly MoE layers, k experts per token, E experts, N tokens of one
forward.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from hybridflow.models.moe import ROUTING_KEY, RoutingRecord, expert_load, load_balancing_loss, route, routers
from hybridflow.errors import UserError
from hybridflow.protocol import DataProto
from hybridflow.training.packing import padded_columns, use_varlen_attention
from hybridflow.training.shared_prompt import shared_prompt_layout
from hybridflow.training.ulysses import gather_routing, routing_index
from hybridflow.utils.metrics import Max, Mean, Metric, Min, accumulate

REPLAY_MODES = ("off", "rollout", "recompute")
RECORD_ROUTING = "record_routing"  # micro-batch meta_info flag: return the forward's routing as routed_experts


def forward_token_index(module: torch.nn.Module, micro: DataProto, kind: str, remove_padding: bool) -> torch.Tensor:
    """(N,) long: for each token of the engine's forward of ``micro``, in the order the model flattens it, its
    index in the flattened (B*(P+R),) rectangle; mirrors the forwards of :mod:`hybridflow.training.micro` and
    :mod:`hybridflow.training.packing` (cut padded columns, packed valid tokens, shared prompts)."""
    batch = micro.batch
    mask = batch["attention_mask"]
    rows, width = mask.shape
    grid = torch.arange(rows * width, device=mask.device).view(rows, width)
    if remove_padding:
        if kind != "score" and use_varlen_attention(module):
            layout = shared_prompt_layout(mask, batch["input_ids"], batch["responses"].shape[1])
            if layout is not None:
                return layout.flat_index
        return mask.bool().flatten().nonzero().flatten()
    if kind == "score":
        return grid.flatten()
    first, end = padded_columns(mask, batch["responses"].shape[1])
    return grid[:, first:end].flatten()


@contextlib.contextmanager
def moe_forward(module: torch.nn.Module, micro: DataProto, kind: str, remove_padding: bool,
                sp_group: Optional[dist.ProcessGroup] = None) -> Iterator[Optional[RoutingRecord]]:
    """Around one engine forward of ``micro``: yields None for a dense model; for an MoE model the
    :class:`~hybridflow.models.moe.RoutingRecord` of the forward, replaying ``micro``'s ``routed_experts`` when it
    has that column. ``sp_group``: the forward is Ulysses sequence-parallel (:mod:`hybridflow.training.ulysses`):
    this rank replays (and records) the routing of its slice of the sequence only, and the record's ``mask`` marks
    the slice's valid tokens.

    Raises:
        RoutingShapeError: the recorded routing does not fit the model (layers, top-k).
    """
    if not routers(module):
        yield None
        return
    replay, index, valid = None, None, None
    if sp_group is not None:
        index, valid = routing_index(micro, remove_padding, sp_group)
    if ROUTING_KEY in micro.batch.keys():
        index = forward_token_index(module, micro, kind, remove_padding) if index is None else index
        full = micro.batch[ROUTING_KEY]
        replay = full.reshape(-1, *full.shape[2:])[index.to(full.device)]
    with route(module, replay) as record:
        yield record
    if valid is not None:
        record.mask = valid.to(record.indices[0].device) if record.indices else None


def moe_outputs(module: torch.nn.Module, record: Optional[RoutingRecord], micro: Optional[DataProto] = None,
                kind: str = "policy", remove_padding: bool = False,
                sp_group: Optional[dist.ProcessGroup] = None) -> dict[str, torch.Tensor]:
    """The engine outputs of an MoE forward: ``router_aux_loss`` (0-d fp32, with its graph when the forward had
    one; :func:`~hybridflow.models.moe.load_balancing_loss` over the forward's valid tokens), ``expert_load``
    (Ly, E) fp32, each layer's share of routed assignments per expert, and ``expert_load_ratio`` (0-d), the largest
    over the layers of max / min expert load (an expert that got no token counts as one assignment, so the ratio
    stays finite: at most the layer's assignment count); with ``micro.meta_info["record_routing"]`` also
    ``routed_experts`` (B, P+R, Ly, k) int16, the forward's own routing (:func:`routing_rectangle`; ``kind`` and
    ``remove_padding`` as the engine ran it; under sp (``sp_group``) gathered from every sp rank's slice: a
    collective). Empty for a dense model or a forward that ran no router. Under sp the aux loss and the loads are
    this rank's slice's (``router_aux_loss_coef`` > 0 with sp is refused at load)."""
    if record is None or not record.logits:
        return {}
    top_k = record.indices[0].shape[1]
    num_experts = record.logits[0].shape[-1]
    mask = record.mask if record.mask is not None and record.mask.numel() == record.indices[0].shape[0] else None
    load = torch.stack([expert_load(i, num_experts, mask) for i in record.indices])
    assignments = top_k * (record.indices[0].shape[0] if mask is None else float(mask.sum()))
    floor = 1.0 / max(assignments, 1.0)  # an expert that got no token counts as one assignment (finite ratio)
    ratio = (load.max(dim=1).values / load.min(dim=1).values.clamp(min=floor)).max()
    out = {"router_aux_loss": load_balancing_loss(record.logits, top_k, mask), "expert_load": load,
           "expert_load_ratio": ratio}
    if micro is not None and micro.meta_info.get(RECORD_ROUTING):
        out[ROUTING_KEY] = (routing_rectangle(module, micro, kind, remove_padding, record) if sp_group is None else
                            gather_routing(record.stacked_indices(), micro, remove_padding, sp_group))
    return out


def add_router_stats(stats: dict[str, Metric], prefix: str, outputs: dict[str, torch.Tensor],
                     tokens: float) -> None:
    """Pool one micro-batch's router metrics into ``stats`` (weights: its ``tokens`` loss tokens):
    ``<prefix>/router_aux_loss``; per MoE layer l ``<prefix>/expert_load/layer{l}_max`` and ``_min`` (the largest
    and smallest share of the layer's routed assignments an expert got in any micro-batch; uniform = 1/E) and
    ``<prefix>/expert_load_max_min_ratio`` (``expert_load_ratio`` of :func:`moe_outputs`, the worst micro-batch).
    No-op without router outputs."""
    if "expert_load" not in outputs:
        return
    accumulate(stats, f"{prefix}/router_aux_loss", Mean(float(outputs["router_aux_loss"].item()) * tokens, tokens))
    load = outputs["expert_load"].detach().float()
    for layer, row in enumerate(load):
        accumulate(stats, f"{prefix}/expert_load/layer{layer}_max", Max(float(row.max())))
        accumulate(stats, f"{prefix}/expert_load/layer{layer}_min", Min(float(row.min())))
    accumulate(stats, f"{prefix}/expert_load_max_min_ratio", Max(float(outputs["expert_load_ratio"])))


def routing_rectangle(module: torch.nn.Module, micro: DataProto, kind: str, remove_padding: bool,
                      record: RoutingRecord) -> torch.Tensor:
    """The routing of ``record`` (one forward of ``micro``) placed back in the (B, P+R, Ly, k) int16 layout of the
    ``routed_experts`` column (0 where the forward computed no token)."""
    mask = micro.batch["attention_mask"]
    stacked = record.stacked_indices()
    out = torch.zeros(mask.numel(), *stacked.shape[1:], dtype=torch.int16, device=stacked.device)
    out[forward_token_index(module, micro, kind, remove_padding).to(out.device)] = stacked
    return out.view(*mask.shape, *stacked.shape[1:])


class MissingRoutingError(UserError, ValueError):
    """Routing replay asked for on a batch that carries no recorded routing."""


def replay_view(data: DataProto, mode: str) -> DataProto:
    """``data`` as the forwards of ``actor.router_replay=mode`` see it: ``data`` itself for ``rollout``, else
    without the ``routed_experts`` column (a view sharing the tensors; ``data`` is unchanged). The update of
    ``recompute`` keeps the column the old-logprob forward recorded: it calls this with ``rollout``.

    Raises:
        ValueError: ``mode`` is not one of :data:`REPLAY_MODES`.
        MissingRoutingError: ``rollout`` on a batch without the ``routed_experts`` column (the replay would
            silently not happen: a dense model, or a rollout that recorded nothing).
    """
    if mode not in REPLAY_MODES:
        raise ValueError(f"actor.router_replay must be one of {', '.join(REPLAY_MODES)}, got {mode!r}")
    if mode == "rollout" and ROUTING_KEY not in data.batch.keys():
        raise MissingRoutingError(f"actor.router_replay={mode} but the batch has no {ROUTING_KEY} column: the rollout "
                                  "recorded no routing (a dense model, or a rollout path that does not record); set "
                                  "actor_rollout_ref.actor.router_replay=off")
    if mode == "rollout" or ROUTING_KEY not in data.batch.keys():
        return data
    return data.select(batch_keys=[k for k in data.batch.keys() if k != ROUTING_KEY])
