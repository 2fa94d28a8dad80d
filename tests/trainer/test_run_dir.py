"""Run directory hygiene: one metrics row per step across re-runs and resumes, the config saved with every
checkpoint, and a resume with an incompatible config refused before Ray starts, naming the differing keys."""

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.config import load_config
from hybridflow.trainer import main as trainer_main
from hybridflow.trainer.checkpoint import (CONFIG_FILE, POINTER, CheckpointManager, IncompatibleCheckpointError,
                                           check_resume_config, resume_signature, save_config)

REPO = Path(__file__).resolve().parents[2]


def _fake_checkpoint(run_dir, recipe, *overrides, step=2):
    """A checkpoint directory as a run of ``recipe`` writes it (config part + driver state), without Ray."""
    cfg = load_config(recipe, [f"trainer.default_local_dir={run_dir}", *overrides])

    def shard(path):
        os.makedirs(path, exist_ok=True)

    CheckpointManager(str(run_dir)).save(step, {"actor": shard, CONFIG_FILE: functools.partial(save_config, cfg)},
                                         {"global_step": step})
    return os.path.join(run_dir, f"global_step_{step}")


def test_resume_signature_names_algorithm_model_and_layout():
    ppo = resume_signature(load_config("quickstart"))
    assert ppo == {"algorithm.driver": "ppo", "algorithm.adv_estimator": "gae", "critic.enable": True,
                   "actor_rollout_ref.model.path": "builtin:tiny-arith", "critic.model.path": "builtin:tiny-arith",
                   "actor_rollout_ref.actor.tensor_model_parallel_size": 1,
                   "actor_rollout_ref.actor.strategy": "fsdp2", "critic.strategy": "fsdp2",
                   "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": 1,
                   "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": 1,
                   "critic.megatron.tensor_model_parallel_size": 1, "critic.megatron.pipeline_model_parallel_size": 1,
                   "actor_rollout_ref.actor.megatron.expert_model_parallel_size": 1,
                   "critic.megatron.expert_model_parallel_size": 1,
                   "ranks of actor": 2, "ranks of critic": 2, "ranks of cost_critic": None}
    async_ = resume_signature(load_config("async_grpo_quickstart"))  # trainer pool of 1 rank, no critic
    assert (async_["ranks of actor"], async_["ranks of critic"], async_["critic.model.path"]) == (1, None, None)


@pytest.mark.parametrize("recipe, overrides, expected", [
    ("grpo_quickstart", [], ["algorithm.adv_estimator: 'gae' in the checkpoint, 'grpo' now",
                             "critic.enable: True in the checkpoint, False now", "ranks of critic: 2 in the checkpoint, none now"]),
    ("remax_quickstart", [], ["algorithm.driver: 'ppo' in the checkpoint, 'remax' now"]),
    ("quickstart", ["trainer.n_gpus_per_node=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16"],
     ["ranks of actor: 2 in the checkpoint, 1 now", "ranks of critic: 2 in the checkpoint, 1 now"]),
    ("quickstart", ["actor_rollout_ref.model.path=some/other/model"],
     ["actor_rollout_ref.model.path: 'builtin:tiny-arith' in the checkpoint, 'some/other/model' now"]),
])
def test_incompatible_resume_names_the_differing_keys(tmp_path, recipe, overrides, expected):
    ckpt = _fake_checkpoint(tmp_path, "quickstart")
    with pytest.raises(IncompatibleCheckpointError) as err:
        check_resume_config(load_config(recipe, overrides), ckpt)
    message = str(err.value)
    assert all(part in message for part in expected), message
    assert "trainer.default_local_dir" in message and "trainer.resume_mode=disable" in message


def test_resume_ignores_what_produced_the_checkpoint(tmp_path):
    """A checkpoint written by another hybridflow version or commit, at another time, resumes: its config.yaml's
    run_info section is not config. A saved config.yaml also loads as a recipe."""
    from omegaconf import OmegaConf

    cfg = load_config("quickstart", [f"trainer.default_local_dir={tmp_path}"])
    old = {"hybridflow_version": "0.0.1", "git_commit": "0" * 40, "started_at": "2020-01-01T00:00:00Z"}

    def shard(path):
        os.makedirs(path, exist_ok=True)

    CheckpointManager(str(tmp_path)).save(
        2, {"actor": shard, CONFIG_FILE: functools.partial(save_config, cfg, run_info=old)}, {"global_step": 2})
    ckpt = os.path.join(tmp_path, "global_step_2")
    assert OmegaConf.load(os.path.join(ckpt, CONFIG_FILE)).run_info == old
    check_resume_config(cfg, ckpt)  # this process's version and commit differ from the saved ones: no refusal
    with pytest.raises(IncompatibleCheckpointError, match="algorithm.driver"):  # the check still works
        check_resume_config(load_config("remax_quickstart", [f"trainer.default_local_dir={tmp_path}"]), ckpt)
    again = load_config(os.path.join(ckpt, CONFIG_FILE))  # the run's config.yaml as a recipe: run_info dropped
    assert "run_info" not in again and again.actor_rollout_ref.model.path == "builtin:tiny-arith"


def test_compatible_changes_resume(tmp_path):
    # learning rate, batch sizes, total steps, KL, logging and the like may change on resume
    ckpt = _fake_checkpoint(tmp_path, "quickstart")
    check_resume_config(load_config("quickstart", [
        "actor_rollout_ref.actor.optim.lr=1e-4", "data.train_batch_size=16", "trainer.total_training_steps=99",
        "algorithm.kl_ctrl.kl_coef=0.01", "trainer.logger=[console]", f"trainer.default_local_dir={tmp_path}"]), ckpt)
    # a checkpoint written before checkpoints carried their config is resumed as before (with a warning)
    os.remove(os.path.join(ckpt, CONFIG_FILE))
    check_resume_config(load_config("grpo_quickstart"), ckpt)


def test_incompatible_checkpoint_fails_before_ray_starts(tmp_path, monkeypatch):
    _fake_checkpoint(tmp_path, "quickstart")

    def no_ray(config):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(trainer_main, "init_ray", no_ray)
    with pytest.raises(IncompatibleCheckpointError, match="algorithm.adv_estimator: 'gae' in the checkpoint"):
        trainer_main.run_ppo(load_config("grpo_quickstart", [f"trainer.default_local_dir={tmp_path}"]))
    # resume_mode=disable starts from scratch: the check does not apply (stops at the fake Ray here)
    with pytest.raises(AssertionError, match="Ray was started"):
        trainer_main.run_ppo(load_config("grpo_quickstart", [f"trainer.default_local_dir={tmp_path}",
                                                             "trainer.resume_mode=disable"]))


@pytest.mark.slow  # a fresh interpreter importing torch, transformers and Ray: ~1 min on a loaded 2-core machine
def test_cli_refuses_another_recipe_in_a_directory_with_a_ppo_checkpoint(tmp_path):
    _fake_checkpoint(tmp_path / "run", "quickstart")
    code = ("import sys, ray; from hybridflow.cli import main; "
            f"rc = main(['train', 'remax_quickstart', 'trainer.default_local_dir={tmp_path / 'run'}']); "
            "print(rc, ray.is_initialized())")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["2", "False"], proc.stderr
    assert "algorithm.driver: 'ppo' in the checkpoint, 'remax' now" in proc.stderr
    assert "algorithm.adv_estimator: 'gae' in the checkpoint, 'remax' now" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_last_log_line_says_where_the_weights_are():
    saved = trainer_main.checkpoint_summary(5, 12, "runs/a/global_step_12")
    assert saved.startswith("latest checkpoint: runs/a/global_step_12 ") and "hybridflow export" in saved
    none = trainer_main.checkpoint_summary(-1, 3, None)
    assert none.startswith("no checkpoint saved (trainer.save_freq=-1): the trained weights of step 3 were not kept")
    assert "earlier" not in none and "\n" not in none
    # resumed from an older run's checkpoint, then run without saving: that older checkpoint is all there is
    older = trainer_main.checkpoint_summary(-1, 9, "runs/a/global_step_4")
    assert "step 9 were not kept" in older and "the earlier runs/a/global_step_4" in older


# ---------------------------------------------------------------------------------------------- real runs

TINY = ["data.builtin_train_size=16", "data.train_batch_size=4", "data.builtin_val_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "critic.ppo_mini_batch_size=2", "critic.ppo_micro_batch_size_per_gpu=1", "data.max_response_length=8",
        "trainer.test_freq=-1", "trainer.logger=[jsonl]"]


def _run(out, steps, *extra):
    trainer_main.run_ppo(load_config("quickstart", TINY + [f"trainer.default_local_dir={out}",
                                                           f"trainer.total_training_steps={steps}", *extra]))


def _steps(path):
    with open(path) as f:
        return [json.loads(line)["step"] for line in f]


@pytest.mark.slow
def test_two_runs_into_one_directory_then_a_resume_after_an_interrupt(tmp_path, ray_session):
    out = tmp_path / "run"
    # a first run without checkpoints, then a second run into the same directory (nothing to resume): it starts a
    # new metrics.jsonl and the first run's rows are moved aside
    _run(out, 1)  # (one step: the rows to move aside need not be more)
    _run(out, 3, "trainer.save_freq=2")  # checkpoints at 2 and (the last step) 3
    assert _steps(out / "metrics.jsonl") == [0, 1, 2, 3] and CheckpointManager(str(out)).steps() == [2, 3]
    (aside,) = [p for p in out.iterdir() if p.name.startswith("metrics.") and p.name != "metrics.jsonl"]
    assert _steps(aside) == [0, 1]
    # as if interrupted during step 4 of a longer run: rows 1..3 logged, the newest checkpoint at step 2
    shutil.rmtree(out / "global_step_3")
    (out / POINTER).write_text("2")
    _run(out, 4, "trainer.save_freq=2")  # resumes at 2, logs 3 and 4 again
    assert _steps(out / "metrics.jsonl") == [0, 1, 2, 3, 4]
    ckpt = CheckpointManager(str(out))
    assert ckpt.latest() == str(out / "global_step_4")
    saved = load_config(str(out / "global_step_4" / CONFIG_FILE))
    assert saved.trainer.total_training_steps == 4 and saved.algorithm.adv_estimator == "gae"
    # another recipe into this directory: refused before Ray (in-process: the session's Ray stays as it was)
    with pytest.raises(IncompatibleCheckpointError, match="algorithm.adv_estimator: 'gae' in the checkpoint"):
        trainer_main.run_ppo(load_config("grpo_quickstart", TINY + [f"trainer.default_local_dir={out}"]))
    assert _steps(out / "metrics.jsonl") == [0, 1, 2, 3, 4]
