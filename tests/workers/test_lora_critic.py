"""LoRA on the critic (``critic.model.lora_rank``), 2 gloo ranks with FSDP2 (the real ``CriticWorker``, methods
called directly on each rank): only the backbone's adapters and the scalar value head train; before any update
the values equal a separately loaded value model's (B = 0 makes the adapters a no-op); updates move them
towards the returns."""

import os

import pytest
import torch

pytest.importorskip("peft")

from hybridflow.config import load_config  # noqa: E402
from hybridflow.distributed.launch import spawn_ranks  # noqa: E402
from hybridflow.protocol import DataProto  # noqa: E402

B, P, R, WORLD = 4, 5, 6, 2
SEED = 7


def _config():
    return load_config(None, [
        "critic.model.lora_rank=8", "critic.model.lora_alpha=16", "critic.optim.lr=0.01", f"trainer.seed={SEED}",
        "critic.ppo_mini_batch_size=4", "critic.ppo_micro_batch_size_per_gpu=2", "critic.cliprange_value=100",
        f"data.max_prompt_length={P}", f"data.max_response_length={R}"])


def _batch() -> DataProto:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 60, (B, P + R), generator=g)
    mask = torch.ones(B, P + R, dtype=torch.long)
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1,
                                        "responses": ids[:, P:], "response_mask": torch.ones(B, R, dtype=torch.long)})


def _rank(rank: int, out: str) -> None:
    from hybridflow.workers.critic_worker import CriticWorker

    from hybridflow.trainer.worker_inputs import critic_args

    worker = CriticWorker(*critic_args(_config(), total_steps=2))
    worker.init_model()
    res = {"trainable": sorted(n for n, p in worker.critic.module.named_parameters() if p.requires_grad),
           "optim_params": sum(len(g["params"]) for g in worker.critic.optimizer.param_groups)}
    batch = _batch()
    res["values0"] = worker.compute_values(batch).batch["values"]
    batch.batch["values"] = res["values0"]
    batch.batch["returns"] = res["values0"] + 1.0
    for step in range(3):
        batch.meta_info["global_step"] = step
        worker.update_critic(batch)
    res["values1"] = worker.compute_values(batch).batch["values"]
    if rank == 0:
        torch.save(res, os.path.join(out, "rank0.pt"))


def test_critic_lora_trains_adapters_and_head(tmp_path):
    from hybridflow.models.hf import load_value_model

    spawn_ranks(_rank, str(tmp_path), world=WORLD, init_group=False)  # the critic worker initializes the group
    res = torch.load(tmp_path / "rank0.pt", weights_only=False)
    torch.manual_seed(SEED + 1)  # the critic worker's seed before it loads the value model (fresh head)
    base = load_value_model("builtin:tiny-arith", torch.float32)
    linears = sum(isinstance(m, torch.nn.Linear) and name != "score" for name, m in base.named_modules())
    adapters = [n for n in res["trainable"] if ".lora_A." in n or ".lora_B." in n]
    head = [n for n in res["trainable"] if n not in adapters]
    assert len(adapters) == 2 * linears
    # the value head, in full (peft's trainable copy of each of its parameters)
    assert head == sorted(f"base_model.model.score.modules_to_save.default.{n}" for n, _ in base.score.named_parameters())
    assert res["optim_params"] == len(res["trainable"])
    batch = _batch()
    base.eval()
    with torch.no_grad():
        expected = base(input_ids=batch.batch["input_ids"]).logits[:, P - 1:-1, 0]
    assert torch.allclose(res["values0"], expected, atol=1e-5, rtol=0)
    # three updates towards returns = values0 + 1: the squared error to the returns (1.0 before) went down
    assert ((res["values1"] - res["values0"] - 1.0) ** 2).mean() < 0.95
