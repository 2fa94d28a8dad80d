"""``hybridflow plan --engine megatron`` (issue 48 item 4): the abilities come from the engine's registration
(hybridflow/training/megatron_config.py), every plan the search returns is one ``hybridflow train`` accepts, and the
emitted config loads with the plan's layouts applied to the ``megatron`` sections."""

import pytest

from hybridflow.cli import main
from hybridflow.config import load_config
from hybridflow.mapping.abilities import ENGINE_ABILITIES, get_abilities
from hybridflow.mapping.cost import Layout
from hybridflow.mapping.emit import plan_problems, write_config
from hybridflow.mapping.search import MappingSearch
from hybridflow.mapping.specs import Workload, get_model, parse_cluster
from hybridflow.trainer.layouts import run_layouts
from hybridflow.training import ENGINES

MEGATRON = get_abilities("megatron")


def test_abilities_are_the_registrations_metadata():
    assert set(ENGINE_ABILITIES) == {n for n in ENGINES.names() if ENGINES.meta(n, "abilities") is not None}
    assert MEGATRON.max_pp is None and MEGATRON.max_gen_pp == 1 and MEGATRON.reference_with_actor
    assert MEGATRON.tp_roles == MEGATRON.pp_roles == MEGATRON.ep_roles == {"actor", "reference", "critic"}
    assert MEGATRON.sp_roles == frozenset()


def test_megatron_reasons():
    assert MEGATRON.layout_reason("critic", Layout(2, 2, 2)) is None  # critic.megatron: tp x pp
    assert MEGATRON.layout_reason("actor", Layout(4, 1, 2)) is None
    assert "for generation" in MEGATRON.layout_reason("actor", Layout(2, 1, 4), generate=True)
    assert MEGATRON.layout_reason("reward", Layout(2, 1, 4)).startswith("pp > 1 for reward")  # rm_worker: dp only
    assert MEGATRON.layout_reason("reward", Layout(1, 2, 4)).startswith("tp > 1 for reward")
    assert MEGATRON.layout_reason("actor", Layout(1, 1, 4, sp=2)).startswith("sp > 1 for actor")
    assert MEGATRON.placement_reason([("actor", "reward"), ("critic", "reference")]).startswith("reference apart")


@pytest.mark.parametrize("cluster", ["1x4:H100", "1x8:H100"])
def test_every_megatron_plan_passes_the_configs_layout_checks(cluster, tmp_path):
    """Each placement's best plan of a small search is within the abilities, and its emitted config passes the
    load checks (``hybridflow.config.layouts``, the megatron layout checks) with the megatron sections set to the
    plan's train (tp, pp), which is what the workers then run."""
    spec, workload = parse_cluster(cluster), Workload(batch=64, prompt_len=256, response_len=256)
    search = MappingSearch({**{r: get_model("7B") for r in ("actor", "critic", "reference")}, "reward": None},
                           workload, spec,
                           abilities=MEGATRON)
    plans = list(search.run(top_k=20).by_placement.values())
    assert plans and any(ph.layout.pp > 1 for p in plans for est in p.sets for ph in est.phases)
    for n, plan in enumerate(plans):
        assert plan_problems(plan, MEGATRON) == []
        path = tmp_path / f"plan{n}.yaml"
        write_config(path, plan, spec, workload, abilities=MEGATRON)
        cfg = load_config(str(path))  # raises ConfigError listing what train would refuse
        for role, section in (("actor", cfg.actor_rollout_ref.actor), ("critic", cfg.critic)):
            pp, tp, dp = cfg.layouts[role].train
            assert (section.megatron.pipeline_model_parallel_size, section.megatron.tensor_model_parallel_size) == \
                (pp, tp), plan.describe()
            assert run_layouts(cfg)[role]["train"] == (dp, tp, pp)  # what the workers run: (dp, tp, pp)
        assert cfg.actor_rollout_ref.actor.tensor_model_parallel_size == 1  # not the DTensor tp


def test_plan_cli_emits_a_megatron_config_that_loads(tmp_path, capsys):
    snippet = tmp_path / "megatron.yaml"
    args = ["plan", "--cluster", "1x8:H100", "--actor", "7B", "--engine", "megatron", "--emit-config", str(snippet)]
    assert main(args) == 0
    capsys.readouterr()
    cfg = load_config(str(snippet))
    assert cfg.actor_rollout_ref.actor.strategy == cfg.critic.strategy == "megatron"
    pp, tp, dp = cfg.layouts.actor.train
    assert (cfg.actor_rollout_ref.actor.megatron.pipeline_model_parallel_size,
            cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size) == (pp, tp)
    assert pp * tp * dp == 8
