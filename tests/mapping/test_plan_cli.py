"""``hybridflow plan``: table and JSON output, exit statuses, and the emitted config snippet, which
``hybridflow train`` must accept as a recipe on its own and merged into the quickstart."""

import dataclasses
import json

import pytest
import yaml
from omegaconf import OmegaConf

from hybridflow.cli import main
from hybridflow.config import load_config, resolve_recipe
from hybridflow.mapping.abilities import ENGINE_ABILITIES
from hybridflow.mapping.emit import plan_problems, plan_to_config
from hybridflow.mapping.search import MappingSearch
from hybridflow.mapping.specs import SpecError, Workload, get_model, parse_cluster

CPU_ARGS = ["plan", "--cluster", "1x4:cpu", "--actor", "tiny-arith", "--reward", "rule", "--batch", "32",
            "--prompt-len", "64", "--response-len", "32", "--ppo-updates", "2", "--micro-batch", "8", "--zero", "3",
            "--max-tp", "1", "--max-pp", "1"]


def test_json_output(capsys):
    assert main(["plan", "--cluster", "2x8:A100-80G", "--actor", "7B", "--reward", "7B", "--top-k", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["devices"] == 16 and out["models"]["actor"] == "7B"
    best = out["best"]["seconds"]
    assert all(b is None or best <= b["seconds"] for b in out["baselines"].values())
    assert len(out["top"]) == 3 and out["top"][0]["seconds"] == best
    assert set(out["best"]["stages"]) == {"generate", "prepare", "train"}
    assert sum(out["best"]["allocation"]) == 16


def test_overlap_sets_and_shared_cores(capsys):
    args = ["plan", "--cluster", "1x4:cpu@2", "--actor", "tiny-arith", "--reward", "rule", "--batch", "32",
            "--prompt-len", "64", "--response-len", "32", "--forward-micro-batch", "16", "--json"]
    assert main(args) == 0
    seq = json.loads(capsys.readouterr().out)
    assert seq["sequential_driver"] is True and seq["cluster"] == "1x4:cpu@2"
    assert seq["workload"]["forward_micro_batch"] == 16
    assert seq["best"]["seconds"] == pytest.approx(sum(seq["best"]["stages"].values()), abs=1e-3)
    assert main(args + ["--overlap-sets"]) == 0
    assert json.loads(capsys.readouterr().out)["sequential_driver"] is False


def test_table_output(capsys):
    assert main(CPU_ARGS) == 0
    out = capsys.readouterr().out
    for text in ("best plan:", "estimated iteration:", "baselines", "top 2:", "states GB/device", "actor"):
        assert text in out


@pytest.mark.parametrize("args, message", [
    (["--cluster", "2x8:V100", "--actor", "7B"], "unknown device 'V100'"),
    (["--cluster", "2x8:H100", "--actor", "8B"], "not a preset"),
    (["--cluster", "2x8:H100", "--actor", "7B", "--batch", "0"], "batch=0"),
    # the shipped model has 256 positions (its config.json): 1024 + 1024 tokens cannot be trained
    (["--cluster", "1x4:cpu@2", "--actor", "builtin:tiny-arith"], "prompt + response = 2048 tokens exceed the "
                                                                   "positions of actor builtin:tiny-arith (256)"),
    (["--cluster", "2x8:H100", "--actor", "7B", "--prompt-len", "4000"], "exceed the positions of actor 7B (4096)"),
])
def test_bad_arguments_exit_2(capsys, args, message):
    assert main(["plan", *args]) == 2
    assert message in capsys.readouterr().err


def test_no_feasible_plan_exits_1(capsys):
    assert main(["plan", "--cluster", "1x8:A100-80G", "--actor", "70B"]) == 1
    assert "no plan fits" in capsys.readouterr().err


def test_emitted_config_loads_alone_and_merged_into_quickstart(tmp_path, capsys):
    snippet = tmp_path / "plan.yaml"
    assert main([*CPU_ARGS, "--emit-config", str(snippet)]) == 0
    capsys.readouterr()
    alone = load_config(str(snippet))
    pools = dict(alone.resource_pool.pools)
    mapping = dict(alone.resource_pool.mapping)
    assert set(mapping) == {"actor", "critic", "reward"} and set(mapping.values()) <= set(pools)
    assert sum(sum(v) for v in pools.values()) <= 4
    for role, phases in alone.layouts.items():
        ranks = sum(pools[mapping.get(role, mapping["actor"])])
        for pp, tp, dp in phases.values():
            assert pp * tp * dp == ranks, (role, phases)
    merged = OmegaConf.merge(OmegaConf.load(resolve_recipe("quickstart")), OmegaConf.load(snippet))
    recipe = tmp_path / "quickstart_planned.yaml"
    OmegaConf.save(merged, recipe)
    cfg = load_config(str(recipe))
    assert cfg.trainer.n_gpus_per_node == 4 and cfg.trainer.device == "cpu"
    assert dict(cfg.resource_pool.pools) == pools
    assert cfg.trainer.experiment_name == "quickstart"  # the rest of the quickstart is kept


def test_plans_beyond_the_engine_are_not_emitted():
    """Issue 15 item 3: a reference on its own pool (the actor's process would absorb it while the pool's devices
    stay counted) and a critic with pp > 1 (no engine has pipeline parallelism) are refused, with the reason."""
    cluster = parse_cluster("2x8:A100-80G")
    models = {r: get_model("7B") for r in ("actor", "critic", "reference", "reward")}
    search = MappingSearch(models, Workload(), cluster)  # unrestricted: the paper's system
    apart = search.plan([["actor", "reward"], ["critic", "reference"]], [8, 8])
    with pytest.raises(SpecError, match="reference apart from the actor"):
        plan_to_config(apart, cluster, Workload())
    assert any("reference apart" in p for p in plan_problems(apart, ENGINE_ABILITIES["fsdp2"]))
    critic = search.set_estimate(("critic",), 8)
    piped = [lay for lay in search.layouts("critic", 8) if lay.pp == 2][0]
    forced = dataclasses.replace(critic, phases=tuple(dataclasses.replace(p, layout=piped) for p in critic.phases))
    plan = dataclasses.replace(search.plan([["actor", "reference", "reward"], ["critic"]], [8, 8]),
                               sets=(search.set_estimate(("actor", "reference", "reward"), 8), forced))
    problems = plan_problems(plan, ENGINE_ABILITIES["fsdp2"])
    assert any(p.startswith("critic train pp2") and "no pipeline parallelism" in p for p in problems), problems
    with pytest.raises(SpecError, match="cannot run on engine fsdp2"):
        plan_to_config(plan, cluster, Workload())


def test_grpo_snippet_maps_every_config_role_and_sets_the_estimator(tmp_path, capsys):
    snippet = tmp_path / "grpo.yaml"
    args = ["plan", "--cluster", "1x8:H100", "--algorithm", "grpo", "--actor", "7B", "--batch", "64", "--n", "8"]
    assert main([*args, "--reward", "rule", "--emit-config", str(snippet)]) == 0
    capsys.readouterr()
    merged = OmegaConf.merge(OmegaConf.load(resolve_recipe("quickstart")), OmegaConf.load(snippet))
    recipe = tmp_path / "r.yaml"
    OmegaConf.save(merged, recipe)
    cfg = load_config(str(recipe))
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.critic.enable is False
    assert cfg.actor_rollout_ref.rollout.n == 8
    assert set(cfg.resource_pool.mapping) == {"actor", "critic", "reward"}
    assert set(cfg.resource_pool.mapping.values()) <= set(cfg.resource_pool.pools)
    # no --reward is the rule reward: the same snippet (never the actor's causal LM planned as a reward model)
    rule = snippet.read_text()
    assert main([*args, "--emit-config", str(snippet)]) == 0
    assert snippet.read_text() == rule and "reward_model" not in rule
    # a reward model of a preset shape: its pool is mapped to the reward_model worker, whose path the user gives
    assert main([*args, "--reward", "7B", "--emit-config", str(snippet)]) == 0
    assert "set reward_model.model.path" in snippet.read_text()
    snip = yaml.safe_load(snippet.read_text())
    assert snip["reward_model"] == {"enable": True}
    assert snip["resource_pool"]["mapping"]["reward_model"] in snip["resource_pool"]["pools"]


def test_cost_preset_flags_override_it_and_explain_lists_every_knob_value(capsys):
    from hybridflow.mapping.presets import KNOBS

    args = ["plan", "--cluster", "2x8:A100-80G", "--actor", "7B", "--cost-preset", "a100-paper", "--call-overhead",
            "0.5", "--max-gen-pp", "1", "--top-k", "1", "--json", "--explain"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sequential_driver"] is False  # from the preset
    assert all(p["layout"][0] == 1 for s in out["best"]["sets"] for p in s["phases"] if p["kind"] == "generate")
    sens = out["sensitivity"]
    assert len(sens["checked"]) == sum(len(k.values) for k in KNOBS)
    assert sens["robust"] == (not sens["flips"]) and sens["placement"] == "colocate"
    assert main(["plan", "--cluster", "2x8:A100-80G", "--actor", "7B", "--cost-preset", "a100-paper", "--top-k", "1",
                 "--explain"]) == 0
    assert "sensitivity: chosen placement colocate" in capsys.readouterr().out


def test_cost_preset_params():
    import argparse

    from hybridflow.mapping.plan_cli import _params, add_arguments
    from hybridflow.mapping.presets import get_cost_preset

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--cluster", "1x8:A100-80G", "--actor", "7B"]
    assert _params(parser.parse_args(base)) == get_cost_preset("cpu")
    params = _params(parser.parse_args(base + ["--cost-preset", "a100-paper", "--call-overhead", "0.5", "--zero", "3",
                                               "--no-recompute"]))
    paper = get_cost_preset("a100-paper")
    assert (params.call_overhead_s, params.zero_stage, params.recompute) == (0.5, 3, False)
    assert (params.layer_overhead_s, params.sequential_driver) == (paper.layer_overhead_s, False)
