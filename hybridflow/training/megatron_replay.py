"""Routing replay for the ``megatron`` engine (``actor_rollout_ref.actor.router_replay=rollout``): the experts the
rollout chose for every token and MoE layer are forced in Megatron's forward, through megatron-core 0.16's
built-in router replay (``moe_enable_routing_replay``: each router's ``RouterReplay`` with the
``REPLAY_FORWARD`` action takes its top-k indices from a given tensor; the gates are the router's own softmax
scores at those indices). This removes the rollout/trainer mismatch that comes from the trainer's forward
routing some tokens differently from generation (routing replay, "R3": Ma et al. 2025, *Stabilizing MoE
Reinforcement Learning by Aligning Training and Inference Routers*, Sec. 3).

The routing arrives as the DataProto column ``routed_experts``: int16 (B, L, num_layers, top_k), aligned with
``input_ids`` (B, L) (row ``b``, position ``p``: the experts token ``input_ids[b, p]`` went to, per layer; values
at unattended positions are ignored). The engine's forward reorders rows like its tokens
(:func:`hybridflow.training.megatron_pipeline.align_rows`) and flattens them in Megatron's sequence-first token
order (``s * B + b``), per layer of this pipeline stage.
"""

from __future__ import annotations

import torch

from hybridflow.errors import UserError

__all__ = ["MODES", "ROUTING_COLUMN", "ReplayConfigError", "check_mode", "clear_replay", "replay_indices",
           "routing_replay", "set_replay", "stage_routers"]

ROUTING_COLUMN = "routed_experts"
MODES = ("off", "rollout", "recompute")


class ReplayConfigError(UserError, ValueError):
    """A ``router_replay`` setting the megatron engine cannot run."""


def check_mode(mode: str, is_moe: bool, role: str) -> bool:
    """Whether routing replay is on for this engine.

    Raises:
        ReplayConfigError: an unknown mode, or ``recompute`` (not implemented for megatron).
    """
    if mode not in MODES:
        raise ReplayConfigError(f"{role}.router_replay={mode!r}: expected one of {' | '.join(MODES)}")
    if mode == "recompute":
        raise ReplayConfigError(f"{role}.router_replay=recompute is not implemented for strategy=megatron; "
                                "use rollout or off")
    return mode == "rollout" and is_moe


def stage_routers(gpt: torch.nn.Module) -> list:
    """The ``RouterReplay`` of each MoE layer of this stage's model, in layer order (empty: no MoE layers or
    replay not enabled in its config)."""
    out = []
    for module in gpt.modules():
        replay = getattr(module, "router_replay", None)
        if replay is not None and hasattr(module, "topk"):
            out.append(replay)
    return out


def replay_indices(routed: torch.Tensor, order: torch.Tensor, attended: torch.Tensor, layers: range,
                   num_experts: int) -> list[torch.Tensor]:
    """Per layer of ``layers`` (global indices): the (S * B, top_k) int64 expert ids in Megatron's token order.

    Args:
        routed: (B, L, num_layers, top_k) int (the ``routed_experts`` column).
        order: (B, S) int64, the columns :func:`align_rows` took for each aligned position.
        attended: (B, S) bool, whether the aligned position holds a real token (others get experts 0..k-1).
        layers: the global layer indices of this stage.

    Raises:
        ReplayConfigError: ``routed`` has fewer layers than ``layers`` needs, or an expert id outside
            ``[0, num_experts)`` at an attended position.
    """
    if routed.dim() != 4 or routed.shape[2] < layers.stop:
        raise ReplayConfigError(f"{ROUTING_COLUMN} must be (batch, seq_len, layers >= {layers.stop}, top_k), got "
                                f"{tuple(routed.shape)}")
    rows = torch.gather(routed.long(), 1, order[:, :, None, None].expand(-1, -1, *routed.shape[2:]))
    k = routed.shape[3]
    filler = torch.arange(k, device=routed.device).expand_as(rows[:, :, 0])
    out = []
    for layer in layers:
        chosen = rows[:, :, layer]
        bad = attended & ((chosen < 0) | (chosen >= num_experts)).any(-1)
        if bool(bad.any()):
            raise ReplayConfigError(f"{ROUTING_COLUMN} holds an expert id outside [0, {num_experts}) at layer {layer}")
        chosen = torch.where(attended[..., None], chosen, filler)
        out.append(chosen.transpose(0, 1).reshape(-1, k).contiguous())
    return out


def set_replay(routers: list, indices: list[torch.Tensor]) -> None:
    """Make each router of ``routers`` use its entry of ``indices`` (REPLAY_FORWARD) in the next forward.

    Raises:
        ValueError: a different number of routers and index tensors.
    """
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    if len(routers) != len(indices):
        raise ValueError(f"{len(indices)} routing tensors for {len(routers)} MoE layers of this stage")
    for router, idx in zip(routers, indices):
        router.clear_indices()
        router.set_target_indices(idx)
        router.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def clear_replay(routers: list) -> None:
    """Back to the routers' own top-k (and drop the indices held for replay)."""
    for router in routers:
        router.clear_indices()
        router.clear_router_replay_action()


class _StageReplay:
    """The engine's ``before_forward`` hook: sets this stage's routers from each micro-batch's
    ``routed_experts`` (a micro-batch without the column runs the routers' own top-k); :meth:`clear` after the
    schedule."""

    def __init__(self, routers: list, layers: range, num_experts: int) -> None:
        self.routers, self.layers, self.num_experts = routers, layers, num_experts

    def __call__(self, micro: object) -> None:
        from hybridflow.training.megatron_pipeline import aligned_order

        batch = micro.batch
        routed = batch[ROUTING_COLUMN] if batch is not None and ROUTING_COLUMN in batch.keys() else None
        if routed is None:
            clear_replay(self.routers)
            return
        order, attended = aligned_order(micro)
        set_replay(self.routers, replay_indices(routed, order, attended, self.layers, self.num_experts))

    def clear(self) -> None:
        clear_replay(self.routers)


def routing_replay(engine: object) -> "_StageReplay | None":
    """The replay hook of a megatron engine (None when ``spec.router_replay`` is ``off`` or the model has no
    experts).

    Raises:
        ReplayConfigError: see :func:`check_mode`.
    """
    from hybridflow.models.megatron_convert import stage_layers
    from hybridflow.models.megatron_moe import is_moe, num_experts
    from hybridflow.training.megatron_setup import stage_of

    spec, cfg = engine.spec, engine.hf_config
    if not check_mode(getattr(spec, "router_replay", "off"), is_moe(cfg), spec.role):
        return None
    layers = stage_layers(cfg.num_hidden_layers, engine.layout.pp, stage_of(engine.layout))
    return _StageReplay(stage_routers(engine.gpt), layers, num_experts(cfg))
