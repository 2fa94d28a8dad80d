"""``dtype=auto`` on CPU: the reference engine takes the actor's bf16-or-fp32 answer instead of probing its own
forward-only shapes (its probe sat near the threshold and flipped between identical runs, so step 1's KL was
sometimes 1.5e-4 instead of 0). 2 gloo ranks, the real ``ActorRolloutRefWorker``, the probe's timer replaced so that
the trained (actor) and frozen (reference) shapes answer differently: the reference follows the actor both ways,
and on an unchanged policy its logprobs equal the actor's exactly."""

import os

import pytest
import torch

from hybridflow.distributed.launch import spawn_ranks
from helpers.lora_ranks import WORLD, prompts, response_batch
from hybridflow.config import load_config


def _rank(rank: int, out: str, actor_bf16: bool) -> None:
    from hybridflow.distributed import precision
    from hybridflow.trainer.worker_inputs import actor_args
    from hybridflow.training import fsdp2
    from hybridflow.workers.actor_worker import ActorRolloutRefWorker

    os.environ[precision.PROBE_ENV] = "1"

    def timer(module, trained):  # the actor's (trained) shapes answer actor_bf16, the reference's the opposite
        fast = actor_bf16 == trained
        return {torch.float32: 2.0 if fast else 1.0, torch.bfloat16: 1.0}.__getitem__

    fsdp2.model_step_timer = timer
    cfg = load_config(None, ["actor_rollout_ref.rollout.do_sample=false", "data.max_prompt_length=6",
                             "data.max_response_length=6", "algorithm.use_kl_in_reward=true"])
    worker = ActorRolloutRefWorker(*actor_args(cfg, total_steps=2))
    reported = worker.init_model()  # what the driver logs when the group is up
    rows = response_batch(worker.generate_sequences(prompts().chunk(WORLD)[rank]))
    both = worker.compute_ref_log_prob(rows).union(worker.compute_log_prob(rows))
    torch.save({"reported": reported, "actor": worker.actor.engine.compute_dtype,
                "ref": worker.ref.engine.compute_dtype,
                "ref_log_prob": both.batch["ref_log_prob"], "old_log_probs": both.batch["old_log_probs"]},
               os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.parametrize("actor_bf16", [True, False])
def test_the_reference_computes_in_the_actors_dtype(tmp_path, actor_bf16):
    spawn_ranks(_rank, str(tmp_path), actor_bf16, world=WORLD, init_group=False)
    want = torch.bfloat16 if actor_bf16 else torch.float32
    for rank in range(WORLD):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        assert res["actor"] == res["ref"] == want
        name = "bfloat16" if actor_bf16 else "float32"
        assert res["reported"] == {"compute_dtype": {"actor": name, "ref": name}}
        assert torch.equal(res["ref_log_prob"], res["old_log_probs"])  # KL of the unchanged policy: exactly 0


def test_the_driver_logs_what_each_group_computes_in():
    from hybridflow.trainer.setup import _dtype_note

    assert _dtype_note({"compute_dtype": {"actor": "float32", "ref": "bfloat16"}}) == \
        "; computes in actor float32, ref bfloat16"
    assert _dtype_note(None) == _dtype_note({"compute_dtype": {}}) == ""  # a group that reports none (rewards)
