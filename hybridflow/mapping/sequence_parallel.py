"""Ulysses sequence parallelism in the auto-mapper: which ``sp`` a role may run with (the engine's abilities), the
layouts the search adds for it, and the line that explains a chosen ``sp`` in the plan.

Why sp: a training micro-batch's activations grow with its tokens (``cost.activation_bytes_train``: per layer
~34·h bytes per token in bf16, plus the fp32 logits), so one long sequence (8k-64k tokens of a reasoning response)
can exceed a device's memory at any dp. Ulysses splits each sequence's tokens over ``sp`` of the dp ranks
(``Layout.sp``): activations per device fall to ~1/sp, the FLOPs per device stay those of dp ranks sharing the
work, and each layer pays 4 all-to-alls per pass (``cost.sp_comm_time``). An sp layout is therefore never faster
than sp=1 on the same devices; the search picks it only where sp=1 does not fit, which is how a long-sequence job
gets ``sp > 1``.
"""

from __future__ import annotations

from dataclasses import replace

from hybridflow.mapping.abilities import Abilities
from hybridflow.mapping.cost import Layout
from hybridflow.mapping.specs import ModelSpec, divisors

__all__ = ["SP_CONFIG_KEYS", "sp_layouts", "sp_note"]

GB = 1e9
#: the config key of each planned role's sp (the reference follows the actor's, hybridflow/config/sp_checks.py)
SP_CONFIG_KEYS = {"actor": "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
                  "critic": "critic.ulysses_sequence_parallel_size"}


def sp_layouts(role: str, model: ModelSpec, layouts: list[Layout], abilities: Abilities) -> list[Layout]:
    """The sp > 1 variants of ``layouts`` (sp=1 each) that ``role`` may train/infer on: sp divides dp and the
    model's attention heads, and the abilities allow sp for the role on that layout (fsdp2: pp = tp = 1)."""
    out = []
    for layout in layouts:
        for sp in divisors(layout.dp):
            option = replace(layout, sp=sp)
            if sp > 1 and model.heads % sp == 0 and abilities.sp_reason(role, option) is None:
                out.append(option)
    return out


def sp_note(role: str, kind: str, layout: Layout, tokens: int, act_sp1: float, act: float, states: float,
            usable: float) -> str:
    """The plan's explanation of ``layout.sp`` for one phase of ``role``: the micro-batch's activations per
    device at sp=1 and at sp, against what the states leave of the usable memory."""
    return (f"{role} {kind}: sp={layout.sp} (Ulysses) splits each micro-batch's {tokens} tokens over {layout.sp} "
            f"ranks: activations {act_sp1 / GB:.3g} GB/device at sp=1 -> {act / GB:.3g} GB, with "
            f"{states / GB:.3g} GB of states in {usable / GB:.3g} GB usable")
