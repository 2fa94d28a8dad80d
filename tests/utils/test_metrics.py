"""Metrics pooled by kind (hybridflow.utils.metrics): pooling the values of uneven micro-batches in any grouping
gives the statistic of all the samples at once, computed here directly from the concatenated samples."""

import math

import pytest
import torch

from hybridflow.utils.metrics import Max, Mean, Min, Std, Sum, accumulate, finalize, reduce_metrics

# uneven micro-batches; the largest and the smallest sample sit in different ones
CHUNKS = [torch.tensor([1.0, 2.0, 9.5]), torch.tensor([-4.0]), torch.tensor([0.5, 3.0, 3.0, 7.0, -1.0]),
          torch.tensor([])]


def _declared(x: torch.Tensor) -> dict:
    return {"m": Mean.of(x), "hi": Max.of(x), "lo": Min.of(x), "sd": Std.of(x), "n": Sum(float(x.numel()))}


def test_micro_batches_pool_to_the_statistics_of_all_samples():
    every = torch.cat(CHUNKS).double()
    expected = {"m": every.mean().item(), "hi": 9.5, "lo": -4.0, "sd": every.std(unbiased=False).item(), "n": 9.0}
    flat = finalize(reduce_metrics(_declared(x) for x in CHUNKS))
    # pooled in two stages (two "ranks" of two micro-batches each, then the ranks): the same
    staged = finalize(reduce_metrics([reduce_metrics(_declared(x) for x in CHUNKS[:2]),
                                      reduce_metrics(_declared(x) for x in CHUNKS[2:])]))
    for got in (flat, staged):
        assert got == pytest.approx(expected, abs=1e-12)
    # what averaging the per-chunk values (the old reduction) would have logged is something else
    naive_max = sum(x.max().item() for x in CHUNKS[:3]) / 3
    assert not math.isclose(naive_max, expected["hi"])


def test_token_weighted_mean_and_accumulate():
    stats: dict = {}
    accumulate(stats, "clipfrac", Mean(0.5 * 10, 10))  # 10 tokens, half clipped
    accumulate(stats, "clipfrac", Mean(1.0 * 2, 2))  # 2 tokens, all clipped
    assert finalize(stats) == {"clipfrac": pytest.approx(7 / 12)}


def test_empty_metrics_log_zero_and_plain_numbers_pass_through_finalize():
    empty = torch.tensor([])
    got = finalize({"m": Mean.of(empty), "hi": Max.of(empty), "lo": Min.of(empty), "sd": Std.of(empty), "lr": 0.1})
    assert got == {"m": 0.0, "hi": 0.0, "lo": 0.0, "sd": 0.0, "lr": 0.1}
    # an empty extreme does not win over a real one
    assert finalize(reduce_metrics([{"hi": Max.of(empty)}, {"hi": Max(-3.0)}])) == {"hi": -3.0}


def test_undeclared_or_conflicting_kinds_are_refused():
    with pytest.raises(TypeError, match="'x' is a float; declare its kind"):
        reduce_metrics([{"x": 1.0}])
    with pytest.raises(TypeError, match="'x' is pooled as Max and Min"):
        reduce_metrics([{"x": Max(1.0)}, {"x": Min(0.0)}])


def test_a_span_pools_into_the_earliest_start_and_the_latest_end():
    from hybridflow.utils.metrics import Span

    pooled = reduce_metrics([{"s": Span(5.0, 6.0)}, {"s": Span(4.0, 5.5)}, {"s": Span()}])["s"]
    assert pooled == Span(4.0, 6.0) and pooled.result() == [(4.0, 6.0)]
    assert Span().result() == []
