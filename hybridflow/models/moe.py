"""Mixture-of-experts Hugging Face models (Qwen3-MoE, Qwen2-MoE, Mixtral): finding the routers, recording what they
route, replaying a given routing, and the router's load-balancing loss.

transformers 5 gives each of these architectures one router module per MoE layer (``*TopKRouter``: a linear
``weight`` (E, H), ``top_k``, ``num_experts``, ``forward(hidden (N, H)) -> (logits (N, E), weights (N, k),
indices (N, k))``), called once per forward of the layer on the flattened tokens of the forward (N = rows x
columns of the input). Everything here works on those modules through forward hooks and a temporary forward,
so it holds under FSDP2 (hooks see the gathered weights) and leaves the model unchanged outside the context.

Shapes: N tokens of one forward (flattened in the order the model saw them), E experts, k experts per token,
Ly MoE layers (in module order), H hidden size.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

ROUTING_KEY = "routed_experts"  # the batch column of a recorded routing: (B, P+R, Ly, k) int16 over the full sequence
ROUTER_SUFFIX = "TopKRouter"  # class-name suffix of transformers' MoE routers (Qwen3Moe, Qwen2Moe, Mixtral)


class RoutingShapeError(ValueError):
    """A routing to replay does not match the forward (wrong token count, layer count or top-k)."""


def routers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The router modules of ``module`` in layer order (empty for a dense model)."""
    return [m for m in module.modules() if type(m).__name__.endswith(ROUTER_SUFFIX)]


def is_moe(module: torch.nn.Module) -> bool:
    """Whether ``module`` has mixture-of-experts routers (:func:`routers`)."""
    return bool(routers(module))


def load_balancing_loss(router_logits: list[torch.Tensor], top_k: int,
                        mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The Switch Transformer load-balancing loss (Fedus et al. 2021, "Switch Transformers", eqs. 4-6), with top-k
    routing counted as in transformers' ``router_aux_loss_coef`` term: over the valid tokens of every layer pooled,

        loss = E * sum_e f_e * P_e,  f_e = (top-k assignments to expert e) / tokens,  P_e = mean softmax prob of e

    (so sum_e f_e = k and a uniform router gives loss = k).

    Args:
        router_logits: per MoE layer the router logits (N, E), any float dtype (computed in fp32).
        top_k: experts per token.
        mask: (N,) 0/1 valid tokens (None: all valid).

    Returns:
        0-d fp32 tensor, differentiable through the probabilities P_e (the counts f_e carry no gradient).
    """
    num_experts = router_logits[0].shape[-1]
    counts = torch.zeros(num_experts, dtype=torch.float32, device=router_logits[0].device)
    prob_sum = torch.zeros_like(counts)
    tokens = torch.zeros((), dtype=torch.float32, device=counts.device)
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        weight = torch.ones(probs.shape[0], device=probs.device) if mask is None else mask.float()
        chosen = torch.topk(probs, top_k, dim=-1).indices
        counts = counts.scatter_add(0, chosen.reshape(-1), weight.repeat_interleave(top_k))
        prob_sum = prob_sum + (probs * weight[:, None]).sum(0)
        tokens = tokens + weight.sum()
    tokens = tokens.clamp(min=1.0)
    return num_experts * torch.sum((counts / tokens) * (prob_sum / tokens))


def expert_load(indices: torch.Tensor, num_experts: int, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Fraction of the routed (token, slot) assignments each expert got: (E,) fp32 summing to 1.

    Args:
        indices: (N, k) integer expert indices of one layer.
        mask: (N,) 0/1 valid tokens (None: all).
    """
    weight = torch.ones(indices.shape[0], device=indices.device) if mask is None else mask.float()
    counts = torch.zeros(num_experts, device=indices.device).scatter_add(
        0, indices.reshape(-1).long(), weight.repeat_interleave(indices.shape[1]))
    return counts / counts.sum().clamp(min=1.0)


@dataclass
class RoutingRecord:
    """What the routers of one forward did: per MoE layer the logits (N, E) (with their graph when the forward
    had one) and the chosen indices (N, k) long; ``mask`` (N,) marks the valid tokens (None: all)."""

    logits: list[torch.Tensor] = field(default_factory=list)
    indices: list[torch.Tensor] = field(default_factory=list)
    mask: Optional[torch.Tensor] = None

    def stacked_indices(self) -> torch.Tensor:
        """(N, Ly, k) int16: the routing in the layout :class:`record_routing` / replay use."""
        return torch.stack(self.indices, dim=1).to(torch.int16)


def _replayed(router: torch.nn.Module, hidden: torch.Tensor, indices: torch.Tensor):
    """The router's outputs with its top-k replaced by ``indices`` (N, k): the weights are the softmax
    probabilities of the given experts (renormalised when the router renormalises), so gradients still reach the
    router through them."""
    hidden = hidden.reshape(-1, router.weight.shape[1])
    if indices.shape != (hidden.shape[0], router.top_k):
        raise RoutingShapeError(f"replayed routing has shape {tuple(indices.shape)}, the layer routes "
                                f"({hidden.shape[0]}, {router.top_k}) (tokens, top_k)")
    logits = torch.nn.functional.linear(hidden, router.weight)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    idx = indices.to(device=probs.device, dtype=torch.long)
    weights = probs.gather(1, idx)
    if getattr(router, "norm_topk_prob", True):  # Mixtral always renormalises; Qwen MoE per its config
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(logits.dtype), idx


@contextlib.contextmanager
def route(module: torch.nn.Module, replay: Optional[torch.Tensor] = None) -> Iterator[RoutingRecord]:
    """Record (and optionally replay) the routing of the forwards run inside the context.

    Args:
        module: the model (possibly FSDP2-sharded); a dense model yields an empty record.
        replay: (N, Ly, k) integer expert indices for every token of the next forward, in the order the model
            flattens its input (rows x columns); each router then routes token n at layer l to ``replay[n, l]``
            instead of its own top-k.

    Yields:
        the :class:`RoutingRecord` filled by the forward (the root's 2-D ``attention_mask`` of N entries becomes
        its ``mask``).

    Raises:
        RoutingShapeError: ``replay`` does not match the layers or tokens of the forward.
    """
    found = routers(module)
    record = RoutingRecord()
    if replay is not None and replay.shape[1] != len(found):
        raise RoutingShapeError(f"replayed routing has {replay.shape[1]} layers, the model has {len(found)} MoE "
                                "layers")
    handles, patched = [], []

    def on_root(_mod, _args, kwargs):
        mask = kwargs.get("attention_mask")
        record.mask = mask.reshape(-1) if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None

    def on_router(_mod, _args, out):
        record.logits.append(out[0])
        record.indices.append(out[2].detach())

    if found:
        handles.append(module.register_forward_pre_hook(on_root, with_kwargs=True))
    for layer, router in enumerate(found):
        handles.append(router.register_forward_hook(on_router))
        if replay is not None:
            router.forward = (lambda hidden, r=router, i=layer: _replayed(r, hidden, replay[:, i]))
            patched.append(router)
    try:
        yield record
    finally:
        for handle in handles:
            handle.remove()
        for router in patched:
            del router.forward  # back to the class's forward
        if record.mask is not None and record.indices and record.mask.numel() != record.indices[0].shape[0]:
            record.mask = None
