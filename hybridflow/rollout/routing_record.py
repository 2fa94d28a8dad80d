"""Recording a mixture-of-experts model's routing during decoding, for routing replay in the trainer
(``actor.router_replay=rollout``; :mod:`hybridflow.training.routing_replay` replays it).

During one decode of N rows with P prompt columns and at most R response slots the model runs a prompt forward
(N*P tokens) and then one forward per step (N tokens: the token sampled at the previous step). The routers'
choices of those forwards are laid out as the ``routed_experts`` batch column (N, P+R, Ly, k) int16 over the full
sequence: column c holds the experts each MoE layer sent the token at column c to. The response's last column is
never fed back (decoding stops after sampling it) and neither are the slots after an early stop of every row:
those hold experts 0..k-1, a placeholder (the token's output predicts nothing the trainer reads, and a causal
model's earlier outputs do not depend on it).

Shapes: N rows, P prompt columns, R response slots, Ly MoE layers, k experts per token.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from hybridflow.models.moe import ROUTING_KEY, RoutingRecord, route, routers


class DecodeRouting:
    """The routing of one decode; :meth:`rectangle` lays it out once the decode is done."""

    def __init__(self, record: Optional[RoutingRecord], layers: int) -> None:
        self.record = record
        self.layers = layers

    def rectangle(self, rows: int, prompt_len: int, response_len: int) -> Optional[torch.Tensor]:
        """(rows, P+R, Ly, k) int16, or None when nothing was recorded (recording off, or a dense model)."""
        if self.record is None or not self.record.indices:
            return None
        found = self.record.indices
        k = found[0].shape[1]
        out = torch.arange(k, dtype=torch.int16).expand(rows, prompt_len + response_len, self.layers, k).clone()
        forwards = [found[i:i + self.layers] for i in range(0, len(found), self.layers)]
        out[:, :prompt_len] = torch.stack(forwards[0], dim=1).view(rows, prompt_len, self.layers, k).cpu()
        for step, layers in enumerate(forwards[1:]):  # the forward of step s + 1 fed the token of column P + s
            out[:, prompt_len + step] = torch.stack(layers, dim=1).cpu()
        return out


@contextlib.contextmanager
def decode_routing(module: torch.nn.Module, enabled: bool) -> Iterator[DecodeRouting]:
    """Record the routing of the forwards of one decode of ``module`` when ``enabled`` and ``module`` has MoE
    routers (:func:`hybridflow.models.moe.routers`); otherwise records nothing."""
    layers = len(routers(module)) if enabled else 0
    if not layers:
        yield DecodeRouting(None, 0)
        return
    with route(module) as record:
        yield DecodeRouting(record, layers)


def attach_routing(out, parts: list[Optional[torch.Tensor]]) -> None:
    """Add the ``routed_experts`` column to the rollout output ``out`` (a DataProto of the concatenated decodes)
    from the per-decode rectangles ``parts`` (all None: nothing added)."""
    if parts and all(p is not None for p in parts):
        out.batch[ROUTING_KEY] = torch.cat(parts).to(out.batch["input_ids"].device)
