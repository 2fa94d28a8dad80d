"""Expert parallelism as an auto-mapper search axis (``Layout.ep``; hybridflow/mapping/expert_cost.py,
expert_parallel.py): an MoE model's experts split over ep data ranks divide their weights and gradients, the token
all-to-alls cost time, and a Qwen3-30B-A3B GRPO job on 16-64 H100s without pipeline parallelism gets ep > 1 with a
plan note that says why (its states at ep = 1 do not fit). Expected values are recomputed here from the model's
shapes, not read back from the code under test."""

from dataclasses import replace

import pytest

from hybridflow.mapping.abilities import Abilities, get_abilities
from hybridflow.mapping.cost import CostParams, Layout, allgather_time, ep_comm_time, model_state_bytes
from hybridflow.mapping.expert_parallel import ep_layouts
from hybridflow.mapping.presets import get_cost_preset
from hybridflow.mapping.search import MappingSearch, SearchSpace
from hybridflow.mapping.specs import Workload, get_model, parse_cluster

MOE = get_model("qwen3-30b-a3b")
WORK = Workload(algorithm="grpo", batch=512, n=8, prompt_len=1024, response_len=2048)
GB = 1e9


def _by_hand_states(layout: Layout, dp_shards_optimizer: bool = True) -> float:
    """bf16 weights + grads and fp32 Adam (m, v, master: 12 bytes) per device with ZeRO-1, from the shapes:
    experts = layers x experts x 3 x hidden x moe_intermediate, split over tp, pp and ep; the optimizer over dp
    (the dense part) and dp / ep (the experts): 12 / dp per parameter shard either way."""
    experts = MOE.layers * MOE.experts * 3 * MOE.hidden * MOE.moe_intermediate
    dense = (MOE.n_params - experts) / (layout.tp * layout.pp)
    expert = experts / (layout.tp * layout.pp * layout.ep)
    return 4 * (dense + expert) + 12 * (dense / layout.dp + expert / (layout.dp // layout.ep))


def test_ep_divides_the_experts_states_and_leaves_zero1_optimizer_bytes():
    params = CostParams(zero_stage=1)
    for layout in (Layout(1, 1, 16), Layout(1, 1, 16, ep=8), Layout(2, 2, 8, ep=4)):
        states = model_state_bytes(MOE, layout, True, 2, params)
        assert sum(states.values()) == pytest.approx(_by_hand_states(layout), rel=1e-12)
    at1, at8 = (model_state_bytes(MOE, Layout(1, 1, 16, ep=ep), True, 2, params) for ep in (1, 8))
    assert at8["optimizer"] == pytest.approx(at1["optimizer"], rel=1e-12)  # dp/ep x ep shards of the experts
    assert at8["weights"] < at1["weights"] / 4  # the experts are ~95% of the parameters


def test_all_to_all_time_and_dense_models_have_no_ep():
    cluster = parse_cluster("2x8:H100")
    layout = Layout(1, 2, 8, ep=4)
    tokens = 3072
    nbytes = tokens * MOE.experts_per_token * MOE.hidden * 2 / 2  # k routed copies per token, bf16, / tp
    want = MOE.layers * 2 * 3 * 5 * allgather_time(nbytes, 4, 2, cluster)  # dispatch + combine, 3 passes, 5 micro
    assert ep_comm_time(MOE, layout, 3, 5, tokens, cluster) == pytest.approx(want, rel=1e-12)
    assert ep_comm_time(MOE, replace(layout, ep=1), 3, 5, tokens, cluster) == 0.0
    unrestricted = get_abilities("unrestricted")
    assert ep_layouts("actor", get_model("7B"), [Layout(1, 1, 8)], unrestricted) == []
    assert {lay.ep for lay in ep_layouts("actor", MOE, [Layout(1, 1, 8)], unrestricted)} == {2, 4, 8}
    assert ep_layouts("actor", MOE, [Layout(1, 1, 8)], get_abilities("fsdp2")) == []  # FSDP shards experts itself


@pytest.mark.parametrize("cluster", ["2x8:H100", "8x8:H100"])
def test_qwen3_30b_a3b_without_pipeline_chooses_ep_and_says_why(cluster):
    search = MappingSearch({"actor": MOE, "reference": MOE, "reward": None}, WORK, parse_cluster(cluster),
                           get_cost_preset("a100-paper"), SearchSpace(max_pp=1))
    best = search.run(top_k=1).best
    train = next(ph for s in best.sets for ph in s.phases if ph.role == "actor" and ph.kind == "train")
    layout = train.layout
    assert layout.ep > 1 and layout.pp == 1
    # why: at ep = 1 the same layout's states exceed the usable memory, at the chosen ep they fit
    assert _by_hand_states(replace(layout, ep=1)) > search.usable > _by_hand_states(layout)
    assert f"ep={layout.ep} splits the 128 experts" in train.note
    assert f"{_by_hand_states(replace(layout, ep=1)) / GB:.3g} GB/device at ep=1" in train.note
    assert f"-> {_by_hand_states(layout) / GB:.3g} GB" in train.note
    # and the best plan without expert parallelism (the same system, ep ruled out) is slower
    no_ep = MappingSearch({"actor": MOE, "reference": MOE, "reward": None}, WORK, parse_cluster(cluster),
                          get_cost_preset("a100-paper"), SearchSpace(max_pp=1), Abilities("no-ep", ep_roles=frozenset()))
    without = no_ep.run(top_k=1).best
    assert all(ph.layout.ep == 1 for s in without.sets for ph in s.phases)
    assert without.seconds > best.seconds
    print(f"{cluster}: actor train {layout}, plan {best.seconds:.1f} s; best without ep {without.seconds:.1f} s")
