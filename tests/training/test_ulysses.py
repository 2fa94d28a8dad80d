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
from hybridflow.training import FSDP2Engine, ParallelLayout

V, TOL = 97, 1e-5


def _config(kv_heads: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                       attn_implementation="sdpa")


def _model(kind: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

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


def _micro(seed: int, short: bool) -> DataProto:
    """(3, 5+6) with 11, 5 and 5 valid tokens (left-padded prompts, right-padded responses), or (1, 3+2) with 2."""
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


def _check(rank: int, world: int, sp: int, kind: str, remove_padding: bool, short: bool, report: list,
           sharded: bool = False) -> None:
    dp = world // sp
    micros = [_micro(100 * d + int(short), short) for d in range(dp)]
    model = _model(kind)
    ref = _engine(copy.deepcopy(model), kind, remove_padding)  # sp=1, one rank, every dp group's micro-batch
    engine = _engine(model, kind, remove_padding, build_mesh(dp=world), sp, sharded)
    model = engine.module
    assert engine.layout == ParallelLayout(dp=dp, sp=sp)
    mine = micros[engine.layout.coords(rank)[0]]
    mask = mine.batch["response_mask"].bool()
    for e in (engine, ref):
        e.set_train(False)
    with torch.no_grad():
        got, want = engine.forward(mine, entropy=True), ref.forward(mine, entropy=True)
    assert set(got) == set(want)
    assert model.config._attn_implementation == "hybridflow_ulysses"  # the sp attention ran, not plain sdpa
    for name in got:
        assert got[name].shape == want[name].shape
        report.append((f"{kind} {name}", float((got[name] - want[name])[mask].abs().max())))
    before = [_full(p) for p in model.parameters()]
    for e in (engine, ref):
        e.set_train(True)
        e.zero_grad()
    loss = engine.forward_backward(mine, lambda out: _loss(mine, out), entropy=True)
    ref_losses = [ref.forward_backward(m, lambda out, m=m: _loss(m, out) / dp, entropy=True) for m in micros]
    report.append((f"{kind} loss", abs(float(loss) / dp - float(ref_losses[micros.index(mine)]))))
    engine.optimizer_step()  # averages the gradients over the dp x sp ranks, then steps
    grads = [b - _full(p) for b, p in zip(before, model.parameters())]
    report.append((f"{kind} grad", max(float((g - r.grad).abs().max()) for g, r in zip(grads, ref.module.parameters()))))
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
        worst = max(diff for _, diff in report)
        if rank == 0:
            print(f"world={world} sp={sp}: max abs diff {worst:.2e}", flush=True)
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
