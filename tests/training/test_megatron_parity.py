"""The megatron engine on 4 gloo ranks against the fsdp2 engine (one process, the same HF weights and batch): one
PPO actor update and one critic update at (tp=2, pp=2, dp=1) and (tp=1, pp=2, dp=2) give the same loss and the
same post-update logprobs / values (fp32, max abs diff <= 1e-5); the gathered weights equal the reference's; the
shard iterator gives the HF tp-shards; a checkpoint round trip resumes exactly."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import transformers
from omegaconf import OmegaConf

pytest.importorskip("megatron.core")

from hybridflow.algorithms.sampling import SamplingSpec
from hybridflow.config.schema import ActorConfig, CriticConfig, OptimConfig
from hybridflow.protocol import DataProto
from hybridflow.training import EngineSpec, FSDP2Engine, ParallelLayout, get_engine_class
from hybridflow.training.optim import build_lr_scheduler, build_optimizer
from hybridflow.workers.ppo_actor import PPOActor
from hybridflow.workers.ppo_critic import PPOCritic
from hybridflow.distributed.launch import spawn_ranks
from tests.helpers.models import tiny_model

V, P, R = 64, 5, 4
PROMPT_LENS, RESPONSE_LENS = (5, 3, 4, 2), (4, 2, 3, 1)
LR = 1e-2
LAYOUTS = ((2, 2), (1, 2))  # (tp, pp) on 4 ranks: dp=1 and dp=2
ARCH = dict(num_attention_heads=4, num_key_value_heads=2, hidden_size=32, num_hidden_layers=2)


def _batch() -> DataProto:
    g = torch.Generator().manual_seed(1)
    B = len(PROMPT_LENS)
    ids = torch.randint(1, V, (B, P + R), generator=g)
    mask = torch.zeros(B, P + R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS)):
        mask[i, P - p: P + r] = 1
    return DataProto.from_dict(tensors={
        "input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "responses": ids[:, P:], "response_mask": mask[:, P:].clone(), "advantages": torch.randn(B, R, generator=g),
        "old_log_probs": -torch.rand(B, R, generator=g) * 3, "returns": torch.randn(B, R, generator=g),
        "values": torch.randn(B, R, generator=g)})


def _cfgs():
    actor = OmegaConf.structured(ActorConfig)
    actor.ppo_micro_batch_size_per_gpu, actor.grad_clip, actor.entropy_coeff = 1, 1.0, 0.01
    critic = OmegaConf.structured(CriticConfig)
    critic.ppo_micro_batch_size_per_gpu, critic.grad_clip = 1, 1.0
    optim = OmegaConf.structured(OptimConfig)
    optim.lr, optim.weight_decay = LR, 0.01
    return actor, critic, optim


def _update(role: str, engine, data: DataProto) -> tuple[dict, torch.Tensor]:
    """(metrics of one update on ``data``, logprobs / values after it)."""
    actor, critic, _ = _cfgs()
    if role != "critic":
        worker = PPOActor(engine, None, actor, SamplingSpec())
        metrics = worker.update_policy(data, mini_batch_size=len(data))
        return metrics, worker.compute_log_prob(data, 1)[0]
    worker = PPOCritic(engine, None, critic)
    metrics = worker.update_critic(data, mini_batch_size=len(data))
    return metrics, worker.compute_values(data, 1)


def _reference(path: str, role: str) -> tuple[dict, torch.Tensor, dict]:
    """The fsdp2 engine over the plain HF module (one process, the whole batch)."""
    from hybridflow.models import hf

    # the loaders the engines use (the value model's dropout off)
    model = (hf.load_value_model if role == "critic" else hf.load_causal_lm)(path, torch.float32)
    _, _, optim = _cfgs()
    opt = build_optimizer(model, optim)
    engine = FSDP2Engine.from_module(model, opt, kind="value" if role == "critic" else "policy", grad_clip=1.0,
                                     lr_scheduler=build_lr_scheduler(opt, optim, 1), role=role)
    metrics, out = _update(role, engine, _batch())
    return metrics, out, {k: v.detach().clone() for k, v in model.named_parameters()}


def _engine(root: str, role: str, layout: ParallelLayout):
    _, _, optim = _cfgs()
    model_cfg = OmegaConf.create({"path": os.path.join(root, role), "dtype": "float32", "trust_remote_code": False,
                                  "enable_gradient_checkpointing": False})
    return get_engine_class("megatron").build(EngineSpec(
        kind="value" if role == "critic" else "policy", model=model_cfg, layout=layout, device="cpu", optim=optim,
        total_steps=4, grad_clip=1.0, role=role))


def _resume_is_exact(root: str, layout: ParallelLayout, data: DataProto) -> tuple[bool, torch.Tensor]:
    """update, save (as a trainer checkpoint's ``actor/``), update (A); load, update (B): A and B are bit-identical
    weights, and a NaN step after them is skipped. Also returns the engine's logprobs of ``data`` at the save (for the export test)."""
    engine = _engine(root, "actor", layout)
    _, saved_logprobs = _update("actor", engine, data)
    ckpt = os.path.join(root, "ckpt", "actor")
    engine.save_checkpoint(ckpt, extra={"step": 1})
    if dist.get_rank() == 0:  # what the actor worker adds for `hybridflow export`
        from hybridflow.models.hf import load_tokenizer

        engine.module.config.save_pretrained(os.path.join(ckpt, "hf"))
        load_tokenizer("builtin:tiny-arith").save_pretrained(os.path.join(ckpt, "hf"))
    _update("actor", engine, data)
    after = [v.clone() for _, v in engine.iter_shards()]
    assert engine.load_checkpoint(ckpt) == {"step": 1}
    _update("actor", engine, data)
    exact = all(torch.equal(a, b) for a, (_, b) in zip(after, engine.iter_shards()))
    return exact and _nan_step_is_skipped(engine, data), saved_logprobs


def _nan_step_is_skipped(engine, data: DataProto) -> bool:
    """A NaN loss: the step is skipped and counted, weights unchanged (trainer.nonfinite_grad=skip)."""
    before = [v.clone() for _, v in engine.iter_shards()]
    engine.zero_grad()
    engine.forward_backward_micro_batches([data.split(1)[0]], [lambda out: out["log_probs"].sum() * float("nan")])
    grad_norm, skipped = engine.optimizer_step()
    unchanged = all(torch.equal(a, b) for a, (_, b) in zip(before, engine.iter_shards()))
    return skipped and grad_norm != grad_norm and engine.skipped_steps == 1 and unchanged


def _worker(rank: int, root: str) -> None:
    from megatron.core import parallel_state

    results = {}
    for tp, pp in LAYOUTS:  # one spawn for both layouts (process start-up dominates on 2 cores)
        layout = ParallelLayout(dp=4 // (tp * pp), tp=tp, pp=pp)
        data = _batch().chunk(layout.dp)[layout.coords(rank)[0]]
        for role in ("actor", "critic"):
            engine = _engine(root, role, layout)
            metrics, out = _update(role, engine, data)
            weights = {k: v.clone() for k, v in engine.iter_weights()}
            shards = {k: v.clone() for k, v in engine.iter_shards()}
            results[tp, pp, role] = (metrics, out, weights, shards, engine.weight_specs())
        if (tp, pp) == LAYOUTS[-1]:
            results["resume"] = _resume_is_exact(root, layout, data)
            # tied embeddings over 2 stages: the output copy on the last stage, grads summed across stages
            metrics, out = _update("actor_tied", _engine(root, "actor_tied", layout), data)
            results["tied"] = (metrics, out)
        parallel_state.destroy_model_parallel()
    torch.save(results, os.path.join(root, f"res.{rank}"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("megatron_parity"))
    tiny_model(transformers.LlamaForCausalLM, **ARCH).save_pretrained(os.path.join(root, "actor"))
    value = tiny_model(transformers.LlamaForTokenClassification, num_labels=1, **ARCH)
    value.save_pretrained(os.path.join(root, "critic"))
    tiny_model(transformers.LlamaForCausalLM, tie_word_embeddings=True, **ARCH).save_pretrained(
        os.path.join(root, "actor_tied"))
    refs = {role: _reference(os.path.join(root, role), role) for role in ("actor", "critic", "actor_tied")}
    return root, refs


@pytest.mark.slow
def test_megatron_updates_equal_fsdp2_and_resume_exactly(checkpoints) -> None:
    """Loss, grad norm and post-update logprobs / values within 1e-5 of fsdp2; weights within 1e-4 (1% of the
    lr: AdamW's first step is about lr * g/|g|, so elements whose gradient is near eps amplify the fp32
    summation-order differences of tp/pp); HF tp-shards equal slices of the gathered weights."""
    root, refs = checkpoints
    spawn_ranks(_worker, root, world=4)
    per_rank = [torch.load(os.path.join(root, f"res.{r}"), weights_only=False) for r in range(4)]
    mask = _batch().batch["response_mask"].bool()
    assert all(res["resume"][0] for res in per_rank)
    _check_export(root, per_rank)
    tied_metrics, tied_out, _ = refs["actor_tied"]
    for rank, res in enumerate(per_rank):
        metrics, out = res["tied"]
        assert abs(metrics["actor/pg_loss"] - tied_metrics["actor/pg_loss"]) <= 1e-5, rank
        dp_rank = ParallelLayout(dp=2, tp=1, pp=2).coords(rank)[0]
        rows = mask.chunk(2)[dp_rank]
        assert (out[rows] - tied_out.chunk(2)[dp_rank][rows]).abs().max() <= 1e-5, rank
    for tp, pp in LAYOUTS:
        layout = ParallelLayout(dp=4 // (tp * pp), tp=tp, pp=pp)
        for role, loss_key in (("actor", "actor/pg_loss"), ("critic", "critic/vf_loss")):
            ref_metrics, ref_out, ref_weights = refs[role]
            for rank, res in enumerate(per_rank):
                _check_rank(res[tp, pp, role], (ref_metrics, ref_out, ref_weights), layout, rank, role, loss_key,
                            mask)


def _check_rank(res, ref, layout: ParallelLayout, rank: int, role: str, loss_key: str, mask: torch.Tensor) -> None:
    metrics, out, weights, shards, specs = res
    ref_metrics, ref_out, ref_weights = ref
    where = (layout, role, rank)
    assert abs(metrics[loss_key] - ref_metrics[loss_key]) <= 1e-5, (where, metrics[loss_key], ref_metrics[loss_key])
    assert abs(metrics[f"{role}/grad_norm"] - ref_metrics[f"{role}/grad_norm"]) <= 1e-5, where
    dp_rank, tp_rank, pp_rank = layout.coords(rank)
    rows = mask.chunk(layout.dp)[dp_rank]
    diff = (out[rows] - ref_out.chunk(layout.dp)[dp_rank][rows]).abs().max()
    assert diff <= 1e-5, (where, float(diff))
    assert list(specs) == list(ref_weights)
    for name, want in ref_weights.items():
        assert (weights[name] - want).abs().max() <= 1e-4, (where, name)
        spec = specs[name]
        assert spec.dp_dim is None and spec.shape == tuple(want.shape)
        if spec.pp_stage != pp_rank:
            assert name not in shards
            continue
        full = weights[name]
        assert torch.equal(shards[name], full if spec.tp_dim is None else full.chunk(layout.tp, spec.tp_dim)[tp_rank])


def _check_export(root: str, per_rank: list) -> None:
    """``hybridflow export`` of the megatron checkpoint (tp=1, pp=2, dp=2): an HF directory whose logprobs equal
    the engine's at the save, on each dp rank's rows."""
    from hybridflow.models.export import export_checkpoint

    out = export_checkpoint(os.path.join(root, "ckpt"), os.path.join(root, "exported"))
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    data = _batch()
    b = data.batch
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"]).logits[:, P - 1:-1]
    logprobs = torch.log_softmax(logits.float(), -1).gather(-1, b["responses"][..., None]).squeeze(-1)
    layout = ParallelLayout(dp=2, tp=1, pp=2)
    mask = b["response_mask"].bool()
    for rank, res in enumerate(per_rank):
        dp_rank = layout.coords(rank)[0]
        rows = mask.chunk(2)[dp_rank]
        diff = (res["resume"][1][rows] - logprobs.chunk(2)[dp_rank][rows]).abs().max()
        assert diff <= 1e-5, (rank, float(diff))
