"""LoRA with the async driver: the weight push carries the adapters only when the generators take them (hf or
vllm with ``lora_sync=adapter``; an int8 generator gets merged weights), plus the trainer's sync probe, which
every generator checks after loading a push (``sync/verified``); a generator whose load does nothing fails."""

import os

import pytest
import torch

pytest.importorskip("peft")

from hybridflow.config import load_config  # noqa: E402
from hybridflow.distributed.launch import spawn_ranks  # noqa: E402
from hybridflow.models import lora as lora_lib  # noqa: E402
from hybridflow.models import lora_sync  # noqa: E402
from hybridflow.models.hf import load_causal_lm  # noqa: E402
from hybridflow.protocol import DataProto  # noqa: E402
from hybridflow.trainer.worker_inputs import rollout_lora_adapters  # noqa: E402
from hybridflow.utils.metrics import finalize  # noqa: E402

LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"]
ASYNC = ["trainer.total_training_steps=3", "trainer.save_freq=-1", "trainer.test_freq=-1",
         "trainer.val_before_train=false", "trainer.logger=[jsonl]", "data.train_batch_size=8",
         "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
         "async_training.max_staleness=0", "actor_rollout_ref.actor.optim.lr=2e-3"]


def test_payload_is_adapters_only_where_the_generator_takes_them():
    def takes(*overrides):
        return rollout_lora_adapters(load_config("async_grpo_quickstart", LORA + list(overrides)))

    assert takes("actor_rollout_ref.rollout.lora_sync=adapter")
    assert takes("actor_rollout_ref.rollout.lora_sync=adapter", "actor_rollout_ref.rollout.name=vllm")
    assert not takes("actor_rollout_ref.rollout.lora_sync=merged")
    # int8 generators re-quantize full weights: they get merged weights whatever lora_sync says
    assert not takes("actor_rollout_ref.rollout.lora_sync=adapter", "async_training.generator_quantization=int8")


def _adapter_bytes(rank: int) -> int:
    """fp32 bytes of A (r, in) and B (out, r) on every Linear but the output head of the base architecture."""
    base = load_causal_lm("builtin:tiny-arith", torch.float32)
    return sum(4 * rank * (m.in_features + m.out_features) for name, m in base.named_modules()
               if isinstance(m, torch.nn.Linear) and name != "lm_head")


@pytest.mark.slow
def test_async_lora_pushes_adapters_and_generators_verify(ray_session, tmp_path):
    import json

    from hybridflow.trainer.main import run_ppo

    # 2 trainer ranks (FSDP2: every rank gathers and runs the probe's forward, rank 0 sends), 1 generator
    run_ppo(load_config("async_grpo_quickstart", ASYNC + LORA + [
        "resource_pool.pools={trainer: [2], generator: [1]}", "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.rollout.lora_sync=adapter", f"trainer.default_local_dir={tmp_path}"]))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    probe_bytes = 4 * lora_lib.PROBE_LENGTH
    assert all(r["sync/weight_transfer_bytes"] == _adapter_bytes(8) + probe_bytes for r in rows)
    # step 1 trains on samples of the initial weights; steps 2 and 3 on samples generated after a checked push
    assert "sync/verified" not in rows[0]
    assert all(r["sync/verified"] == 1.0 and r["sync/probe_max_abs_diff"] <= 1e-4 for r in rows[1:])
    assert rows[1]["sync/probe_logprob_sum"] != rows[2]["sync/probe_logprob_sum"]  # a new policy each push


def _generator_rank(rank: int, backend: str, out: str) -> None:
    """One generator rank (adapter payload): a checked push, then a push whose load does nothing."""
    from hybridflow.trainer.worker_inputs import generator_args
    from hybridflow.workers.generator_worker import GeneratorWorker

    if backend == "vllm":
        from hybridflow.rollout.vllm_rollout import VLLMRollout as Rollout
    else:
        from hybridflow.rollout.hf_rollout import HFRollout as Rollout
    cfg = load_config("async_grpo_quickstart", LORA + ["actor_rollout_ref.rollout.lora_sync=adapter",
                                                       f"actor_rollout_ref.rollout.name={backend}",
                                                       "data.max_response_length=4"])
    worker = GeneratorWorker(*generator_args(cfg, total_steps=0))
    worker.init_model()
    prompts = DataProto.from_dict(tensors={"input_ids": torch.tensor([[5, 9, 13, 20]]),
                                           "attention_mask": torch.ones(1, 4, dtype=torch.long),
                                           "position_ids": torch.arange(4)[None]})
    result = {}
    for version in (1, 2):
        trainer = lora_lib.apply_lora(load_causal_lm("builtin:tiny-arith", torch.float32), cfg.actor_rollout_ref.model)
        with torch.no_grad():  # a trained policy: B != 0
            for name, param in trainer.named_parameters():
                if ".lora_B." in name:
                    param.normal_(0, 0.05, generator=torch.Generator().manual_seed(version))
        pushed = [*lora_lib.adapter_items(trainer.state_dict().items()), lora_sync.probe_entry(trainer)]
        worker._staged, worker._probe = lora_sync.split_probe(pushed)
        worker._staged = (version, worker._staged)
        if version == 2:
            Rollout.load_weights = lambda self, weights: None  # the push never reaches the model
        try:
            # a rank's own output declares the kinds the controller pools over ranks: one rank's values
            result[version] = finalize(worker.generate_sequences(prompts).meta_info["sync_metrics"])
        except RuntimeError as exc:
            result[version] = str(exc)
    if backend == "vllm":
        worker.rollout.close()
    torch.save(result, os.path.join(out, "result.pt"))


@pytest.mark.parametrize("backend", ["hf", pytest.param("vllm", marks=pytest.mark.slow)])
def test_generator_checks_each_push_and_a_lost_push_fails(tmp_path, backend):
    if backend == "vllm":
        pytest.importorskip("vllm")
    spawn_ranks(_generator_rank, backend, str(tmp_path), world=1, init_group=False)  # the worker starts the group
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    assert result[1]["sync/verified"] == 1.0
    assert result[1]["sync/probe_max_abs_diff"] <= (1e-5 if backend == "hf" else 1e-4)
    assert "LoRA weight sync failed: the generator (rank 0)" in result[2]
