"""Ulysses sequence parallelism (hybridflow/training/ulysses.py) against the same engine without it: on gloo ranks,
the fsdp2 engine with ``sp`` ranks per dp group gives the logprobs, entropies, values, losses and (dp x sp averaged)
gradients of the sp=1 engine run on one rank over every dp group's micro-batch, within 1e-5 in fp32. Covered:
padded and packed (``use_remove_padding``) micro-batches with lengths not divisible by sp, a micro-batch shorter
than sp (2 tokens on 4 ranks), a GQA policy (4 query / 2 KV heads: KV heads split) and a value model with one KV
head (fewer KV heads than sp: repeated). Layouts: sp=2 on 2 ranks; sp=2 x dp=2 and sp=4 on 4 ranks; the model replicated over the ranks (gradients
all-reduced) and, for the packed policy, FSDP2-sharded over all dp x sp ranks (reduce-scatter)."""

from __future__ import annotations

import copy

import pytest
import torch

from torch.distributed.tensor import DTensor

from hybridflow.distributed import apply_fsdp2, build_mesh
from hybridflow.distributed.launch import spawn_ranks
from hybridflow.protocol import DataProto
from hybridflow.models.moe import ROUTING_KEY
from hybridflow.training import FSDP2Engine, ParallelLayout
from hybridflow.training.routing_replay import RECORD_ROUTING

V, TOL = 97, 1e-5
LAYERS, TOP_K, EXPERTS = 2, 2, 8  # the tiny MoE's


def _config(kv_heads: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                       attn_implementation="sdpa")


def _model(kind: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    if kind == "moe":  # 4 query / 2 KV heads (sp=4 splits the query heads)
        from tests.helpers.moe_models import tiny_moe

        return tiny_moe(vocab_size=V, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    if kind == "vlm":
        from tests.helpers.vlm import tiny_vlm

        return tiny_vlm()[0]
    torch.manual_seed(0)
    if kind == "policy":  # GQA: 2 query heads per KV head
        return AutoModelForCausalLM.from_config(_config(2))
    config = _config(1)  # one KV head: fewer than sp, repeated before the split
    config.num_labels = 1
    model = AutoModelForTokenClassification.from_config(config)
    for module in model.modules():  # as hybridflow.models.hf.load_value_model: no dropout on the value head
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def _vlm_micro(seed: int) -> DataProto:
    """3 rows of tests/training/test_vlm_training.py (2, 1 and 0 images; prompts of 17-23 tokens + 5 response
    slots) with the carried mrope positions and per-row pixels, plus random loss ``weights``."""
    from hybridflow.models import vlm
    from tests.helpers.vlm import tiny_tokenizer, tiny_image_processor
    from tests.training.test_vlm_training import _batch, _prompts

    data, _ = _batch(vlm.ImageTextProcessor(tiny_image_processor(), tiny_tokenizer()), _prompts(), seed=seed)
    data.batch["weights"] = torch.randn(data.batch["responses"].shape, generator=torch.Generator().manual_seed(seed))
    return data


def _with_routing(micro: DataProto, seed: int) -> DataProto:
    """``micro`` with a random ``routed_experts`` column (B, L, Ly, k) int16 (k distinct experts per token)."""
    g = torch.Generator().manual_seed(seed)
    shape = (*micro.batch["input_ids"].shape, LAYERS)
    first = torch.randint(0, EXPERTS, shape, generator=g)
    second = (first + torch.randint(1, EXPERTS, shape, generator=g)) % EXPERTS
    micro.batch[ROUTING_KEY] = torch.stack([first, second], dim=-1).to(torch.int16)
    return micro


def _micro(seed: int, short: bool, model: str = "dense") -> DataProto:
    """(3, 5+6) with 11, 5 and 5 valid tokens (left-padded prompts, right-padded responses), or (1, 3+2) with 2;
    ``model``: ``vlm`` an image batch (:func:`_vlm_micro`); ``moe``/``replay`` asks for the forward's routing, and
    ``replay`` adds a ``routed_experts`` column to replay."""
    if model == "vlm":
        return _vlm_micro(seed)
    micro = _text_micro(seed, short)
    if model in ("moe", "replay"):
        micro.meta_info[RECORD_ROUTING] = True
    return _with_routing(micro, seed) if model == "replay" else micro


def _text_micro(seed: int, short: bool) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    if short:
        mask = torch.tensor([[0, 0, 1, 1, 0]])
        prompt = 3
    else:
        mask = torch.tensor([[1] * 11, [0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0]])
        prompt = 5
    ids = torch.randint(1, V, mask.shape, generator=g) * mask
    return DataProto.from_dict(tensors={
        "input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
        "responses": ids[:, prompt:], "response_mask": mask[:, prompt:],
        "weights": torch.randn(mask.shape[0], mask.shape[1] - prompt, generator=g)})


def _loss(micro: DataProto, out: dict[str, torch.Tensor]) -> torch.Tensor:
    """A differentiable function of every output at the response tokens (padding slots masked)."""
    mask, w = micro.batch["response_mask"].float(), micro.batch["weights"]
    if "values" in out:
        return ((out["values"] - w) ** 2 * mask).sum()
    return ((out["log_probs"] * w + 0.1 * out["entropy"]) * mask).sum()


def _engine(model, kind, remove_padding, mesh=None, sp=1, sharded=False) -> FSDP2Engine:
    """sp=1 on one rank (no mesh), or on ``mesh``: replicated (gradients all-reduced) or FSDP2-sharded over it."""
    if sharded:
        model = apply_fsdp2(model, mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # one step: new weight = old - averaged gradient
    return FSDP2Engine.from_module(model, optimizer, kind=kind, mesh=mesh, replicated=mesh is not None and not sharded,
                                   remove_padding=remove_padding, sp=sp, grad_clip=1e9)


def _full(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()


def _compare(kind: str, mine: DataProto, got: dict, want: dict, report: list) -> None:
    """Per-token outputs at the response tokens; a recorded routing at every valid token (mismatch count)."""
    assert set(got) == set(want)
    mask = mine.batch["response_mask"].bool()
    for name in ("log_probs", "entropy", "values"):
        if name in want:
            assert got[name].shape == want[name].shape
            report.append((f"{kind} {name}", float((got[name] - want[name])[mask].abs().max())))
    if ROUTING_KEY in want:  # the rank's own routing gathered over the sp group = the sp=1 forward's
        valid = mine.batch["attention_mask"].bool()
        report.append((f"{kind} routing", float((got[ROUTING_KEY] != want[ROUTING_KEY])[valid].sum())))
        if ROUTING_KEY in mine.batch.keys():  # replayed: every rank routed its slice as the column says
            report.append((f"{kind} replayed", float((got[ROUTING_KEY] != mine.batch[ROUTING_KEY])[valid].sum())))


def _check(rank: int, world: int, sp: int, kind: str, remove_padding: bool, short: bool, report: list,
           sharded: bool = False, model: str = "dense") -> None:
    """``kind``: the engine's; ``model``: dense (the Llama of ``kind``), moe, replay (moe + a routing to replay),
    vlm (2 heads: sp=2 only) or checkpointed (the dense policy with gradient checkpointing)."""
    dp = world // sp
    micros = [_micro(100 * d + int(short), short, model) for d in range(dp)]
    module = _model(kind if model in ("dense", "checkpointed") else "moe" if model == "replay" else model)
    if model == "checkpointed":  # the backward recomputes each layer's forward (attention too) from its inputs
        module.gradient_checkpointing_enable()
    ref = _engine(copy.deepcopy(module), kind, remove_padding)  # sp=1, one rank, every dp group's micro-batch
    engine = _engine(module, kind, remove_padding, build_mesh(dp=world), sp, sharded)
    module = engine.module
    assert engine.layout == ParallelLayout(dp=dp, sp=sp)
    mine = micros[engine.layout.coords(rank)[0]]
    kind = kind if model == "dense" else f"{model} padded={not remove_padding}"
    for e in (engine, ref):
        e.set_train(False)
    with torch.no_grad():
        _compare(kind, mine, engine.forward(mine, entropy=True), ref.forward(mine, entropy=True), report)
    assert module.config._attn_implementation == "hybridflow_ulysses"  # the sp attention ran, not plain sdpa
    before = [_full(p) for p in module.parameters()]
    for e in (engine, ref):
        e.set_train(True)
        e.zero_grad()
    loss = engine.forward_backward(mine, lambda out: _loss(mine, out), entropy=True)
    ref_losses = [ref.forward_backward(m, lambda out, m=m: _loss(m, out) / dp, entropy=True) for m in micros]
    report.append((f"{kind} loss", abs(float(loss) / dp - float(ref_losses[micros.index(mine)]))))
    engine.optimizer_step()  # averages the gradients over the dp x sp ranks, then steps
    grads = [b - _full(p) for b, p in zip(before, module.parameters())]
    report.append((f"{kind} grad", max(float((g - r.grad).abs().max())
                                       for g, r in zip(grads, ref.module.parameters()) if r.grad is not None)))
    assert max(float(r.grad.abs().max()) for r in ref.module.parameters()) > 1e-3  # gradients are not trivially 0


def _ranks(rank: int, layouts: list[int]) -> None:
    world = torch.distributed.get_world_size()
    for sp in layouts:
        report: list = []
        for kind in ("policy", "value"):
            for remove_padding in (False, True):
                for short in (False, True):
                    _check(rank, world, sp, kind, remove_padding, short, report)
        _check(rank, world, sp, "policy", True, False, report, sharded=True)  # FSDP2 shards over dp x sp
        models = ("moe", "replay", "vlm", "checkpointed") if world == 2 else ("moe", "replay") if sp == 2 else ()
        for model in models:
            for remove_padding in (False, True):
                _check(rank, world, sp, "policy", remove_padding, False, report, model=model)
        worst = max(diff for _, diff in report)
        if rank == 0:
            print(f"world={world} sp={sp}: max abs diff {worst:.2e}", flush=True)
            print("\n".join(f"  {name}: {diff:.2e}" for name, diff in report if " padded=" in name), flush=True)
        assert worst <= TOL, [r for r in report if r[1] > TOL]


@pytest.mark.parametrize("world, layouts", [(2, [2]), (4, [2, 4])])
def test_ulysses_equals_sp1(world, layouts):
    spawn_ranks(_ranks, layouts, world=world)


def test_layout_rank_order_and_collectors():
    layout = ParallelLayout(dp=2, sp=2, tp=2)
    assert layout.world == 8
    # tp fastest, then sp, then dp
    assert [layout.coords(r)[0] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [layout.sp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [r for r in range(8) if layout.collects(r)] == [0, 4]
    assert all(layout.rank_of(*[layout.coords(r)[i] for i in (0, 1, 2)], sp_rank=layout.sp_rank(r)) == r
               for r in range(8))
    assert layout.weight_layout() == ParallelLayout(dp=4, tp=2)


@pytest.mark.parametrize("implementation", ["eager", "flash_attention_2"])
def test_other_attention_is_refused_in_one_line_naming_the_key(implementation):
    from transformers import AutoModelForCausalLM

    from hybridflow.training.ulysses import UlyssesAttentionError, check_ulysses_attention

    model = AutoModelForCausalLM.from_config(_config(2))
    model.config._attn_implementation = implementation  # as a model without sdpa support (or a flash kernel) runs
    check_ulysses_attention(model, 1, "critic")  # sp=1: any attention
    with pytest.raises(UlyssesAttentionError) as err:
        check_ulysses_attention(model, 2, "critic")
    assert str(err.value) == ("critic.ulysses_sequence_parallel_size=2: Ulysses sequence parallelism wraps sdpa "
                              f"attention, but the critic model runs attn_implementation='{implementation}' (not "
                              "supported under sp yet)")
    model.config._attn_implementation = "sdpa"
    check_ulysses_attention(model, 2, "actor")
