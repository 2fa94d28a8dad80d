"""``hybridflow plan`` never recommends what ``hybridflow train`` cannot run (issue 15 item 3): layouts and
placements beyond the engine's abilities (hybridflow/mapping/abilities.py) leave the search, with the reason."""

import json

import pytest

from hybridflow.cli import main
from hybridflow.mapping.abilities import ENGINE_ABILITIES, UNRESTRICTED, get_abilities
from hybridflow.mapping.cost import Layout
from hybridflow.mapping.search import MappingSearch
from hybridflow.mapping.specs import SpecError, Workload, get_model, parse_cluster

FSDP2 = ENGINE_ABILITIES["fsdp2"]
ROLES = ("actor", "critic", "reference", "reward")


def _search(abilities, cluster="2x8:A100-80G", model="7B", workload=None):
    return MappingSearch({r: get_model(model) for r in ROLES}, workload or Workload(), parse_cluster(cluster),
                         abilities=abilities)


def test_ability_reasons():
    assert FSDP2.layout_reason("critic", Layout(2, 1, 4)).startswith("pp > 1: fsdp2 has no pipeline")
    assert FSDP2.layout_reason("actor", Layout(1, 1, 8), generate=True) is None
    assert "for generation" in FSDP2.layout_reason("actor", Layout(2, 2, 2), generate=True)
    assert FSDP2.layout_reason("actor", Layout(1, 4, 2)) is None  # DTensor tp in the actor
    assert FSDP2.layout_reason("reward", Layout(1, 2, 4)).startswith("tp > 1 for reward")
    assert FSDP2.placement_reason([("actor", "reward"), ("critic", "reference")]).startswith("reference apart")
    assert FSDP2.placement_reason([("actor", "reference"), ("critic", "reward")]) is None
    assert UNRESTRICTED.layout_reason("critic", Layout(32, 1, 1)) is None
    assert get_abilities("unrestricted") is UNRESTRICTED
    with pytest.raises(SpecError, match="unknown engine 'megatrn'; known: \\['fsdp2', 'megatron', 'unrestricted'\\]"):
        get_abilities("megatrn")


def test_every_plan_of_the_fsdp2_search_is_runnable():
    result = _search(FSDP2).run(top_k=50)
    assert result.by_placement
    for plan in result.by_placement.values():
        assert "reference" in plan.set_of("actor").roles
        layouts = {(ph.role, ph.kind): ph.layout for s in plan.sets for ph in s.phases}
        assert all(lay.pp == 1 for lay in layouts.values()), layouts
        assert all(lay.tp == 1 for (role, _), lay in layouts.items() if role in ("critic", "reward")), layouts
        assert layouts[("reference", "infer")] == layouts[("actor", "train")]
    # Bell(4) = 15 placements; the 5 that keep the reference with the actor are Bell(3) of {actor+ref, critic,
    # reward}: the other 10 are left out, with their reason
    by_reason = {e["reason"]: e for e in result.excluded}
    (apart,) = [e for e in result.excluded if e["what"] == "placement"]
    assert apart["count"] == 10 and apart["reason"].startswith("reference apart from the actor")
    assert result.placements == 15 and len(result.by_placement) + len(result.infeasible_placements) == 5
    assert any(r.startswith("pp > 1") for r in by_reason) and any(r.startswith("tp > 1 for critic") for r in by_reason)


def test_unrestricted_search_uses_what_fsdp2_cannot_run():
    """The old behaviour (and the paper's system): pipeline parallelism in the best plan on 16 A100s."""
    best = _search(UNRESTRICTED).run().best
    assert any(ph.layout.pp > 1 for s in best.sets for ph in s.phases)
    assert _search(UNRESTRICTED).run().excluded == []


def test_tied_reference_equals_brute_force_over_the_actor_layouts():
    """With the reference in the actor's process, the set's best is the minimum over the actor's training layouts
    of actor + reference on that same layout + the best generation in the memory they leave."""
    wl = Workload(batch=64, prompt_len=256, response_len=256)
    for n in (4, 8):
        s = _search(FSDP2, "1x8:A100-80G", "13B", wl)
        est = s.set_estimate(("actor", "reference"), n)
        refs = {c.layout: c for c in s.role_candidates("reference", n, prune=False)}
        best = None
        for a in s.role_candidates("actor", n, prune=False):
            r = refs.get(a.layout)
            if r is None:
                continue
            persistent = a.memory.persistent + r.memory.persistent
            if persistent + max(a.memory.transient, r.memory.transient) > s.usable:
                continue
            gen = s._generation(a.layout, n, s.usable - persistent)
            if gen is not None:
                total = a.seconds + r.seconds + gen[0]
                best = total if best is None else min(best, total)
        assert est is not None and best is not None
        assert est.seconds == pytest.approx(best, rel=1e-12)
        lay = {m.role: m.layout for m in est.memory}
        assert lay["reference"] == lay["actor"]


def test_cli_default_is_fsdp2_with_the_reasons_in_json(capsys, tmp_path):
    assert main(["plan", "--cluster", "2x8:A100-80G", "--actor", "7B", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["engine"] == "fsdp2"
    reasons = [e["reason"] for e in out["search"]["excluded"]]
    assert any("no pipeline parallelism" in r for r in reasons) and any("reference apart" in r for r in reasons)
    assert all(p["layout"][0] == 1 for s in out["best"]["sets"] for p in s["phases"])
    assert main(["plan", "--cluster", "2x8:A100-80G", "--actor", "7B", "--engine", "unrestricted", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["search"]["excluded"] == []
    code = main(["plan", "--cluster", "2x8:A100-80G", "--actor", "7B", "--engine", "unrestricted",
                 "--emit-config", str(tmp_path / "x.yaml")])
    assert code == 2 and "--emit-config needs an engine" in capsys.readouterr().err
