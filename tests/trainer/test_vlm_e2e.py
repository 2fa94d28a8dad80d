"""End to end with a vision-language model: 2 GRPO steps (hf rollout, fsdp2 actor + reference, padding-free
forwards) on a tiny random Qwen2.5-VL dir and a few synthetic image rows, through Ray; the rollout logprobs equal
the trainer's recomputation (``rollout/logprob_diff_max``)."""

import io
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridflow.config import load_config
from hybridflow.trainer.main import run_ppo
from tests.helpers.vlm import random_image, save_tiny_vlm

pytestmark = pytest.mark.slow


def _rows(count: int) -> list[dict]:
    rows = []
    for i in range(count):
        buf = io.BytesIO()
        random_image(56, 28 * (1 + i % 3), i).save(buf, format="PNG")
        rows.append({"data_source": "hybridflow/arith",
                     "prompt": [{"role": "user", "content": f"<image>What is {i} + 1?"}],
                     "images": [{"bytes": buf.getvalue(), "path": None}],
                     "reward_model": {"ground_truth": str(i + 1)}, "extra_info": {"index": i}})
    return rows


def test_grpo_two_steps_on_a_vlm(ray_session, tmp_path):
    model = save_tiny_vlm(str(tmp_path / "vlm"))
    train, val = tmp_path / "train.parquet", tmp_path / "val.parquet"
    pq.write_table(pa.Table.from_pylist(_rows(8)), train)
    pq.write_table(pa.Table.from_pylist(_rows(4)), val)
    out = tmp_path / "run"
    run_ppo(load_config("grpo_quickstart", [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={train}", f"data.val_files={val}",
        "data.max_prompt_length=48", "data.max_response_length=6", "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.model.dtype=float32",
        "actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "trainer.total_training_steps=2",
        "trainer.test_freq=2", "trainer.n_gpus_per_node=1", "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={out}"]))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    steps = [m for m in metrics if "rollout/logprob_diff_max" in m]
    assert len(steps) == 2
    diffs = [m["rollout/logprob_diff_max"] for m in steps]
    print(f"rollout/logprob_diff_max per step: {diffs}")
    assert max(diffs) <= 1e-4
    assert any("val/score" in m or any(k.startswith("val/") for k in m) for m in metrics)
