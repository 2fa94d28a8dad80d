"""The reference and old-logprob forwards run inside ``generate_sequences`` (the driver's ``LOG_PROBS_IN_GENERATE``
entry, used when the actor's group generates in its training layout) give the columns the separate
``compute_ref_and_old_log_prob`` call gives on the same rows: 2 gloo ranks, the real ``ActorRolloutRefWorker``,
with fixed-size and token-budget (``use_dynamic_bsz``, a collective over the ranks) micro-batches."""

import os

import pytest
import torch

from hybridflow.distributed.launch import spawn_ranks
from helpers.lora_ranks import P, R, WORLD, prompts, response_batch
from hybridflow.config import load_config
from hybridflow.workers.inputs import LOG_PROBS_IN_GENERATE


def _config(dynamic: bool):
    return load_config(None, [
        "algorithm.use_kl_in_reward=true", "actor_rollout_ref.rollout.do_sample=false",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
        f"actor_rollout_ref.actor.use_dynamic_bsz={str(dynamic).lower()}",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={P + R}",
        f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={P + R}",
        f"data.max_prompt_length={P}", f"data.max_response_length={R}"])


def _rank(rank: int, out: str, dynamic: bool) -> None:
    from hybridflow.trainer.worker_inputs import actor_args
    from hybridflow.workers.actor_worker import ActorRolloutRefWorker

    worker = ActorRolloutRefWorker(*actor_args(_config(dynamic), total_steps=2))
    worker.init_model()
    mine = prompts().chunk(WORLD)[rank]  # this rank's prompts, as the rollout mesh's dispatch gives them
    mine.meta_info[LOG_PROBS_IN_GENERATE] = ["ref", "old"]
    fused = worker.generate_sequences(mine)
    separate = worker.compute_ref_and_old_log_prob(response_batch(fused))
    torch.save({"fused": {k: fused.batch[k] for k in ("ref_log_prob", "old_log_probs", "entropys", "response_mask")},
                "separate": {k: separate.batch[k] for k in ("ref_log_prob", "old_log_probs", "entropys")},
                "metrics": fused.meta_info["metrics"], "flag_left": LOG_PROBS_IN_GENERATE in fused.meta_info},
               os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.parametrize("dynamic", [False, True])
def test_forwards_in_the_generation_call_equal_the_separate_call(tmp_path, dynamic):
    spawn_ranks(_rank, str(tmp_path), dynamic, world=WORLD, init_group=False)
    for rank in range(WORLD):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        mask = res["fused"]["response_mask"].bool()
        assert mask.any()
        for key, value in res["separate"].items():
            torch.testing.assert_close(res["fused"][key][mask], value[mask], rtol=0, atol=1e-6, msg=key)
        assert set(res["metrics"]) == {"timing_worker_s/ref_log_prob_in_generate",
                                       "timing_worker_s/old_log_prob_in_generate"}
        assert all(v > 0 for v in res["metrics"].values()) and not res["flag_left"]
