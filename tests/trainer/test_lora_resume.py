"""Exact LoRA resume through ``hybridflow train``: lora_quickstart (GRPO, rank-16 adapters, merged sync, 2 actor
ranks via Ray) for 4 uninterrupted steps equals 2 steps + resume + 2 steps: bit-identical adapters in the step-4
checkpoints (and the same metrics at steps 3 and 4), while the frozen base never changed."""

import json

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

pytest.importorskip("peft")

from hybridflow.cli import main  # noqa: E402

pytestmark = pytest.mark.slow

SMALL = [  # lora_quickstart, scaled down: 8 prompts x 2 samples per step, one epoch = 2 steps
    "data.builtin_train_size=16", "data.train_batch_size=8", "data.builtin_val_size=8", "data.shuffle=true",
    "data.max_response_length=16", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "trainer.test_freq=-1", "trainer.save_freq=2",
    "trainer.logger=[jsonl]", "trainer.plot_curves=false",
]
VOLATILE = ("timing", "perf/throughput", "sync/weight_transfer_s", "timestamp")


def _train(out, steps: int) -> None:
    assert main(["train", "lora_quickstart", *SMALL, f"trainer.default_local_dir={out}",
                 f"trainer.total_training_steps={steps}"]) == 0


def _model(ckpt_dir, tmp_path, name: str) -> dict[str, torch.Tensor]:
    target = tmp_path / f"{name}.pt"
    dcp_to_torch_save(str(ckpt_dir / "actor"), str(target))
    return torch.load(target, weights_only=False)["model"]


def _metrics(out) -> dict[int, dict]:
    rows: dict[int, dict] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["step"], {}).update({k: v for k, v in row.items() if not k.startswith(VOLATILE)})
    return rows


def test_lora_two_plus_two_steps_equal_four(tmp_path, ray_session):
    full, parts = tmp_path / "full", tmp_path / "parts"
    _train(full, 4)
    _train(parts, 2)
    _train(parts, 4)  # resume_mode=auto: continues from parts/global_step_2
    four, resumed = _model(full / "global_step_4", tmp_path, "a"), _model(parts / "global_step_4", tmp_path, "b")
    adapters = sorted(k for k in four if ".lora_A." in k or ".lora_B." in k)
    assert adapters and four.keys() == resumed.keys()
    for key in adapters:
        assert torch.equal(four[key], resumed[key]), key
    two = _model(full / "global_step_2", tmp_path, "c")
    assert any(not torch.equal(two[k], four[k]) for k in adapters)  # steps 3-4 trained the adapters
    assert all(torch.equal(two[k], four[k]) for k in four if "lora_" not in k)  # the base is frozen
    a, b = _metrics(full), _metrics(parts)
    for step in (3, 4):
        assert a[step] == b[step], step
        assert a[step]["sync/verified"] == 1.0
