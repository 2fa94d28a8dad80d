"""End to end: two PPO steps through real Ray worker groups (2 ranks each for actor and critic), and the export of
their checkpoint."""

import json
import os
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.cli import main
from hybridflow.models.export import load_actor_state_dict

pytestmark = pytest.mark.slow


def _read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_ppo_steps_through_ray(quickstart_run, tmp_path):
    """The shared quickstart run (tests/helpers/quickstart_run.py: 8 prompts a step, validation greedy and
    sampled with n=2 at temperature 1, a checkpoint at step 2), the run this test used to start itself."""
    assert quickstart_run.returncode == 0, quickstart_run.output[-3000:]
    out = quickstart_run.run_dir
    rows = _read_metrics(out / "metrics.jsonl")
    train = [r for r in rows if "critic/score/mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    # Before the first update the actor's recomputed logprobs are those the rollout sampled from (fp32); the actor
    # computes them with Ulysses sp=2 (the sequence split over both ranks: one dp group), the rollout unsplit
    assert train[0]["rollout/logprob_diff_max"] <= 1e-5
    assert "actor train (dp=1, tp=1, pp=1, sp=2)" in quickstart_run.output
    assert "critic train (dp=1, tp=1, pp=1, sp=2)" in quickstart_run.output
    assert "val/score" in rows[0] and "val/score" in rows[-1]
    assert 0.0 <= rows[-1]["val/mean@2"] <= 1.0 and "val/mean@2/hybridflow/arith" in rows[-1]
    # trainer.colocate_roles (default): the three roles of the one pool run in one process per rank, 2 in all
    started = re.findall(r"worker group \S+: (\d+) ranks of (\S+),", quickstart_run.output)
    assert started == [("2", "ActorRolloutRefWorker_RuleRewardWorker_CriticWorker")], started
    for key in ("actor/pg_loss", "critic/vf_loss", "actor/entropy", "rollout/kl", "response_length/mean",
                "timing_s/gen", "timing_s/update_actor", "perf/throughput"):
        assert key in train[-1], key
    # the policy changed after one update: the KL to the reference is non-zero at step 2
    assert train[1]["rollout/kl"] != 0.0

    # the checkpoint exports to a Hugging Face directory that plain transformers loads with the trained weights
    export_dir = tmp_path / "export"
    umask = os.umask(0o022)
    try:
        assert main(["export", str(out / "global_step_2"), str(export_dir)]) == 0
    finally:
        os.umask(umask)
    # the weights are readable like the config beside them (safetensors alone writes them 0600)
    assert {f.name: f.stat().st_mode & 0o777 for f in export_dir.glob("*.safetensors")} == {"model.safetensors": 0o644}
    trained = load_actor_state_dict(str(out / "global_step_2"))
    model = AutoModelForCausalLM.from_pretrained(export_dir)
    tokenizer = AutoTokenizer.from_pretrained(export_dir)
    exported = model.state_dict()
    for name, tensor in trained.items():
        assert torch.equal(exported[name], tensor), name
    reference = AutoModelForCausalLM.from_config(model.config)
    reference.load_state_dict(trained, strict=False)
    ids = tokenizer("Question: Ann has 3 apples.", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
