"""Expert parallelism in the auto-mapper's simulators (:mod:`hybridflow.mapping.cost`): how ``Layout.ep`` splits a
mixture-of-experts model's parameters and what its token all-to-alls cost.

Megatron-core's expert parallelism (``expert_model_parallel_size``; Lepikhin et al. 2020, "GShard", §2.2-2.3) places
each MoE layer's routed experts on ``ep`` of the ``dp`` data-parallel ranks (every rank holds experts / ep of them,
still split over tp and pp like the rest), while the dense part (attention, embeddings, router, shared expert) is
replicated over dp as without EP. Memory: a device keeps the dense shard N_dense / (tp·pp) and the expert shard
N_experts / (tp·pp·ep); ZeRO shards the dense part's states over dp and the experts' over the expert-data-parallel
group dp / ep (so ZeRO-1's optimizer bytes do not change with ep: weights and gradients shrink). Time: the FLOP
stay those of the active parameters; each MoE layer of the device's stage exchanges its tokens twice per pass
(dispatch to the experts' ranks, combine back), each rank sending (ep-1)/ep of its tokens' k routed copies of the
hidden state (/ tp with sequence parallelism), costed like the Ulysses all-to-all as an all-gather of that size over
the ep group (ranks ``tp`` apart; ``cost.ep_comm_time``); the experts' gradient all-reduce runs over dp / ep ranks
``tp·ep`` apart.

Units: parameters (counts), bytes, seconds; ``tokens_per_micro``: tokens of one micro-batch of one data rank.
"""

from __future__ import annotations

from hybridflow.mapping.specs import ModelSpec

__all__ = ["expert_params", "param_shards"]


def expert_params(model: ModelSpec) -> int:
    """Parameters of the routed experts of every layer: layers · experts · 3 · hidden · moe_intermediate (gate, up,
    down projections); 0 for a dense model."""
    return model.layers * model.experts * 3 * model.hidden * model.moe_intermediate if model.experts else 0


def param_shards(model: ModelSpec, layout) -> tuple[float, float]:
    """(dense, expert) parameters per device before ZeRO sharding: (N - N_experts) / (tp·pp) and
    N_experts / (tp·pp·ep) (``layout``: a :class:`hybridflow.mapping.cost.Layout`)."""
    experts = expert_params(model)
    split = layout.tp * layout.pp
    return (model.n_params - experts) / split, experts / (split * layout.ep)

