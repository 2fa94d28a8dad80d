"""LoRA with the vllm rollout in the actor worker (2 gloo ranks, FSDP2, one in-process vLLM engine per rank; the
real ``ActorRolloutRefWorker``, methods called directly on each rank), for ``lora_sync=adapter`` (a vLLM LoRA
adapter) and ``merged`` (W + s B A loaded in place).

After one update: vLLM's greedy tokens equal those of an hf rollout built independently from the trainer's
merged weights (plain ``LlamaForCausalLM`` + ``load_state_dict``), vLLM's logprobs equal the trainer's
recomputation, the sync payload differs from step 0's and the engine's probe moved with the trainer's. A sync
turned into a no-op (``VLLMRollout.load_weights`` doing nothing) fails the next generation.
"""

import os

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("vllm")

from hybridflow.distributed.launch import spawn_ranks  # noqa: E402
from helpers.lora_ranks import P, R, WORLD, lora_config, response_batch, train_batch  # noqa: E402
from helpers.lora_ranks import prompts as _prompts  # noqa: E402
from hybridflow.protocol import DataProto  # noqa: E402
from hybridflow.utils.metrics import finalize  # noqa: E402

pytestmark = pytest.mark.slow


def _config(sync: str):
    return lora_config(sync, "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.model.dtype=float32")


def _train(worker, gen: DataProto, step: int) -> None:
    worker.update_actor(train_batch(worker, gen, step))


def _state(worker) -> tuple[dict, dict, torch.Tensor]:
    """(sync payload, merged full state, trainer probe (1, L)) of the actor now; every rank takes part."""
    from hybridflow.distributed import iter_full_state
    from hybridflow.models import lora as lora_lib

    payload = {k: v.clone() for k, v in worker._rollout_weights()}
    scale = lora_lib.lora_scaling(worker.actor.module.peft_config["default"])
    merged = {k: v.clone() for k, v in lora_lib.merge_lora_stream(iter_full_state(worker.actor.module), scale)}
    module = worker.actor.module
    probe = lora_lib.greedy_logprobs(module, lora_lib.probe_ids(module.config.vocab_size, "cpu"))[1]
    return payload, merged, probe


def _rank(rank: int, sync: str, out: str) -> None:
    from hybridflow.models import lora_sync
    from hybridflow.rollout.vllm_rollout import VLLMRollout
    from hybridflow.workers.actor_worker import ActorRolloutRefWorker

    from hybridflow.trainer.worker_inputs import actor_args

    worker = ActorRolloutRefWorker(*actor_args(_config(sync), total_steps=4))
    worker.init_model()
    vocab = worker.actor.module.config.vocab_size
    res = {"engine_lora": worker.rollout._adapter is not None}
    res["payload0"], _, res["trainer_probe0"] = _state(worker)
    res["engine_probe0"] = lora_sync.rollout_probe(worker.rollout, vocab)
    prompts = _prompts()
    _train(worker, worker.generate_sequences(prompts), step=0)
    gen1 = worker.generate_sequences(prompts)  # syncs and verifies
    res["sync"] = finalize(gen1.meta_info["sync_metrics"])  # one rank's: the kinds the controller pools
    res["engine_probe1"] = lora_sync.rollout_probe(worker.rollout, vocab)
    res["payload1"], res["merged1"], res["trainer_probe1"] = _state(worker)
    res["trainer_lp1"] = worker.compute_log_prob(response_batch(gen1)).batch["old_log_probs"]
    res["gen1"] = {k: gen1.batch[k] for k in ("responses", "rollout_log_probs", "response_mask")}
    # a sync that delivers nothing: the next generation after an update must fail
    _train(worker, gen1, step=1)
    VLLMRollout.load_weights = lambda self, weights: [None for _ in weights]  # consumes (gathers), loads nothing
    try:
        worker.generate_sequences(prompts)
    except RuntimeError as exc:
        res["noop_error"] = str(exc)
    worker.rollout.close()
    if rank == 0:
        torch.save(res, os.path.join(out, "rank0.pt"))


def _hf_greedy(merged: dict) -> DataProto:
    """Greedy responses of an hf rollout over the base architecture with the trainer's merged weights."""
    from transformers import AutoModelForCausalLM

    from hybridflow.models.builtin import resolve_model_path
    from hybridflow.rollout import HFRollout
    from hybridflow.workers.actor_worker import make_rollout_config

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("builtin:tiny-arith"), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(merged, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    cfg = _config("merged")
    rollout_cfg = make_rollout_config(cfg.actor_rollout_ref.rollout, cfg.data.max_response_length)
    rollout = HFRollout(model.eval(), rollout_cfg, eos_token_id=2, pad_token_id=0)
    return rollout.generate_sequences(_prompts())


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_lora_vllm_sync_verified_and_equal_to_hf(tmp_path, sync):
    spawn_ranks(_rank, sync, str(tmp_path), world=WORLD, init_group=False)
    res = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert res["engine_lora"] == (sync == "adapter")  # the engine holds a LoRA adapter only for adapter sync
    # the payload: adapters only (peft names) or the base model's names; it changed with the update
    names = set(res["payload1"])
    if sync == "adapter":
        assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    else:
        assert not any("lora_" in n for n in names) and "model.layers.0.self_attn.q_proj.weight" in names
    assert names == set(res["payload0"])
    assert max(float((res["payload1"][n] - res["payload0"][n]).abs().max()) for n in names) > 1e-3
    # the engine's probe (cut to its context, P + R - 1 tokens) equals the trainer's before and after, and it
    # moved with the update
    assert res["engine_probe0"].shape == (1, P + R - 1)
    for step in ("0", "1"):
        assert (res[f"engine_probe{step}"] - res[f"trainer_probe{step}"][:, : P + R - 1]).abs().max() <= 1e-4
    assert (res["engine_probe1"] - res["engine_probe0"]).abs().max() > 1e-3
    assert res["sync"]["sync/verified"] == 1.0 and res["sync"]["sync/probe_max_abs_diff"] <= 1e-4
    # vLLM's greedy tokens equal the hf rollout's on the trainer's merged weights; its logprobs the trainer's
    hf = _hf_greedy(res["merged1"])
    assert torch.equal(res["gen1"]["responses"], hf.batch["responses"])
    mask = res["gen1"]["response_mask"].bool()
    assert (res["gen1"]["rollout_log_probs"] - res["trainer_lp1"])[mask].abs().max() <= 1e-4
    # a no-op sync is caught at the next generation: by the probe, or (merged: the rollout slept at level 2 and
    # discarded its weights) already by the wake guard that finds parameters not reloaded
    error = res.get("noop_error", "")
    assert "LoRA weight sync failed" in error or "were not reloaded" in error, error
