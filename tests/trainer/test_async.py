"""The async driver through Ray: with max_staleness=0 it makes the same updates as the synchronous PPO driver (same
samples, same weights after N steps); with max_staleness=1 samples are one version old, the generators receive the
pushed weights, and the async metrics are logged; the look-ahead (the next batch prepared during the update) trains on
the same samples and weights as the plain order; a killed generator or trainer rank stops the run with a clear error within 60 s."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from helpers.ray_procs import hosted_classes, role_pids, running
from hybridflow.config import ConfigError, load_config
from hybridflow.models.export import load_actor_state_dict
from hybridflow.trainer.async_rl import AsyncTrainer
from hybridflow.trainer.checkpoint import CheckpointManager, load_trainer_state
from hybridflow.trainer.main import run_ppo

pytestmark = pytest.mark.slow

STEPS = 3
COMMON = [f"trainer.total_training_steps={STEPS}", f"trainer.save_freq={STEPS}", "trainer.test_freq=-1",
          "trainer.val_before_train=false", "trainer.logger=[jsonl]", "data.train_batch_size=8",
          "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
          "actor_rollout_ref.actor.policy_loss=vanilla", "actor_rollout_ref.actor.use_kl_loss=true",
          "algorithm.bypass_old_log_prob=false"]
SYNC = ["algorithm.driver=ppo", "resource_pool.pools=null", "resource_pool.mapping={}"]


def _metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _final_weights(out):
    return load_actor_state_dict(CheckpointManager(str(out)).resolve("auto"))


def test_staleness_zero_matches_the_synchronous_driver(ray_session, tmp_path):
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"
    run_ppo(load_config("async_grpo_quickstart", COMMON + SYNC + [f"trainer.default_local_dir={sync_dir}"]))
    run_ppo(load_config("async_grpo_quickstart", COMMON + ["async_training.max_staleness=0",
                                                           f"trainer.default_local_dir={async_dir}"]))
    sync_rows, async_rows = _metrics(sync_dir), _metrics(async_dir)
    assert len(sync_rows) == len(async_rows) == STEPS
    for s, a in zip(sync_rows, async_rows):
        # same samples: same rewards and lengths; same updates: same losses
        for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm"):
            assert a[key] == pytest.approx(s[key], abs=1e-6), key
        assert a["async/staleness_max"] == 0 and a["async/dropped_samples"] == 0
    sync_w, async_w = _final_weights(sync_dir), _final_weights(async_dir)
    assert sync_w.keys() == async_w.keys()
    init = load_actor_state_dict_initial()
    moved = max((sync_w[k] - init[k]).abs().max().item() for k in init)
    assert moved > 1e-4  # the runs trained (so equality below is not trivial)
    for name in sync_w:
        assert torch.allclose(sync_w[name], async_w[name], atol=1e-6, rtol=0), name


def load_actor_state_dict_initial():
    from hybridflow.models.hf import load_causal_lm

    return load_causal_lm("builtin:tiny-arith", torch.float32).state_dict()


def test_one_step_stale_samples_and_weight_push(ray_session, tmp_path):
    # 2 trainer ranks (FSDP2: every rank gathers, rank 0 sends); several receivers: tests/distributed/test_weight_sync.py
    run_ppo(load_config("async_grpo_quickstart", COMMON + [
        "resource_pool.pools={trainer: [2], generator: [1]}", "trainer.n_gpus_per_node=2",
        "async_training.max_staleness=1", "actor_rollout_ref.actor.policy_loss=aipo",
        "actor_rollout_ref.actor.aipo_rho=2.0", f"trainer.default_local_dir={tmp_path}"]))
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # step 1 trains on samples of the initial weights (version 0 = trainer version 0); later steps on the
    # previous version (the generator ran ahead by one batch)
    assert rows[0]["async/staleness_max"] == 0
    assert all(r["async/staleness_mean"] == 1 and r["async/staleness_frac_1"] == 1 for r in rows[1:])
    n_bytes = sum(t.numel() * t.element_size() for t in load_actor_state_dict_initial().values())
    assert all(r["sync/weight_transfer_bytes"] == n_bytes for r in rows)
    # a stale sample's importance weight pi_old/mu differs from 1 (the generator used older weights); step 1's not
    assert rows[0]["async/is_weight_max"] == pytest.approx(1.0, abs=1e-4)
    assert rows[-1]["async/is_weight_max"] > 1.0 + 1e-4 or rows[-1]["async/is_weight_min"] < 1.0 - 1e-4


LOOK_AHEAD = [f"trainer.total_training_steps={STEPS}", f"trainer.save_freq={STEPS}", "trainer.test_freq=-1",
              "trainer.val_before_train=false", "trainer.logger=[jsonl]", "data.train_batch_size=8",
              "actor_rollout_ref.actor.ppo_mini_batch_size=4", "async_training.max_staleness=1"]


def test_look_ahead_trains_on_the_same_samples_and_weights(ray_session, tmp_path, monkeypatch):
    # the recipe's AIPO + bypass_old_log_prob, no KL: nothing before the update reads the trainer, so the driver
    # prepares step i+1's batch during step i's update and chains the push to it; the samples, rewards, updates,
    # staleness and the checkpoint's data position must be those of the plain order
    ahead_dir, plain_dir = tmp_path / "ahead", tmp_path / "plain"
    run_ppo(load_config("async_grpo_quickstart", LOOK_AHEAD + [f"trainer.default_local_dir={ahead_dir}"]))
    monkeypatch.setattr(AsyncTrainer, "_trainer_read_before_update", lambda self, config: True)
    run_ppo(load_config("async_grpo_quickstart", LOOK_AHEAD + [f"trainer.default_local_dir={plain_dir}"]))
    ahead, plain = _metrics(ahead_dir), _metrics(plain_dir)
    assert [r["async/look_ahead"] for r in ahead] == [1.0] * STEPS
    assert [r["async/look_ahead"] for r in plain] == [0.0] * STEPS
    for a, p in zip(ahead, plain, strict=True):
        for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm",
                    "async/staleness_mean", "async/dropped_samples"):
            assert a[key] == pytest.approx(p[key], abs=1e-6), key
    assert [r["async/staleness_max"] for r in ahead] == [0] + [1] * (STEPS - 1)
    ahead_w, plain_w = _final_weights(ahead_dir), _final_weights(plain_dir)
    for name in plain_w:
        assert torch.allclose(ahead_w[name], plain_w[name], atol=1e-6, rtol=0), name
    # the batch prepared ahead at the last step is in flight, not consumed: STEPS batches trained
    state = load_trainer_state(CheckpointManager(str(ahead_dir)).resolve("auto"))
    assert state["data_position"] == STEPS


def test_look_ahead_puts_back_a_batch_too_stale_for_the_next_step(ray_session, tmp_path):
    # queue_size 3 > k + 1: the third request is generated with the initial weights, so when step 2 looks ahead
    # at it (for trainer version 2) it is 2 versions old; it goes back to the queue and step 3 drops it
    run_ppo(load_config("async_grpo_quickstart", LOOK_AHEAD + [
        "trainer.total_training_steps=4", "trainer.save_freq=4", "async_training.queue_size=3",
        f"trainer.default_local_dir={tmp_path}"]))
    rows = _metrics(tmp_path)
    assert [r["async/look_ahead"] for r in rows] == [1.0] * 4
    assert all(r["async/staleness_max"] <= 1 for r in rows)
    per_batch = 8 * 4  # data.train_batch_size x rollout.n
    dropped = rows[-1]["async/dropped_samples"]
    assert dropped >= per_batch and dropped % per_batch == 0
    # dropped batches count as consumed, the batches in flight (prepared or requested) do not
    state = load_trainer_state(CheckpointManager(str(tmp_path)).resolve("auto"))
    assert state["data_position"] == 4 + dropped // per_batch


def test_async_ppo_with_a_critic(ray_session, tmp_path):
    # GAE: the critic lives on the trainer's pool and trains on the same (one-step-stale) samples
    run_ppo(load_config("async_grpo_quickstart", COMMON + [
        "algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1", "trainer.total_training_steps=2",
        "actor_rollout_ref.actor.tis_imp_ratio_cap=2.0",  # vanilla PPO clip on stale samples needs a correction
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.save_freq=-1", "critic.ppo_mini_batch_size=4", "critic.ppo_micro_batch_size_per_gpu=4",
        f"trainer.default_local_dir={tmp_path}"]))
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert all("critic/vf_loss" in r and "critic/values/mean" in r for r in rows)
    assert rows[1]["async/staleness_max"] == 1


def test_int8_generator_gap_is_small_and_tracks_the_pushed_weights(ray_session, tmp_path):
    run_ppo(load_config("async_grpo_quickstart", COMMON + [
        "async_training.max_staleness=0", "async_training.generator_quantization=int8",
        "trainer.total_training_steps=2", "trainer.save_freq=-1", f"trainer.default_local_dir={tmp_path}"]))
    rows = _metrics(tmp_path)
    # with k=0 the trainer's recomputed logprobs and the generator's differ only by the int8 weights; after an
    # update the generator re-quantizes the pushed weights, so the gap stays as small
    for r in rows:
        assert 1e-5 < r["rollout/logprob_diff_max"] < 0.1, r["rollout/logprob_diff_max"]
        assert 0.9 < r["async/is_weight_min"] <= r["async/is_weight_max"] < 1.1


def test_async_needs_its_own_generator_pool():
    with pytest.raises(ConfigError, match="resource_pool.mapping.generator"):
        load_config("async_grpo_quickstart", ["resource_pool.mapping={actor: trainer, generator: trainer}"])


@pytest.mark.parametrize("role_class,group", [("GeneratorWorker", "generator"), ("ActorRolloutRefWorker", "actor")])
def test_killed_generator_or_trainer_fails_fast(tmp_path, role_class, group):
    out = tmp_path / "run"
    # 4 prompts x n=4 a step instead of the recipe's 16 x 4: the steps before the kill only have to run
    cmd = [sys.executable, "-m", "hybridflow", "train", "async_grpo_quickstart", "trainer.total_training_steps=500",
           "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.logger=[jsonl]",
           "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
           f"trainer.default_local_dir={out}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 240
        while not (out / "metrics.jsonl").exists() or len(_metrics(out)) < 2:
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "no training step within 240 s"
            time.sleep(0.5)
        pids = role_pids(proc.pid, role_class)  # this run's, not another's on the machine
        assert len(pids) == 1, pids
        # the generator (max_concurrency > 1) keeps a process of its own; the trainer's process also hosts the rule
        # reward (trainer.colocate_roles), so killing it fails the actor's or the reward's call
        cohosted = {"GeneratorWorker": [], "ActorRolloutRefWorker": [("RuleRewardWorker", "reward")]}[role_class]
        assert hosted_classes(pids[0]) == [role_class, *(c for c, _ in cohosted)], hosted_classes(pids[0])
        groups = [group, *(g for _, g in cohosted)]
        workers = role_pids(proc.pid, "GeneratorWorker") + role_pids(proc.pid, "ActorRolloutRefWorker")
        os.kill(pids[0], 9)
        killed_at = time.time()
        output, _ = proc.communicate(timeout=60)
        elapsed = time.time() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert elapsed < 60
    assert any(f"worker group '{g}': rank 0 failed" in output for g in groups), output[-3000:]
    deadline = time.time() + 30  # the run's workers exit with its Ray (they may lag the driver a little)
    while running(workers) and time.time() < deadline:
        time.sleep(0.5)
    assert not running(workers)
