"""A PPO driver written against hybridflow's public API: the whole algorithm loop is in ``main`` below.

The config, the data and the worker groups come from the library; the loop is yours to edit (add a phase,
reorder, log something). Every worker-group call returns its future at once and ``union`` records it unread: the
loop waits only where it reads a value (the advantages, the printed numbers), so calls that need not wait for each
other run together. A call whose output is never read still reports its failure, at the next worker-group call
(or call ``hybridflow.controller.raise_unread_errors(wait=True)`` to wait for it, e.g. before saving). Run:
``python examples/ppo_driver.py [key=value ...]`` (the quickstart's keys, e.g.
``trainer.total_training_steps=20``). It prints one line per step and the validation score before and after.
"""

import sys

import ray

from hybridflow.algorithms import get_kl_controller
from hybridflow.config import load_config
from hybridflow.trainer.setup import build_data, init_ray, worker_groups
from hybridflow.trainer.steps import apply_kl_penalty, compute_advantage
from hybridflow.trainer.validate import validate


def main(overrides=()):
    config = load_config("quickstart", overrides)
    batches, val_data, _ = build_data(config)
    steps, n = config.trainer.total_training_steps, config.actor_rollout_ref.rollout.n
    kl_ctrl = get_kl_controller(config.algorithm.kl_ctrl)
    started_ray = init_ray(config)
    try:
        with worker_groups(config, steps) as groups:
            actor, critic, reward = groups["actor"], groups["critic"], groups["reward"]
            before = validate(config, actor, reward, val_data)["val/score"]
            for step, batch in zip(range(1, steps + 1), batches(0)):
                prompts = batch.pop(["input_ids", "attention_mask", "position_ids"])
                batch = batch.repeat(n, interleave=True).union(actor.generate_sequences(prompts))
                batch.union(reward.compute_rm_score(batch))  # token_level_scores
                batch.union(actor.compute_ref_log_prob(batch))  # ref_log_prob
                batch.union(actor.compute_log_prob(batch))  # old_log_probs
                batch.union(critic.compute_values(batch))  # values
                apply_kl_penalty(batch, kl_ctrl, config.algorithm.kl_penalty)  # token_level_rewards
                compute_advantage(batch, config.algorithm)  # advantages, returns (GAE)
                batch.meta_info["global_step"] = step
                critic_out = critic.update_critic(batch)  # both updates start here (overlapping on separate pools)
                actor_out = actor.update_actor(batch)
                loss = actor_out.meta_info["metrics"]["actor/pg_loss"]  # waits; a failed update raises here
                vf_loss = critic_out.meta_info["metrics"]["critic/vf_loss"]
                print(f"step {step} | reward {batch.batch['token_level_scores'].sum(-1).mean().item():.3f} | "
                      f"pg_loss {loss:.3f} | vf_loss {vf_loss:.3f}")
            after = validate(config, actor, reward, val_data)["val/score"]
    finally:
        if started_ray:
            ray.shutdown()
    print(f"val/score {before:.3f} -> {after:.3f}")
    return {"before": before, "after": after}


if __name__ == "__main__":
    main(sys.argv[1:])
