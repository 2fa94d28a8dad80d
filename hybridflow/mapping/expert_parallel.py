"""Expert parallelism in the auto-mapper: the layouts the search adds for a mixture-of-experts model, and the line
that explains a chosen ``ep`` in the plan (the costs: :mod:`hybridflow.mapping.expert_cost`).

Why ep: an MoE model computes with few of its parameters (Qwen3-30B-A3B: 3.3B active of 30.5B) but keeps all of
them, so without ep its training states need tp or pp to fit (their all-reduces, pipeline sends and bubble are paid
for the active parameters' compute only) while the data ranks replicate the experts. Splitting the experts over ep
data ranks divides their weights and gradients by ep, at the price of two all-to-alls of each token's routed hidden
states per MoE layer and pass. The search weighs both: it picks ep > 1 where the layout it enables (typically less
tp / pp) is faster than every ep = 1 layout that fits, and the plan's note gives the memory and all-to-all numbers.
"""

from __future__ import annotations

from dataclasses import replace

from hybridflow.mapping.abilities import Abilities
from hybridflow.mapping.cost import CostParams, Layout, ep_comm_time, model_state_bytes
from hybridflow.mapping.specs import ClusterSpec, ModelSpec, Workload, ceil_div, divisors

__all__ = ["ep_layouts", "ep_note", "ep_phase_note"]

GB = 1e9


def ep_layouts(role: str, model: ModelSpec, layouts: list[Layout], abilities: Abilities) -> list[Layout]:
    """The ep > 1 variants of ``layouts`` (sp = 1 ones) for an MoE ``model``: ep divides dp and the experts, and
    the abilities allow ep for ``role``; none for a dense model."""
    if not model.experts:
        return []
    out = []
    for layout in layouts:
        for ep in divisors(layout.dp):
            option = replace(layout, ep=ep)
            if ep > 1 and layout.sp == 1 and model.experts % ep == 0 and abilities.ep_reason(role, option) is None:
                out.append(option)
    return out


def ep_note(role: str, kind: str, model: ModelSpec, layout: Layout, states_ep1: float, states: float,
            all_to_all_s: float, usable: float) -> str:
    """The plan's explanation of ``layout.ep`` for one phase of ``role``: the model states per device at ep = 1
    and at ep against the usable memory, and the seconds of the phase's expert all-to-alls."""
    return (f"{role} {kind}: ep={layout.ep} splits the {model.experts} experts of each MoE layer over {layout.ep} "
            f"data ranks: model states {states_ep1 / GB:.3g} GB/device at ep=1 -> {states / GB:.3g} GB "
            f"(usable {usable / GB:.3g} GB), for {all_to_all_s:.3g} s of token all-to-alls")


def ep_phase_note(role: str, kind: str, model: ModelSpec, layout: Layout, sequences: int, workload: Workload,
                  cluster: ClusterSpec, params: CostParams, trained: bool, usable: float) -> str:
    """:func:`ep_note` for a ``train`` or ``infer`` phase of ``role`` over ``sequences`` sequences ("" at ep = 1):
    the states from ``cost.model_state_bytes`` at ep and at 1, the all-to-alls from ``cost.ep_comm_time`` with the
    phase's micro-batch count (as ``cost.train_time`` / ``cost.infer_time`` count them)."""
    if layout.ep == 1:
        return ""
    wl, dtype_bytes = workload, cluster.device.dtype_bytes
    per_rank = ceil_div(sequences, layout.data_groups)
    if kind == "train":
        micro = max(1, ceil_div(per_rank, wl.ppo_updates * wl.micro_batch)) * wl.ppo_updates * wl.ppo_epochs
        seconds = ep_comm_time(model, layout, 3, micro, wl.micro_batch * wl.seq_len, cluster)
    else:
        micro = max(1, ceil_div(per_rank, wl.infer_micro_batch))
        seconds = ep_comm_time(model, layout, 1, micro, wl.infer_micro_batch * wl.seq_len, cluster)
    states = (sum(model_state_bytes(model, lay, trained, dtype_bytes, params).values())
              for lay in (replace(layout, ep=1), layout))
    return ep_note(role, kind, model, layout, *states, seconds, usable)
