"""The one mini-batch / micro-batch update loop of every trained role (the PPO actor and the critics).

For each mini-batch of ``epochs`` passes over this rank's data (optionally shuffled): the loss normalisers of the
mini-batch (:func:`hybridflow.training.micro.global_agg_kwargs`, totals over all dp ranks), gradients accumulated
over its micro-batches (:meth:`TrainEngine.forward_backward_micro_batches`, all of them in one call), then one
optimizer step with grad clipping and the non-finite guard (:meth:`TrainEngine.optimizer_step`). The statistics a
micro-batch loss declares (:mod:`hybridflow.utils.metrics` kinds) are pooled by kind over the micro-batches, the
mini-batches and the dp ranks. Why the applied gradient does not depend on the micro-batch split: see
:mod:`hybridflow.training.micro`.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

import torch

from hybridflow.algorithms.sampling import SamplingSpec
from hybridflow.distributed import gather_metrics
from hybridflow.protocol import DataProto
from hybridflow.training.base import TrainEngine
from hybridflow.training.micro import mini_batches
from hybridflow.training.packing import add_token_counts
from hybridflow.training.token_batches import iter_micro_batches
from hybridflow.utils.metrics import Max, Mean, Metric, accumulate, finalize

__all__ = ["MicroLoss", "loss_metric", "update_mini_batches"]


class MicroLoss(Protocol):
    """``loss(micro, outputs, agg_kwargs, stats) -> scalar``: the loss of one micro-batch from the engine's
    ``outputs`` (:meth:`TrainEngine.forward`), normalised with the mini-batch's ``agg_kwargs``; pools its
    statistics into ``stats``, each declared by its kind (:func:`hybridflow.utils.metrics.accumulate`; a loss
    term with :func:`loss_metric`)."""

    def __call__(self, micro: DataProto, outputs: dict[str, torch.Tensor], agg_kwargs: dict,
                 stats: dict[str, Metric]) -> torch.Tensor: ...


def loss_metric(loss: torch.Tensor, agg_kwargs: dict, tokens: float) -> Mean:
    """A micro-batch's share of its mini-batch loss as a token-weighted ``Mean``: ``loss`` (a scalar normalised
    with ``agg_kwargs``, :func:`hybridflow.training.micro.global_agg_kwargs`) times ``num_tokens`` over the
    micro-batch's ``tokens`` (its valid loss tokens). Pooled over the micro-batches and dp ranks of a mini-batch
    it is the mini-batch's loss (sum of the micro-batch losses over the dp size) in every aggregation mode; over
    several mini-batches, their losses weighted by their tokens."""
    return Mean(float(loss.item()) * agg_kwargs["num_tokens"], float(tokens))


def update_mini_batches(engine: TrainEngine, data: DataProto, loss: MicroLoss,
                        agg_kwargs: Callable[[DataProto], dict], *, mini_batch_size: int, micro_batch_size: int,
                        epochs: int, shuffle: bool, seed: int, prefix: str,
                        sampling: Optional[SamplingSpec] = None, entropy: bool = False,
                        max_token_len: Optional[int] = None) -> dict[str, float]:
    """Train ``engine`` on ``data`` (this rank's share, ``mini_batch_size`` / ``micro_batch_size`` in sequences
    per rank); every rank of the group calls it together.

    ``max_token_len`` (``use_dynamic_bsz``): micro-batches of at most that many tokens instead of
    ``micro_batch_size`` sequences (:mod:`hybridflow.training.token_batches`); every rank runs as many micro-batches
    as the rank that needs most (one all-reduce), the spare ones with their loss times 0, so the collectives of the
    backward passes stay paired. The applied gradient does not depend on the split. Each real micro-batch also adds
    its computed and valid token counts (``perf/<prefix>_computed_tokens``, ``perf/<prefix>_valid_tokens``).

    Returns the metrics pooled by kind over the micro-batches, mini-batches and dp ranks (floats, the same on
    every rank; the layout's tp x pp replicas of a dp shard count once), with ``<prefix>/grad_norm`` (pre-clip,
    the mean over the mini-batches) and ``<prefix>/skipped_steps`` (steps the non-finite guard dropped so far).

    Raises:
        FloatingPointError: a non-finite gradient norm with ``nonfinite_grad=error``.
    """
    engine.set_train(True)
    pooled: dict[str, Metric] = {}
    for mini in mini_batches(data, mini_batch_size, epochs, shuffle, seed):
        agg = agg_kwargs(mini)
        engine.zero_grad()
        micros = list(iter_micro_batches(mini, micro_batch_size, max_token_len))
        # a dummy keeps this rank's collectives in step with ranks that have more micro-batches (loss times 0)
        fns = [(lambda outputs, m=micro: loss(m, outputs, agg, {}) * 0.0) if dummy else
               (lambda outputs, m=micro: loss(m, outputs, agg, pooled)) for micro, dummy in micros]
        engine.forward_backward_micro_batches([micro for micro, _ in micros], fns, sampling=sampling,
                                              entropy=entropy)
        for micro, dummy in micros:
            if not dummy:
                add_token_counts(pooled, prefix, micro, engine.spec.remove_padding, getattr(engine, "module", None))
        grad_norm, _ = engine.optimizer_step()
        accumulate(pooled, f"{prefix}/grad_norm", Mean(grad_norm, 1.0))
    accumulate(pooled, f"{prefix}/skipped_steps", Max(float(engine.skipped_steps)))
    layout = engine.spec.layout
    return finalize(gather_metrics(pooled, replicas=layout.tp * layout.pp * layout.sp))
