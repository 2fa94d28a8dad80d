"""End to end through Ray (2 ranks): GRPO on a tiny random-init Qwen3-MoE (8 experts, top-2, the tiny-arith
tokenizer) with the actor and its reference on the megatron engine at expert parallelism 2 (dp=2, ep=2), the HF
rollout generating from the 3D-HybridEngine's tp_g=2 generation shards (4 experts per rank), or the vLLM rollout
(its own copy, refreshed from the EP layout after each update; the engine records the routing), 2 steps each.

What is checked: the run completes both steps; the generation shards sample from the policy the EP layout
recomputes (``rollout/logprob_diff_max`` <= 1e-4 in fp32); step 2 samples from the updated, resharded weights
(``rollout/kl`` != 0; an entropy bonus gives a gradient while the random model scores 0); the checkpoint of the
EP layout exports to full HF weights that differ from the initial ones. With ``router_replay=rollout`` the hf
rollout records each token's experts from the generation shards and the megatron forwards replay them.
"""

import json

import pytest
import torch

pytest.importorskip("megatron.core")

from hybridflow.config import load_config  # noqa: E402
from hybridflow.models.megatron_export import megatron_state_dict  # noqa: E402
from hybridflow.trainer.main import run_ppo  # noqa: E402
from tests.helpers.moe_models import save_tiny_moe_for_training  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("rollout", ["hf", "vllm"])
def test_grpo_on_moe_with_megatron_expert_parallelism(tmp_path, ray_session, rollout):
    if rollout == "vllm":
        pytest.importorskip("vllm")
    model = save_tiny_moe_for_training(str(tmp_path / "moe"))
    out = tmp_path / "run"
    run_ppo(load_config("grpo_quickstart", [
        f"actor_rollout_ref.model.path={model}", "trainer.total_training_steps=2", "trainer.test_freq=-1",
        f"trainer.default_local_dir={out}", "trainer.save_freq=2", "data.train_batch_size=4",
        "data.builtin_val_size=4", "data.max_response_length=8", "actor_rollout_ref.rollout.n=2",
        "trainer.val_before_train=false",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
        f"actor_rollout_ref.rollout.name={rollout}", "actor_rollout_ref.actor.optim.lr=1e-3",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={2 if rollout == 'hf' else 1}",
        "actor_rollout_ref.actor.entropy_coeff=0.01",  # a gradient even while the random model scores 0
        "actor_rollout_ref.actor.router_replay=rollout",  # the hf rollout records routing, megatron replays it
    ]))
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    train = [r for r in rows if "actor/pg_loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["rollout/logprob_diff_max"] <= 1e-4 for r in train), [r["rollout/logprob_diff_max"] for r in train]
    assert train[0]["actor/grad_norm"] > 0 and train[1]["rollout/kl"] != 0.0  # step 2 samples the updated weights
    final = megatron_state_dict(str(out / "global_step_2" / "actor"), model)
    from transformers import AutoModelForCausalLM

    start = dict(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).named_parameters())
    assert final.keys() == start.keys()
    assert any(not torch.equal(final[k], start[k]) for k in final)
    assert final["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
