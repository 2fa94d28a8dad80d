"""The reference forward inside ``update_actor`` (the driver's ``REF_IN_UPDATE`` flag, used when only the KL loss
reads the reference logprobs) gives the update the separate ``compute_ref_log_prob`` call gives: 2 gloo ranks, the
real ``ActorRolloutRefWorker``, the same start (a checkpoint) for both updates; weights compared exactly."""

import os

import torch

from hybridflow.distributed.launch import spawn_ranks
from helpers.lora_ranks import P, R, WORLD, prompts, response_batch
from hybridflow.config import load_config
from hybridflow.workers.inputs import REF_IN_UPDATE

B = 4


def _config():
    return load_config(None, [
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.5",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.actor.optim.lr=0.05", "actor_rollout_ref.rollout.do_sample=false",
        f"data.max_prompt_length={P}", f"data.max_response_length={R}"])


def _update(worker, batch, flag: bool) -> tuple[dict[str, torch.Tensor], dict]:
    from hybridflow.distributed import iter_full_state

    batch = batch.select(deepcopy=True)
    if flag:
        batch.meta_info[REF_IN_UPDATE] = True
    else:
        batch.union(worker.compute_ref_log_prob(batch))
    metrics = worker.update_actor(batch).meta_info["metrics"]
    return {k: v.clone() for k, v in iter_full_state(worker.actor.module)}, metrics


def _rank(rank: int, out: str) -> None:
    from hybridflow.trainer.worker_inputs import actor_args
    from hybridflow.workers.actor_worker import ActorRolloutRefWorker

    worker = ActorRolloutRefWorker(*actor_args(_config(), total_steps=2))
    worker.init_model()
    batch = response_batch(worker.generate_sequences(prompts()))
    batch.batch["advantages"] = torch.linspace(-1, 1, B)[:, None].expand(B, R).clone() * 5
    batch.meta_info["global_step"] = 0
    batch = batch.chunk(WORLD)[rank]  # this rank's rows, as the driver's dispatch gives them
    worker.save_checkpoint(os.path.join(out, "ckpt"))
    separate, separate_metrics = _update(worker, batch, flag=False)
    worker.load_checkpoint(os.path.join(out, "ckpt"))
    inline, inline_metrics = _update(worker, batch, flag=True)
    if rank == 0:
        torch.save({"separate": separate, "inline": inline, "separate_metrics": separate_metrics,
                    "inline_metrics": inline_metrics}, os.path.join(out, "result.pt"))


def test_reference_forward_in_the_update_call_equals_the_separate_call(tmp_path):
    spawn_ranks(_rank, str(tmp_path), world=WORLD, init_group=False)
    res = torch.load(tmp_path / "result.pt")
    for name, weight in res["separate"].items():
        assert torch.equal(res["inline"][name], weight), name
    sep, inl = res["separate_metrics"], res["inline_metrics"]
    assert sep["actor/kl_loss"] == inl["actor/kl_loss"] and "rollout/kl" in inl
    assert inl["timing_worker_s/ref_log_prob_in_update"] > 0 and "timing_worker_s/ref_log_prob_in_update" not in sep
