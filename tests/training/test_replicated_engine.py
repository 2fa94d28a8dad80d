"""The fsdp2 engine replicated over dp (``fsdp_config.fsdp_size=1``) against the same engine sharded with FSDP2, on
2 gloo ranks with a different micro-batch per rank: the same weights after two optimizer steps (the all-reduced
mean equals FSDP2's reduce-scatter mean), and checkpoints that load across the two layouts (a resume where the
``auto`` choice changed). Also: bf16 autocast for a replicated model over fp32 weights."""

from __future__ import annotations

import os

import torch

from hybridflow.distributed.launch import spawn_ranks
from hybridflow.config.schema import OptimConfig
from hybridflow.distributed import apply_fsdp2, build_mesh
from hybridflow.protocol import DataProto
from hybridflow.training import FSDP2Engine
from hybridflow.training.optim import build_optimizer
from test_engine_contract import P, R, V, _model


def _micro(rank: int) -> DataProto:
    g = torch.Generator().manual_seed(10 + rank)
    ids = torch.randint(0, V, (3, P + R), generator=g)
    mask = torch.ones(3, P + R, dtype=torch.long)
    mask[0, 0] = 0  # one left-padded prompt
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask,
                                        "position_ids": (mask.cumsum(1) - 1).clamp(min=0), "responses": ids[:, P:]})


def _engine(replicated: bool) -> FSDP2Engine:
    mesh = build_mesh(dp=2)
    model = _model() if replicated else apply_fsdp2(_model(), mesh)
    return FSDP2Engine.from_module(model, build_optimizer(model, OptimConfig(lr=0.05)), mesh=mesh,
                                   replicated=replicated)


def _train(engine: FSDP2Engine, rank: int) -> dict[str, torch.Tensor]:
    for step in range(2):
        engine.set_train(True)
        engine.zero_grad()
        engine.forward_backward(_micro(rank + 2 * step), lambda o: -o["log_probs"].mean())
        engine.optimizer_step()
    return {k: v.clone() for k, v in engine.iter_weights()}


def _logprobs(engine: FSDP2Engine) -> torch.Tensor:
    with torch.no_grad():
        return engine.forward(_micro(7))["log_probs"]


def _rank(rank: int, out: str) -> None:
    sharded, replicated = _engine(False), _engine(True)
    result = {"sharded": _train(sharded, rank), "replicated": _train(replicated, rank),
              "fused": replicated.optimizer.defaults.get("fused"), "specs": replicated.weight_specs()}
    # checkpoints across the layouts: replicated -> a fresh sharded engine, sharded -> a fresh replicated one
    replicated.save_checkpoint(os.path.join(out, "from_replicated"))
    sharded.save_checkpoint(os.path.join(out, "from_sharded"))
    into_sharded, into_replicated = _engine(False), _engine(True)
    into_sharded.load_checkpoint(os.path.join(out, "from_replicated"))
    into_replicated.load_checkpoint(os.path.join(out, "from_sharded"))
    result.update(saved=_logprobs(replicated), into_sharded=_logprobs(into_sharded),
                  into_replicated=_logprobs(into_replicated), before=_logprobs(_engine(True)))
    torch.save(result, os.path.join(out, f"r{rank}.pt"))


def test_replicated_training_equals_sharded_and_checkpoints_cross_layouts(tmp_path):
    spawn_ranks(_rank, str(tmp_path))
    for rank in (0, 1):
        res = torch.load(tmp_path / f"r{rank}.pt", weights_only=False)
        assert res["fused"] is True  # plain tensors: the fused AdamW kernel
        assert all(spec.dp_dim is None for spec in res["specs"].values())  # the resharder sees whole tensors
        assert res["sharded"].keys() == res["replicated"].keys()
        for name, weight in res["sharded"].items():
            torch.testing.assert_close(res["replicated"][name], weight, rtol=0, atol=2e-6, msg=name)
        assert (res["saved"] - res["before"]).abs().max() > 1e-3  # the steps moved the policy
        torch.testing.assert_close(res["into_sharded"], res["saved"], rtol=0, atol=2e-6)
        torch.testing.assert_close(res["into_replicated"], res["saved"], rtol=0, atol=2e-6)


def test_autocast_computes_in_bf16_over_fp32_weights():
    model = _model()
    engine = FSDP2Engine.from_module(model, build_optimizer(model, OptimConfig(lr=0.05)))
    mixed = FSDP2Engine.from_module(_model(), None, replicated=True)
    mixed.autocast_dtype = torch.bfloat16
    micro = _micro(0)
    seen = []
    hook = mixed.module.lm_head.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    ref, got = engine.forward(micro)["log_probs"], mixed.forward(micro)["log_probs"]
    hook.remove()
    assert seen == [torch.bfloat16] and got.dtype == torch.float32  # bf16 matmul, fp32 logprob math
    assert next(mixed.module.parameters()).dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=0, atol=0.05)  # bf16 rounding, not a different computation
