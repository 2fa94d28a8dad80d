"""The auto-mapper plans Ulysses sequence parallelism for long sequences: a 64k-token PPO job on one 8 x H100 node
has no plan without sp (the critic, data-parallel only, cannot hold one sequence's activations next to the states
of its set) and gets one with sp > 1, explained in the plan and written to the emitted config; a short job keeps
sp = 1 (sp is never faster on the same devices). Also the cost model's sp invariants."""

import dataclasses

from hybridflow.mapping.abilities import get_abilities
from hybridflow.mapping.cost import CostParams, Layout, activation_bytes_train, train_time
from hybridflow.mapping.emit import plan_to_config
from hybridflow.mapping.plan_cli import format_plan
from hybridflow.mapping.search import search
from hybridflow.mapping.specs import Workload, get_model, parse_cluster

FSDP2 = get_abilities("fsdp2")
CLUSTER = parse_cluster("1x8:H100")


def _models():
    model = dataclasses.replace(get_model("7B"), max_positions=1 << 17)
    return {"actor": model, "critic": model, "reference": model, "reward": None}


def _phases(plan, kind="train"):
    return {ph.role: ph for s in plan.sets for ph in s.phases if ph.kind == kind}


def test_long_sequences_need_sp_and_the_plan_says_why():
    workload = Workload(batch=64, prompt_len=1024, response_len=65536)
    assert search(_models(), workload, CLUSTER, abilities=dataclasses.replace(FSDP2, sp_roles=frozenset())).best \
        is None
    plan = search(_models(), workload, CLUSTER, abilities=FSDP2).best
    assert plan is not None
    critic = _phases(plan)["critic"]
    sp = critic.layout.sp
    assert sp > 1 and critic.layout.dp % sp == 0
    # independently: the critic's set does not fit with sp=1 activations, and does with 1/sp of them
    model, params = dataclasses.replace(_models()["critic"], value_head=True), CostParams()  # the critic's head
    seq = workload.prompt_len + workload.response_len
    one = activation_bytes_train(model, dataclasses.replace(critic.layout, sp=1), 1, seq, 2, params, 1)
    split = activation_bytes_train(model, critic.layout, 1, seq, 2, params, 1)
    critic_set = plan.set_of("critic")
    assert critic_set.persistent + one > critic_set.usable_bytes >= critic_set.persistent + split
    assert f"critic train: sp={sp} (Ulysses) splits each micro-batch's {seq} tokens" in critic.note
    assert f"why {critic.note}" in format_plan(plan)
    assert critic.to_dict()["sp"] == sp
    config, _ = plan_to_config(plan, CLUSTER, workload)
    assert config["critic"]["ulysses_sequence_parallel_size"] == sp


def test_short_sequences_keep_sp_one():
    plan = search(_models(), Workload(batch=64, prompt_len=1024, response_len=1024), CLUSTER, abilities=FSDP2).best
    assert all(ph.layout.sp == 1 and not ph.note for s in plan.sets for ph in s.phases)
    config, _ = plan_to_config(plan, CLUSTER, Workload(batch=64, prompt_len=1024, response_len=1024))
    assert "ulysses_sequence_parallel_size" not in config["critic"]


def test_sp_divides_activations_and_costs_time():
    model, params = get_model("7B"), CostParams()
    for sp in (2, 4):
        one = activation_bytes_train(model, Layout(1, 1, 8), 1, 8192, 2, params, 1)
        split = activation_bytes_train(model, Layout(1, 1, 8, sp), 1, 8192, 2, params, 1)
        assert abs(split - one / sp) <= 1e-9 * one  # 8192 tokens divide evenly
        # same devices, same FLOPs per device, plus the all-to-alls: never faster
        assert train_time(model, Layout(1, 1, 8, sp), 64, 8192, CLUSTER, params) > \
            train_time(model, Layout(1, 1, 8), 64, 8192, CLUSTER, params)
    assert FSDP2.sp_reason("actor", Layout(1, 2, 4, 2)) is not None  # no sp with tp
    assert FSDP2.layout_reason("actor", Layout(1, 1, 8, 2), generate=True) is not None  # nor in generation
