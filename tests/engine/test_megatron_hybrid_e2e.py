"""End to end through Ray (2 ranks): the megatron quickstart with the actor and critic trained in two pipeline
stages (dp=1 x tp=1 x pp=2) and the rollout generating from the 3D-HybridEngine's tp_g=2 shards, resharded from
that pipeline layout; then an exact resume through ``hybridflow train``'s checkpoint path.

What is checked: the generation shards sample from exactly the policy the pipeline layout recomputes
(``rollout/logprob_diff_max``), the update reaches the generation weights (``rollout/kl`` after step 1), and a
run resumed from its step-1 checkpoint ends with actor and critic weights bit-identical to the uninterrupted
2-step run (1 + 1 = 2: the same restore path as 2 + 2 = 4 — weights, distributed-optimizer state, lr schedule,
RNG, data position — at a third of the cost)."""

import json
import shutil

import pytest
import torch

pytest.importorskip("megatron.core")

from hybridflow.config import load_config  # noqa: E402
from hybridflow.models.megatron_export import megatron_state_dict  # noqa: E402
from hybridflow.trainer.main import run_ppo  # noqa: E402

pytestmark = pytest.mark.slow


def _cfg(out, steps):
    return load_config("megatron_quickstart", [
        f"trainer.total_training_steps={steps}", "trainer.test_freq=-1", f"trainer.default_local_dir={out}",
        "trainer.save_freq=1", "data.train_batch_size=8", "data.builtin_val_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "critic.ppo_mini_batch_size=4", "critic.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    ])


def _weights(step_dir, role):
    return megatron_state_dict(str(step_dir / role), str(step_dir / "actor" / "hf"))  # the critic: the same backbone


def test_megatron_pipeline_layout_generates_through_the_hybrid_engine_and_resumes(tmp_path, ray_session):
    full = tmp_path / "full"
    run_ppo(_cfg(full, 2))
    rows = [json.loads(line) for line in open(full / "metrics.jsonl")]
    train = [r for r in rows if "critic/score/mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["rollout/logprob_diff_max"] <= 1e-5 for r in train)
    assert train[1]["rollout/kl"] != 0.0  # step 2 sampled from the updated, resharded weights

    parts = tmp_path / "parts"
    shutil.copytree(full, parts, ignore=shutil.ignore_patterns("global_step_2"))
    (parts / "metrics.jsonl").unlink()
    (parts / "latest_checkpointed_iteration.txt").write_text("1")  # as if the first run had stopped after step 1
    run_ppo(_cfg(parts, 2))  # resume_mode=auto: continues from parts/global_step_1
    for role in ("actor", "critic"):
        a, b = _weights(full / "global_step_2", role), _weights(parts / "global_step_2", role)
        one = _weights(full / "global_step_1", role)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), role
        assert any(not torch.equal(a[k], one[k]) for k in a), role  # step 2 changed the weights
