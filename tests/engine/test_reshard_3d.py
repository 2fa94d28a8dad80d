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
import os
import socket
from types import SimpleNamespace
from typing import Iterator, Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaForCausalLM

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
