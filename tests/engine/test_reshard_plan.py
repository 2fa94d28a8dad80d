"""The reshard plan in one process: the paper's grouping, exact coverage of every generation shard, transfers only
inside micro data-parallel groups, bounded buckets, and the layout errors."""

import itertools
import math

import pytest

from hybridflow.engine.plan import Layout, build_reshard_plan, chunk_range, generation_coords, is_contiguous_region

# a small "model": colwise (split on dim 0 over tp), rowwise (dim 1), replicated norm, vocab rows in generation
SHAPES = {"embed": (16, 8), "q": (8, 8), "o": (8, 8), "norm": (8,), "up": (16, 8), "down": (8, 16)}
TRAIN_DIMS = {"embed": None, "q": 0, "o": 1, "norm": None, "up": 0, "down": 1}
GEN_DIMS = {"embed": 0, "q": 0, "o": 1, "norm": None, "up": 0, "down": 1}
LAYOUTS = [((2, 1), 1), ((2, 1), 2), ((1, 2), 1), ((1, 2), 2), ((2, 2), 1), ((2, 2), 2), ((2, 2), 4),
           ((1, 4), 2), ((4, 1), 2), ((1, 4), 1), ((4, 1), 4), ((2, 4), 2), ((4, 2), 8)]


def _plan(train, tp_g):
    world = train[0] * train[1]
    return build_reshard_plan(SHAPES, TRAIN_DIMS, GEN_DIMS, Layout(*train), Layout(world // tp_g, tp_g))


def test_paper_grouping_tp4_to_tp2():
    """HybridFlow Fig. 8: training tp=4 on ranks 0-3 (1-based G1-G4 in the paper), generation tp_g=2: generation
    tp groups are strided ({0, 2}, {1, 3}) and each rank gathers only inside its micro-dp group ({0, 1} or {2, 3})."""
    plan = _plan((1, 4), 2)
    assert plan.gen_tp_groups() == [[0, 2], [1, 3]]
    assert [plan.micro_dp_group(r) for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    # rank 0 holds training shard 0 of q and needs generation shard 0 = training shards 0 and 1
    assert plan["q"].train_boxes[0] == ((0, 2), (0, 8)) and plan["q"].gen_boxes[0] == ((0, 4), (0, 8))


@pytest.mark.parametrize("train,tp_g", LAYOUTS, ids=lambda v: str(v))
def test_every_generation_shard_is_covered_exactly_once(train, tp_g):
    plan = _plan(train, tp_g)
    world = train[0] * train[1]
    for p in plan.params:
        for rank in range(world):
            counts = {}
            for tr in p.transfers:
                if tr.dst != rank:
                    continue
                assert p.train_boxes[tr.src] == _superset(p.train_boxes[tr.src], tr.region)  # the source holds it
                for idx in itertools.product(*(range(s, e) for s, e in tr.region)):
                    counts[idx] = counts.get(idx, 0) + 1
            expected = set(itertools.product(*(range(s, e) for s, e in p.gen_boxes[rank])))
            assert set(counts) == expected and set(counts.values()) == {1}, (p.name, rank)


def _superset(box, region):
    assert all(b0 <= r0 and r1 <= b1 for (b0, b1), (r0, r1) in zip(box, region))
    return box


@pytest.mark.parametrize("train,tp_g", LAYOUTS, ids=lambda v: str(v))
def test_generation_shards_are_one_over_tp_g(train, tp_g):
    """Only tp_g = 1 makes a rank hold a full copy; otherwise the split weights are 1/tp_g each."""
    plan = _plan(train, tp_g)
    replicated = sum(math.prod(SHAPES[n]) * 4 for n, d in GEN_DIMS.items() if d is None)
    for rank in range(train[0] * train[1]):
        expected = (plan.model_bytes() - replicated) // tp_g + replicated
        assert plan.gen_bytes(rank) == expected
        assert (plan.gen_bytes(rank) == plan.model_bytes()) == (tp_g == 1)


@pytest.mark.parametrize("train,tp_g", LAYOUTS, ids=lambda v: str(v))
def test_generation_tp_groups_and_micro_dp_groups(train, tp_g):
    plan = _plan(train, tp_g)
    world = train[0] * train[1]
    groups = plan.gen_tp_groups()
    assert sorted(r for g in groups for r in g) == list(range(world))
    for rank in range(world):
        group = plan.micro_dp_group(rank)
        assert all(tr.src in group for p in plan.params for tr in p.transfers if tr.dst == rank)
    # pure tensor parallel, generation less split than training: groups of tp / tp_g ranks (the paper's d_m)
    if train[0] == 1 and train[1] % tp_g == 0:
        assert all(len(plan.micro_dp_group(r)) == train[1] // tp_g for r in range(world))


def test_fsdp_shard_equal_to_generation_shard_is_used_in_place():
    """dp=2 -> tp_g=2: the FSDP piece of a colwise weight (rows half d) is exactly its tp_g shard: no transfer."""
    plan = _plan((2, 1), 2)
    for rank in range(2):
        assert plan["q"].aliased(rank) and plan["up"].aliased(rank) and plan["embed"].aliased(rank)
        assert not plan["o"].aliased(rank)
        assert all(tr.src == tr.dst for tr in plan["q"].transfers)


@pytest.mark.parametrize("bucket", [16, 64, 100, 10_000])
def test_buckets_bound_what_each_rank_moves(bucket):
    plan = _plan((2, 2), 1)
    seen = {}
    for b in plan.buckets(bucket):
        load = [0, 0, 0, 0]
        for index, transfers in b:
            p = plan.params[index]
            for tr in transfers:
                if tr.src != tr.dst:
                    load[tr.src] += tr.numel * 4
                    load[tr.dst] += tr.numel * 4
                seen.setdefault((p.name, tr.dst), 0)
                seen[p.name, tr.dst] += tr.numel
        row_bytes = 16 * 4  # the widest single row
        assert max(load) <= max(bucket, row_bytes)
    for p in plan.params:  # the pieces still cover every shard
        for rank in range(4):
            assert seen[p.name, rank] == math.prod(e - s for s, e in p.gen_boxes[rank])


def test_chunk_range_follows_torch_chunk():
    import torch

    for n, parts in [(10, 4), (7, 2), (3, 4), (0, 2), (8, 8)]:
        pieces = torch.arange(n).chunk(parts)
        for i in range(parts):
            start, stop = chunk_range(n, parts, i)
            got = torch.arange(n)[start:stop]
            want = pieces[i] if i < len(pieces) else torch.arange(0)
            assert torch.equal(got, want), (n, parts, i)


def test_contiguous_regions():
    box = ((0, 4), (0, 6))
    assert is_contiguous_region(((1, 3), (0, 6)), box)  # whole rows
    assert is_contiguous_region(((2, 3), (1, 4)), box)  # part of one row
    assert not is_contiguous_region(((0, 4), (0, 3)), box)  # a column block


@pytest.mark.parametrize("train,gen,message", [
    ((2, 2), (1, 3), "same ranks"),
    ((1, 4), (2, 3), "same ranks"),
])
def test_layout_errors(train, gen, message):
    with pytest.raises(ValueError, match=message):
        generation_coords(Layout(*train), Layout(*gen))


def test_tp_sizes_that_do_not_divide_each_other():
    with pytest.raises(ValueError, match="must divide the other"):
        generation_coords(Layout(2, 3), Layout(3, 2))
