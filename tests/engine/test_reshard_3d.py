"""The 3D-HybridEngine from a Megatron-style (dp x tp x pp) training layout (HybridFlow, Sheng et al. 2024, Sec. 5).

Part 1, the plan alone (one process): training boxes, generation coordinates and micro data-parallel groups of
small layouts, derived here by hand from the layout rules (rank = (s * dp + d) * tp + t; a weight of stage s is
held by stage s only; tp chunks ``tp_dim``; ``dp_dim=None``: every dp rank holds the whole tp chunk).

Part 2, 4 gloo ranks: a synthetic engine (defined and registered only in this test's worker processes) holds a
tiny Llama and yields Megatron-layout shards: the parameters of its pipeline stage, tp-local ``torch.chunk``
slices, replicated over dp, as copies (its module's own weights are then overwritten with NaN, so whatever is
read from anywhere but the yielded shards shows). For each layout:

(a) every tensor of a rank's generation shard is bit-identical to the matching slice of the full model;
(b) greedy generation through the resharded tp_g model gives the single-process HF model's tokens (logprobs
    within 1e-5);
(c) each rank gathers from exactly the micro data-parallel group derived by hand;
(d) the tensor memory allocated during the switch (measured) <= the plan's own count of what it allocates
    (generation shard less in-place parts + the largest bucket) <= model bytes / tp_g + one bucket, and no
    rank holds a full copy when tp_g > 1.
"""

import itertools
import math
from types import SimpleNamespace
from typing import Iterator, Optional

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaForCausalLM

from hybridflow.distributed.launch import spawn_ranks
from helpers.generation import greedy_rollout, left_padded_prompts
from helpers.models import tiny_model
from hybridflow.engine import HybridEngine, TensorMemoryTracker
from hybridflow.engine.plan import Layout, build_reshard_plan, generation_coords
from hybridflow.protocol import DataProto
from hybridflow.rollout import HFRollout
from hybridflow.training import EngineSpec, ParallelLayout, TrainEngine, WeightSpec

# ----------------------------------------------------------------------------------------------- part 1: the plan
# two "layers" (q colwise, o rowwise, a norm), a vocab-parallel embedding (stage 0) and head (last stage)
SHAPES = {"embed": (16, 8), "l0.q": (8, 8), "l0.o": (8, 8), "l0.norm": (8,),
          "l1.q": (8, 8), "l1.o": (8, 8), "l1.norm": (8,), "head": (16, 8)}
TP_DIMS = {"embed": 0, "l0.q": 0, "l0.o": 1, "l0.norm": None, "l1.q": 0, "l1.o": 1, "l1.norm": None, "head": 0}
STAGE2 = {"embed": 0, "l0.q": 0, "l0.o": 0, "l0.norm": 0, "l1.q": 1, "l1.o": 1, "l1.norm": 1, "head": 1}


def _plan3d(dp: int, tp: int, pp: int, tp_g: int):
    stages = STAGE2 if pp == 2 else {n: None for n in SHAPES}
    world = dp * tp * pp
    return build_reshard_plan(SHAPES, TP_DIMS, TP_DIMS, Layout(dp, tp, pp), Layout(world // tp_g, tp_g),
                              dp_dims={n: None for n in SHAPES}, pp_stages=stages)


def test_layout_order_is_the_engine_contracts():
    for dp, tp, pp in [(2, 2, 2), (1, 2, 4), (3, 1, 2), (2, 4, 1)]:
        mine, contract = Layout(dp, tp, pp), ParallelLayout(dp=dp, tp=tp, pp=pp)
        for rank in range(dp * tp * pp):
            assert mine.coords(rank) == contract.coords(rank)
            assert mine.rank_of(*mine.coords(rank)) == rank


def test_tp2_pp2_to_tp_g2_boxes_by_hand():
    """Ranks 0, 1: stage 0, tp 0 / 1; ranks 2, 3: stage 1. tp_g = tp: generation coords (s, t), and each rank
    keeps its own stage's chunk in place and receives the other stage's chunk t from (t, other stage)."""
    plan = _plan3d(1, 2, 2, 2)
    assert plan.coords == ((0, 0), (0, 1), (1, 0), (1, 1))
    assert plan.gen_tp_groups() == [[0, 1], [2, 3]]
    q0, q1, o1, n1 = plan["l0.q"], plan["l1.q"], plan["l1.o"], plan["l1.norm"]
    assert q0.train_boxes == (((0, 4), (0, 8)), ((4, 8), (0, 8)), None, None)
    assert q1.train_boxes == (None, None, ((0, 4), (0, 8)), ((4, 8), (0, 8)))
    assert o1.train_boxes == (None, None, ((0, 8), (0, 4)), ((0, 8), (4, 8)))
    assert n1.train_boxes == (None, None, ((0, 8),), ((0, 8),))
    assert q0.aliased(0) and q0.aliased(1) and not q0.aliased(2) and not q1.aliased(0)
    assert [(t.src, t.dst, t.region) for t in q1.transfers if t.dst == 0] == [(2, 0, ((0, 4), (0, 8)))]
    assert [(t.src, t.dst, t.region) for t in o1.transfers if t.dst == 1] == [(3, 1, ((0, 8), (4, 8)))]
    # the norm is held by both stage-1 ranks; rank 0 takes it from the one it already receives from
    assert [t.src for t in n1.transfers if t.dst == 0] == [2]
    assert [plan.micro_dp_group(r) for r in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def test_tp2_pp2_to_tp_g1_every_rank_gathers_the_rest():
    plan = _plan3d(1, 2, 2, 1)
    assert [plan.micro_dp_group(r) for r in range(4)] == [[0, 1, 2, 3]] * 4
    # rank 0 holds embed rows 0-7 (64), l0.q rows 0-3 (32), l0.o cols 0-3 (32), l0.norm (8) of 528 elements
    assert plan.recv_bytes(0) == (528 - 136) * 4
    from_1 = sorted((p.name, t.region) for p in plan.params for t in p.transfers if t.src == 1 and t.dst == 0)
    assert from_1 == [("embed", ((8, 16), (0, 8))), ("l0.o", ((0, 8), (4, 8))), ("l0.q", ((4, 8), (0, 8)))]
    assert all(plan.gen_bytes(r) == plan.model_bytes() for r in range(4))


def test_tp1_pp2_dp2_to_tp_g2():
    """Ranks (d, s): 0 = (0, 0), 1 = (1, 0), 2 = (0, 1), 3 = (1, 1); replica index e = 2d + s, k = 2: generation
    (dp_g, tp_g) = (s, d). Every rank holds its stage whole (tp = 1, replicated over dp); it takes the other
    stage's chunk d from the stage-1 (stage-0) rank of its own dp index, so sends are spread evenly."""
    plan = _plan3d(2, 1, 2, 2)
    assert plan.coords == ((0, 0), (0, 1), (1, 0), (1, 1))
    assert plan["l1.q"].train_boxes == (None, None, ((0, 8), (0, 8)), ((0, 8), (0, 8)))
    assert plan["l0.q"].gen_boxes[1] == ((4, 8), (0, 8)) and plan["l0.q"].aliased(1)
    assert not plan["l0.o"].aliased(1)  # a column block of its own tensor: a local copy
    assert [plan.micro_dp_group(r) for r in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    # each rank sends the half its peer needs of its stage: q 32 + o 32 + norm 8 + embed / head rows 64
    assert [plan.send_bytes(r) for r in range(4)] == [136 * 4] * 4


@pytest.mark.parametrize("tp_g,expected", [
    (1, lambda d, t, s: {(d, t2, s2) for t2 in range(2) for s2 in range(2)}),  # its own replica, whole
    (2, lambda d, t, s: {(d, t, 0), (d, t, 1)}),  # its tp chunk from the other stage of its replica
])
def test_dp_replicas_stay_apart(tp_g, expected):
    """dp2 x tp2 x pp2 (8 ranks), everything replicated over dp: a rank gathers only inside its own training
    dp index (its model replica), though the other replica holds the same boxes."""
    plan = _plan3d(2, 2, 2, tp_g)
    layout = Layout(2, 2, 2)
    for rank in range(8):
        want = sorted(layout.rank_of(*c) for c in expected(*layout.coords(rank)))
        assert plan.micro_dp_group(rank) == want, rank


LAYOUTS3D = [(1, 2, 2, 2), (1, 2, 2, 1), (1, 2, 2, 4), (2, 1, 2, 2), (2, 1, 2, 1), (2, 1, 2, 4), (2, 2, 2, 1),
             (2, 2, 2, 2), (2, 2, 2, 4), (1, 1, 2, 2), (2, 2, 1, 1), (2, 2, 1, 4), (1, 4, 2, 2), (1, 4, 2, 8)]


@pytest.mark.parametrize("layout", LAYOUTS3D, ids=str)
def test_3d_plans_cover_each_generation_shard_once_from_holders(layout):
    dp, tp, pp, tp_g = layout
    plan = _plan3d(dp, tp, pp, tp_g)
    world = dp * tp * pp
    for p in plan.params:
        for rank in range(world):
            counts: dict = {}
            for tr in p.transfers:
                if tr.dst != rank:
                    continue
                src_box = p.train_boxes[tr.src]
                assert src_box is not None, (p.name, tr)  # only a holder sends
                assert all(b0 <= r0 and r1 <= b1 for (b0, b1), (r0, r1) in zip(src_box, tr.region))
                for idx in itertools.product(*(range(s, e) for s, e in tr.region)):
                    counts[idx] = counts.get(idx, 0) + 1
            expected = set(itertools.product(*(range(s, e) for s, e in p.gen_boxes[rank])))
            assert set(counts) == expected and set(counts.values()) == {1}, (p.name, rank)
    for rank in range(world):  # its own stage's chunk overlaps its generation chunk: at least one local piece
        assert any(tr.src == tr.dst == rank for p in plan.params for tr in p.transfers)
        assert (plan.gen_bytes(rank) < plan.model_bytes()) == (tp_g > 1)  # no full copy unless tp_g = 1


def test_fsdp_defaults_are_dp_dim0_all_stages():
    a = build_reshard_plan(SHAPES, TP_DIMS, TP_DIMS, Layout(2, 2), Layout(2, 2))
    b = build_reshard_plan(SHAPES, TP_DIMS, TP_DIMS, Layout(2, 2, 1), Layout(2, 2),
                           dp_dims={n: 0 for n in SHAPES}, pp_stages={n: None for n in SHAPES})
    assert a == b
    assert a["l0.q"].train_boxes[2] == ((2, 4), (0, 8))  # rank 2 = (d=1, t=0): tp chunk rows 0-3, dp piece 1
    assert a["l0.q"].train_boxes[1] == ((4, 6), (0, 8))  # rank 1 = (d=0, t=1): tp chunk rows 4-7, dp piece 0


@pytest.mark.parametrize("kwargs,message", [
    ({"pp_stages": {"l0.q": 2}}, "pp_stage=2 outside"),
    ({"dp_dims": {"l0.norm": 1}}, "dp_dim=1 is not one of its dims"),
])
def test_bad_weight_specs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_reshard_plan(SHAPES, TP_DIMS, TP_DIMS, Layout(1, 2, 2), Layout(2, 2), **kwargs)


def test_generation_layout_has_no_stages():
    with pytest.raises(ValueError, match="no pipeline stages"):
        generation_coords(Layout(1, 2, 2), Layout(1, 2, 2))


# -------------------------------------------------------------------------------- part 2: 4 gloo ranks
V, B, P, R, LAYERS = 64, 8, 6, 5, 4  # vocab, prompts, prompt tokens, response tokens, decoder layers
BUCKET = 4096  # bytes: many buckets even for this tiny model
ENGINE = "test_megatron_layout"
COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")
# (dp, tp, pp, tp_g, tied embeddings)
CASES = [(1, 2, 2, 2, False), (1, 2, 2, 1, False), (1, 2, 2, 4, True), (2, 1, 2, 2, True), (1, 1, 4, 4, False),
         (2, 2, 1, 1, True)]


def _model(tied: bool) -> torch.nn.Module:
    return tiny_model(LlamaForCausalLM, seed=0, vocab_size=V, num_hidden_layers=LAYERS, num_attention_heads=8,
                      num_key_value_heads=4, tie_word_embeddings=tied, max_position_embeddings=64)


def _megatron_tp_dim(name: str) -> Optional[int]:
    """Megatron-core's tensor-parallel split in HF names: column-parallel q/k/v (per kv group) and gate/up, row-
    parallel o/down, vocab-parallel embedding and output layer, replicated norms."""
    if "norm" in name:
        return None
    if any(f".{k}." in name for k in ROWWISE):
        return 1
    return 0


def _stage(name: str, pp: int) -> Optional[int]:
    """Layers cut into pp equal runs; embedding on the first stage (a tied one too: the HF model has one
    parameter), final norm and untied head on the last; None without pipeline parallelism."""
    if pp == 1:
        return None
    if name.startswith("model.layers."):
        return int(name.split(".")[2]) // (LAYERS // pp)
    return 0 if name.startswith("model.embed_tokens") else pp - 1


class SyntheticMegatronEngine(TrainEngine):
    """A full tiny Llama, exposed through the engine contract in Megatron-core's layout (nothing else of the
    contract is implemented: the resharder needs only the layout, ``module``, the specs and the shards)."""

    def __init__(self, spec: EngineSpec, module: torch.nn.Module, shards: dict, specs: dict) -> None:
        self.spec, self.layout, self.module = spec, spec.layout, module
        self.optimizer = self.lr_scheduler = None
        self.skipped_steps = 0
        self._shards, self._specs = shards, specs

    @classmethod
    def build(cls, spec: EngineSpec) -> "SyntheticMegatronEngine":
        module = _model(spec.model.tied)
        d, t, s = spec.layout.coords(dist.get_rank())
        specs, shards = {}, {}
        mistake = getattr(spec.model, "mistake", None)  # a broken engine: "all_stages" or "omit_one"
        skip = mistake == "omit_one"  # leave out this rank's first parameter
        for name, param in module.named_parameters():
            tp_dim, stage = _megatron_tp_dim(name), _stage(name, spec.layout.pp)
            specs[name] = WeightSpec(tuple(param.shape), param.element_size(), tp_dim, dp_dim=None, pp_stage=stage)
            if skip and stage in (None, s):
                skip = False
            elif stage in (None, s) or mistake == "all_stages":
                local = param.detach() if tp_dim is None else param.detach().chunk(spec.layout.tp, dim=tp_dim)[t]
                shards[name] = local.clone()
        with torch.no_grad():  # the resharder must read the shards, never the module's weights
            for param in module.parameters():
                param.fill_(float("nan"))
        return cls(spec, module, shards, specs)

    def iter_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._shards.items())

    def weight_specs(self) -> dict:
        return dict(self._specs)

    def offload(self) -> None:
        pass

    def onload(self, optimizer: bool = True) -> None:
        pass

    def _unused(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError("not part of the resharding contract this engine exists to test")

    set_train = forward = zero_grad = optimizer_step = lr_scheduler_step = iter_weights = _unused
    save_checkpoint = load_checkpoint = _unused


def _prompts() -> DataProto:
    return left_padded_prompts(P, V)


def _rollout(module: torch.nn.Module) -> HFRollout:
    return greedy_rollout(module, R, V)


def _case(dp: int, tp: int, pp: int, tp_g: int, tied: bool, rank: int) -> dict:
    from hybridflow.training import get_engine_class

    spec = EngineSpec(kind="policy", model=SimpleNamespace(tied=tied), layout=ParallelLayout(dp=dp, tp=tp, pp=pp),
                      device="cpu")
    train = get_engine_class(ENGINE).build(spec)
    engine = HybridEngine(train, gen_tp=tp_g, bucket_bytes=BUCKET)
    plan = engine.plan
    result = {"model_bytes": plan.model_bytes(), "gen_dp": engine.gen_dp_rank, "gen_tp": engine.gen_tp_rank,
              "micro_dp_group": plan.micro_dp_group(rank), "gen_bytes": plan.gen_bytes(rank),
              "plan_peak": plan.peak_extra_bytes(rank, BUCKET), "held": sorted(dict(train.iter_shards()))}
    with TensorMemoryTracker() as mem:
        gen_model = engine.switch_to_generation()
    result["peak_extra_bytes"] = mem.peak_bytes
    result["shards"] = {name: p.detach().clone() for name, p in gen_model.named_parameters()}
    chunk = _prompts().chunk(plan.gen.dp)[engine.gen_dp_rank]
    out = _rollout(gen_model).generate_sequences(chunk)
    result["responses"], result["log_probs"] = out.batch["responses"], out.batch["rollout_log_probs"]
    engine.check_lockstep(out.batch["responses"])
    engine.switch_to_training()
    result["freed"] = all(p.device.type == "meta" for p in gen_model.parameters())
    return result


def _worker(rank: int, out: str) -> None:
    from hybridflow.training import register_engine, registered_engines

    if ENGINE not in registered_engines():  # registered in the worker processes only
        register_engine(ENGINE, pipeline_parallel=True)(SyntheticMegatronEngine)
    results = {case: _case(*case, rank) for case in CASES}
    for mistake in ("all_stages", "omit_one"):  # engines breaking the contract: caught before any transfer
        spec = EngineSpec(kind="policy", model=SimpleNamespace(tied=False, mistake=mistake),
                          layout=ParallelLayout(dp=1, tp=2, pp=2), device="cpu")
        engine = HybridEngine(SyntheticMegatronEngine.build(spec), gen_tp=2, bucket_bytes=BUCKET)
        try:
            engine.switch_to_generation()
            results[mistake] = None
        except RuntimeError as error:
            results[mistake] = str(error)
    torch.save(results, f"{out}.{rank}")


@pytest.fixture(scope="module")
def runs_raw(tmp_path_factory) -> list:
    """Per rank: case -> its results (one spawn of 4 ranks for all cases)."""
    out = str(tmp_path_factory.mktemp("reshard3d") / "result")
    spawn_ranks(_worker, out, world=4)
    return [torch.load(f"{out}.{r}") for r in range(4)]


@pytest.fixture(scope="module")
def runs(runs_raw) -> dict:
    return {case: [runs_raw[r][case] for r in range(4)] for case in CASES}


@pytest.fixture(scope="module")
def refs() -> dict:
    """Single process HF model: full weights and greedy generation, per tying."""
    out = {}
    for tied in (False, True):
        model = _model(tied).eval()
        gen = _rollout(model).generate_sequences(_prompts())
        out[tied] = {"full": {k: v.clone() for k, v in model.state_dict().items()},
                     "responses": gen.batch["responses"], "log_probs": gen.batch["rollout_log_probs"]}
    return out


def _expected_shard(name: str, full: torch.Tensor, tp_g: int, tp_rank: int) -> torch.Tensor:
    """The generation slice by the architecture's rules (vocabulary rows for embedding and head)."""
    if tp_g == 1 or "norm" in name:
        return full
    return full.chunk(tp_g, dim=1 if any(f".{k}." in name for k in ROWWISE) else 0)[tp_rank]


def _expected_group(case: tuple, rank: int) -> list[int]:
    """Who each rank gathers from, derived by hand from the layouts (module doc of the plan)."""
    dp, tp, pp, tp_g, _ = case
    layout = ParallelLayout(dp=dp, tp=tp, pp=pp)
    d, t, s = layout.coords(rank)
    if tp_g >= tp and pp == 2:  # its tp chunk (or a part of it) of the other stage, from its own dp index
        return sorted({rank, layout.rank_of(d, t, 1 - s)})
    if pp == 4 or (tp_g == 1 and dp == 1):  # every other stage / every other chunk: everyone
        return [0, 1, 2, 3]
    return sorted(layout.rank_of(d, t2, s) for t2 in range(tp))  # tp_g = 1 over dp replicas: its own replica


def _case_id(case: tuple) -> str:
    dp, tp, pp, tp_g, tied = case
    return f"dp{dp}-tp{tp}-pp{pp}-tpg{tp_g}" + ("-tied" if tied else "")


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_megatron_layout_shards_are_exact_slices(case, runs, refs):
    dp, tp, pp, tp_g, tied = case
    full = refs[tied]["full"]
    for rank, res in enumerate(runs[case]):
        stage = ParallelLayout(dp=dp, tp=tp, pp=pp).coords(rank)[2]
        assert res["held"] == sorted(n for n in full if n in res["shards"] and _stage(n, pp) in (None, stage))
        assert sorted(res["shards"]) == sorted(n for n in full if not (tied and n == "lm_head.weight"))
        for name, shard in res["shards"].items():
            expected = _expected_shard(name, full[name], tp_g, res["gen_tp"])
            assert torch.equal(shard, expected), f"rank {rank} {name}: {tuple(shard.shape)} vs {tuple(expected.shape)}"
        assert res["freed"]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_megatron_layout_groups_and_greedy_tokens(case, runs, refs):
    dp, tp, pp, tp_g, tied = case
    ranks = runs[case]
    groups: dict = {}
    for res in ranks:
        groups.setdefault(res["gen_dp"], []).append(res["gen_tp"])
    assert sorted(groups) == list(range(4 // tp_g)) and all(sorted(g) == list(range(tp_g)) for g in groups.values())
    want_tokens = refs[tied]["responses"].chunk(4 // tp_g)
    want_logp = refs[tied]["log_probs"].chunk(4 // tp_g)
    assert refs[tied]["responses"].ne(0).sum() > B  # real tokens were generated
    for rank, res in enumerate(ranks):
        assert res["micro_dp_group"] == _expected_group(case, rank), f"rank {rank}"
        assert torch.equal(res["responses"], want_tokens[res["gen_dp"]]), f"rank {rank}"
        torch.testing.assert_close(res["log_probs"], want_logp[res["gen_dp"]], atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_megatron_layout_switch_memory(case, runs):
    tp_g = case[3]
    for rank, res in enumerate(runs[case]):
        bound = res["model_bytes"] / tp_g + BUCKET
        assert res["peak_extra_bytes"] <= res["plan_peak"] <= bound, (rank, res["peak_extra_bytes"], res["plan_peak"])
        held = sum(math.prod(t.shape) * 4 for t in res["shards"].values())
        assert held == res["gen_bytes"]  # the plan's count of the generation shard is what the model holds
        assert (held < res["model_bytes"]) == (tp_g > 1)  # no full copy unless tp_g = 1


@pytest.mark.slow
def test_shards_breaking_the_stage_contract_are_refused(runs_raw):
    """A rank yielding another stage's weights, or missing one of its own, is told which, before any transfer."""
    for rank, res in enumerate(runs_raw):
        assert res["all_stages"] is not None and "the reshard plan expects no shard" in res["all_stages"], rank
        assert res["omit_one"] is not None and "the engine yields no shard" in res["omit_one"], rank
        assert "pp_stage=" in res["omit_one"]
