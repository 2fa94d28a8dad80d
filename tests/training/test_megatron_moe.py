"""Mixture-of-experts HF <-> Megatron conversion (hybridflow.models.megatron_moe): bit-exact round trips over
(tp, pp, ep) ranks for Qwen3-MoE, Qwen2-MoE (shared expert) and Mixtral; the expert split checked by hand; a
1-rank Megatron GPTModel's logits equal the HF model's (routing, top-k normalisation, q/k norms, shared expert);
the config mapping and the one-line refusals of an expert layout the model cannot take."""

from __future__ import annotations


import pytest
import torch
import transformers

pytest.importorskip("megatron.core")

from hybridflow.models.megatron_convert import hf_params, hf_shard_from_local, local_from_hf, merge_tp_shards, tp_shard
from hybridflow.models.megatron_moe import ep_shard, moe_config_kwargs, stack_experts, unstack_experts
from tests.helpers.megatron import assert_gpt_logits_equal_hf
from tests.helpers.moe_models import tiny_moe

ARCHS = {
    "qwen3_moe": (transformers.Qwen3MoeForCausalLM, {}),
    "qwen3_moe_unnormalised": (transformers.Qwen3MoeForCausalLM, dict(norm_topk_prob=False)),
    "qwen2_moe_shared": (transformers.Qwen2MoeForCausalLM, dict(shared_expert_intermediate_size=48,
                                                                norm_topk_prob=False)),
    "mixtral": (transformers.MixtralForCausalLM, dict(num_local_experts=8, intermediate_size=32)),
}


def _model(arch: str, **extra) -> torch.nn.Module:
    cls, overrides = ARCHS[arch]
    return tiny_moe(cls, **overrides, **extra)


def _megatron_names(params, pp_rank: int, experts_per_rank: int) -> list[str]:
    """The Megatron parameter names of a stage, experts unstacked (what a GPTModel of the stage has)."""
    names = []
    for p in params:
        if p.pp_stage != pp_rank:
            continue
        if p.ep_dim is None:
            names.append(p.mg_name)
        else:
            head, leaf = p.mg_name.rsplit(".experts.", 1)
            names += [f"{head}.experts.local_experts.{j}.{leaf}" for j in range(experts_per_rank)]
    return sorted(set(names))


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (1, 1, 2), (2, 1, 2), (1, 2, 4), (2, 2, 2)])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_round_trip_is_bit_exact(arch: str, tp: int, pp: int, ep: int) -> None:
    """HF -> each rank's Megatron local tensors (experts unstacked as a GPTModel holds them) -> HF, bit-exact."""
    model = _model(arch, num_key_value_heads=2)  # 2 KV groups: splittable over tp=2
    hf_state = dict(model.named_parameters())
    params = hf_params(model.config, "policy", pp)
    assert [p.name for p in params] == list(hf_state)  # the table is every HF parameter, in HF order
    shards, experts = {}, {}
    for tp_rank in range(tp):
        for pp_rank in range(pp):
            for ep_rank in range(ep):
                local = local_from_hf(params, {p.name: ep_shard(tp_shard(hf_state[p.name], p.tp_dim, tp, tp_rank),
                                                                p.ep_dim, ep, ep_rank)
                                               for p in params if p.pp_stage == pp_rank}, model.config, tp, pp_rank)
                names = _megatron_names(params, pp_rank, 8 // ep)
                unstacked = unstack_experts(local, names)
                assert sorted(unstacked) == names
                back = stack_experts(unstacked)
                for p in params:
                    if p.pp_stage == pp_rank:
                        out = hf_shard_from_local(p, back[p.mg_name], model.config, tp)
                        (experts if p.ep_dim is not None else shards)[tp_rank, ep_rank, p.name] = out
    for p in params:
        if p.ep_dim is not None:
            full = torch.cat([experts[0, r, p.name] for r in range(ep)], dim=p.ep_dim)
        else:
            full = merge_tp_shards([shards[r, 0, p.name] for r in range(tp)], p.tp_dim)
        assert torch.equal(full, hf_state[p.name]), p.name


def test_expert_split_by_hand() -> None:
    """Independent of the code: at ep=2, local expert j of EP rank 1 is global expert 4 + j; its linear_fc1 is
    [gate; up] = HF gate_up_proj[4 + j] and linear_fc2 is down_proj[4 + j]; the router is mlp.gate."""
    model = _model("qwen3_moe")
    state = dict(model.named_parameters())
    params = hf_params(model.config, "policy", 1)
    local = local_from_hf(params, {p.name: ep_shard(state[p.name], p.ep_dim, 2, 1) for p in params},
                          model.config, 1, 0)
    names = _megatron_names(params, 0, 4)
    local = unstack_experts(local, names)
    mlp = model.model.layers[1].mlp
    for j in range(4):
        fc1 = local[f"decoder.layers.1.mlp.experts.local_experts.{j}.linear_fc1.weight"]
        assert torch.equal(fc1, mlp.experts.gate_up_proj[4 + j])
        assert fc1.shape == (2 * 32, 64)
        assert torch.equal(local[f"decoder.layers.1.mlp.experts.local_experts.{j}.linear_fc2.weight"],
                           mlp.experts.down_proj[4 + j])
    assert torch.equal(local["decoder.layers.1.mlp.router.weight"], mlp.gate.weight)
    assert torch.equal(local["decoder.layers.1.self_attention.q_layernorm.weight"],
                       model.model.layers[1].self_attn.q_norm.weight)


def test_config_mapping() -> None:
    """verl/HF names -> TransformerConfig: experts, top-k, expert FFN, aux-loss coefficient, routing norm."""
    cfg = _model("qwen3_moe").config
    cfg.router_aux_loss_coef = 0.01
    kw = moe_config_kwargs(cfg)
    assert (kw["num_moe_experts"], kw["moe_router_topk"], kw["moe_ffn_hidden_size"]) == (8, 2, 32)
    assert kw["moe_aux_loss_coeff"] == 0.01 and kw["moe_router_load_balancing_type"] == "aux_loss"
    assert kw["moe_router_pre_softmax"] is False and kw["qk_layernorm"] is True
    shared = moe_config_kwargs(_model("qwen2_moe_shared").config)
    assert shared["moe_shared_expert_intermediate_size"] == 48 and shared["moe_router_pre_softmax"] is True
    assert moe_config_kwargs(transformers.LlamaConfig()) == {}
    cfg.mlp_only_layers = [0]
    with pytest.raises(ValueError, match="every layer sparse"):
        moe_config_kwargs(cfg)


def test_bad_expert_layouts_are_one_line_user_errors() -> None:
    from hybridflow.errors import UserError
    from hybridflow.training.megatron_setup import check_experts

    with pytest.raises(UserError, match=r"actor.megatron.expert_model_parallel_size=2 needs a mixture-of-experts"):
        check_experts(transformers.LlamaConfig(), 2, "actor")
    with pytest.raises(UserError, match=r"expert_model_parallel_size=3 must divide the model's 8 experts"):
        check_experts(_model("qwen3_moe").config, 3, "actor")
    check_experts(_model("qwen3_moe").config, 4, "actor")


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_gpt_model_logits_equal_hf(arch: str, megatron_1rank) -> None:
    assert_gpt_logits_equal_hf(_model(arch), "policy")


def test_replay_indices_follow_megatron_token_order() -> None:
    """By hand: 2 rows, row 0 left-padded by one; aligned positions take the attended columns first, tokens are
    flattened sequence-first (s * B + b); unattended aligned slots get experts 0..k-1."""
    from hybridflow.training.megatron_replay import replay_indices

    routed = torch.tensor([[[[9, 9]], [[1, 2]], [[3, 4]]],
                           [[[5, 6]], [[7, 0]], [[2, 3]]]], dtype=torch.int16)  # (B=2, L=3, layers=1, k=2)
    order = torch.tensor([[1, 2, 0], [0, 1, 2]])
    attended = torch.tensor([[True, True, False], [True, True, True]])
    (got,) = replay_indices(routed, order, attended, range(0, 1), num_experts=8)
    assert got.tolist() == [[1, 2], [5, 6], [3, 4], [7, 0], [0, 1], [2, 3]]


def test_replay_modes_and_bad_routing_are_one_line_user_errors() -> None:
    from hybridflow.errors import UserError
    from hybridflow.training.megatron_replay import check_mode, replay_indices

    assert check_mode("rollout", True, "actor") and not check_mode("rollout", False, "actor")
    assert not check_mode("off", True, "actor")
    with pytest.raises(UserError, match="actor.router_replay=recompute is not implemented for strategy=megatron"):
        check_mode("recompute", True, "actor")
    with pytest.raises(UserError, match="expected one of off | rollout | recompute"):
        check_mode("always", True, "actor")
    routed = torch.full((1, 2, 1, 2), 8, dtype=torch.int16)
    order, attended = torch.tensor([[0, 1]]), torch.tensor([[True, True]])
    with pytest.raises(UserError, match=r"expert id outside \[0, 8\)"):
        replay_indices(routed, order, attended, range(1), num_experts=8)
    with pytest.raises(UserError, match="layers >= 2"):
        replay_indices(routed, order, attended, range(2), num_experts=8)
