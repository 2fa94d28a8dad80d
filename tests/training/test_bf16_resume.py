"""Exact resume in bf16 at engine level, on 2 gloo ranks (dp=2): 2 optimizer steps, save, a fresh engine loads the
checkpoint and takes 2 more steps; its weights, optimizer state (Adam moments and step, and for megatron the fp32
main copies of the bf16 weights, each rank its dp shard) and losses equal those of the same engine's 4 uninterrupted
steps bit for bit. For ``megatron`` (distributed optimizer, fp32 main params) and ``fsdp2`` (sharded and
replicated: AdamW directly on the bf16 weights). And a megatron checkpoint written before the main params were
saved still loads, its main params rebuilt from the bf16 weights."""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from omegaconf import OmegaConf

from hybridflow.config.schema import OptimConfig
from hybridflow.distributed.launch import spawn_ranks
from hybridflow.protocol import DataProto
from hybridflow.training import EngineSpec, ParallelLayout, get_engine_class
from tests.helpers.models import tiny_model

V, P, R = 64, 4, 3  # vocab, prompt tokens, response tokens
CASES = (("megatron", "auto"), ("fsdp2", -1), ("fsdp2", 1))  # (strategy, fsdp_size)


def _micro(rank: int, step: int) -> DataProto:
    """2 sequences of rank ``rank``'s data at ``step`` (a different batch every step)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(1, V, (2, P + R), generator=g)
    mask = torch.ones(2, P + R, dtype=torch.long)
    mask[1, :2] = 0  # left padding in one row
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask,
                                        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0), "responses": ids[:, P:]})


def _engine(strategy: str, fsdp_size, path: str):
    model = OmegaConf.create({"path": path, "dtype": "bfloat16", "trust_remote_code": False,
                              "enable_gradient_checkpointing": False})
    optim = OmegaConf.structured(OptimConfig)
    optim.lr, optim.weight_decay, optim.lr_scheduler_type = 1e-2, 0.01, "cosine"  # lr changes every step
    return get_engine_class(strategy).build(EngineSpec(
        kind="policy", model=model, layout=ParallelLayout(dp=2), device="cpu", optim=optim, total_steps=4,
        grad_clip=1.0, fsdp_size=fsdp_size))


def _step(engine, rank: int, step: int) -> torch.Tensor:
    engine.set_train(True)
    engine.zero_grad()
    loss = engine.forward_backward_micro_batches([_micro(rank, step)], [lambda out: -out["log_probs"].mean()])[0]
    engine.optimizer_step()
    engine.lr_scheduler_step()
    return loss


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _state(engine) -> dict:
    """This rank's weights (local shards), inner optimizer state and, for megatron, fp32 main parameters."""
    opts = getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
    inner = [getattr(opt, "optimizer", opt) for opt in opts]
    state = {"weights": {k: _local(v).clone() for k, v in engine.iter_shards()},
             "optim": [{i: {k: _local(v).clone() for k, v in s.items()} for i, s in o.state_dict()["state"].items()}
                       for o in inner]}
    if hasattr(opts[0], "shard_fp32_from_float16_groups"):
        state["main"] = [p.clone() for opt in opts for g in opt.shard_fp32_from_float16_groups for p in g]
    return state


def _load_without_main_params(ckpt: str, root: str, rank: int) -> list:
    """Load a megatron checkpoint as written before the fp32 main params were saved (the key removed); returns the
    main params the fresh engine then holds."""
    old = os.path.join(root, "ckpt_old")
    os.makedirs(old, exist_ok=True)
    name = f"megatron_rank_{rank}.pt"
    state = torch.load(os.path.join(ckpt, name), weights_only=True)
    del state["main_params"]
    torch.save(state, os.path.join(old, name))
    engine = _engine("megatron", "auto", os.path.join(root, "model"))
    engine.load_checkpoint(old)
    return _state(engine)["main"]


def _worker(rank: int, root: str) -> None:
    from megatron.core import parallel_state

    results = {}
    for strategy, fsdp_size in CASES:
        ckpt = os.path.join(root, f"ckpt_{strategy}_{fsdp_size}")
        full = _engine(strategy, fsdp_size, os.path.join(root, "model"))
        losses = [_step(full, rank, s) for s in range(2)]
        full.save_checkpoint(ckpt, extra={"step": 2})
        at_save = _state(full)
        losses += [_step(full, rank, s) for s in range(2, 4)]
        resumed = _engine(strategy, fsdp_size, os.path.join(root, "model"))
        extra = resumed.load_checkpoint(ckpt)
        loaded = _state(resumed)
        resumed_losses = [_step(resumed, rank, s) for s in range(2, 4)]
        results[strategy, fsdp_size] = {"full": _state(full), "resumed": _state(resumed), "at_save": at_save,
                                        "loaded": loaded, "losses": losses, "resumed_losses": resumed_losses,
                                        "extra": extra, "dtype": next(iter(at_save["weights"].values())).dtype}
        if strategy == "megatron":
            results["old_format"] = _load_without_main_params(ckpt, root, rank)
            parallel_state.destroy_model_parallel()
    torch.save(results, os.path.join(root, f"res.{rank}"))


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list:
    pytest.importorskip("megatron.core")
    root = str(tmp_path_factory.mktemp("bf16_resume"))
    tiny_model(transformers.LlamaForCausalLM, num_attention_heads=4, num_key_value_heads=2).save_pretrained(
        os.path.join(root, "model"))
    spawn_ranks(_worker, root, world=2)
    return [torch.load(os.path.join(root, f"res.{r}"), weights_only=False) for r in range(2)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-fsdp_size{c[1]}")
def test_bf16_two_plus_two_steps_equal_four(case, results) -> None:
    for rank, per_rank in enumerate(results):
        res = per_rank[case]
        assert res["dtype"] == torch.bfloat16 and res["extra"] == {"step": 2}
        assert _equal(res["loaded"], res["at_save"]), (case, rank)  # the load restores everything saved
        assert not _equal(res["full"]["weights"], res["at_save"]["weights"]), (case, rank)  # steps 3-4 moved it
        assert _equal(res["resumed"], res["full"]), (case, rank)  # weights, Adam state, main params: bit-exact
        assert _equal(res["resumed_losses"], res["losses"][2:]), (case, rank)
        if case[0] == "megatron":  # fp32 main params hold what bf16 cannot: dropping them would show
            main = torch.cat([p.flatten() for p in res["full"]["main"]])
            assert main.dtype == torch.float32 and not torch.equal(main, main.bfloat16().float()), rank


def test_a_megatron_checkpoint_without_main_params_rebuilds_them_from_the_weights(results) -> None:
    """The bf16 weights saved are the main params rounded to bf16 (the optimizer writes them back so): a load
    without main params gives exactly that rounding of the saved ones."""
    for rank, per_rank in enumerate(results):
        saved = per_rank["megatron", "auto"]["at_save"]["main"]
        assert _equal(per_rank["old_format"], [p.bfloat16().float() for p in saved]), rank
        assert not _equal(per_rank["old_format"], saved), rank  # the rounding shows: not the exact resume
