"""The one mini-batch / micro-batch update loop of every trained role (the PPO actor and the critics).

For each mini-batch of ``epochs`` passes over this rank's data (optionally shuffled): the loss normalisers of the
mini-batch (:func:`hybridflow.training.micro.global_agg_kwargs`, totals over all dp ranks), gradients accumulated
over its micro-batches (:meth:`TrainEngine.forward_backward_micro_batches`, all of them in one call), then one
optimizer step with grad clipping and the non-finite guard (:meth:`TrainEngine.optimizer_step`). Per-micro-batch statistics are summed within a mini-batch,
averaged over mini-batches, then over dp ranks. Why the applied gradient does not depend on the micro-batch split:
see :mod:`hybridflow.training.micro`.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

import torch

from hybridflow.algorithms.sampling import SamplingSpec
from hybridflow.distributed import all_reduce_mean
from hybridflow.protocol import DataProto
from hybridflow.training.base import TrainEngine
from hybridflow.training.micro import mini_batches
from hybridflow.training.packing import add_token_counts
from hybridflow.training.token_batches import iter_micro_batches

__all__ = ["MicroLoss", "update_mini_batches"]


class MicroLoss(Protocol):
    """``loss(micro, outputs, agg_kwargs, stats) -> scalar``: the loss of one micro-batch from the engine's
    ``outputs`` (:meth:`TrainEngine.forward`), normalised with the mini-batch's ``agg_kwargs``; adds its
    statistics to ``stats`` (summed over the micro-batches of a mini-batch)."""

    def __call__(self, micro: DataProto, outputs: dict[str, torch.Tensor], agg_kwargs: dict,
                 stats: dict[str, float]) -> torch.Tensor: ...


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

    Returns the metrics averaged over mini-batches and dp ranks, with ``<prefix>/grad_norm`` (pre-clip) and
    ``<prefix>/skipped_steps`` (steps the non-finite guard dropped so far, this rank's count).

    Raises:
        FloatingPointError: a non-finite gradient norm with ``nonfinite_grad=error``.
    """
    engine.set_train(True)
    sums: dict[str, float] = {}
    n_minis = 0
    for mini in mini_batches(data, mini_batch_size, epochs, shuffle, seed):
        agg = agg_kwargs(mini)
        engine.zero_grad()
        stats: dict[str, float] = {}
        micros = list(iter_micro_batches(mini, micro_batch_size, max_token_len))
        # a dummy keeps this rank's collectives in step with ranks that have more micro-batches (loss times 0)
        fns = [(lambda outputs, m=micro: loss(m, outputs, agg, {}) * 0.0) if dummy else
               (lambda outputs, m=micro: loss(m, outputs, agg, stats)) for micro, dummy in micros]
        engine.forward_backward_micro_batches([micro for micro, _ in micros], fns, sampling=sampling,
                                              entropy=entropy)
        for micro, dummy in micros:
            if not dummy:
                add_token_counts(stats, prefix, micro, engine.spec.remove_padding, getattr(engine, "module", None))
        grad_norm, _ = engine.optimizer_step()
        stats[f"{prefix}/grad_norm"] = grad_norm
        for key, value in stats.items():
            sums[key] = sums.get(key, 0.0) + value
        n_minis += 1
    metrics = all_reduce_mean({k: v / max(n_minis, 1) for k, v in sums.items()})
    metrics[f"{prefix}/skipped_steps"] = float(engine.skipped_steps)
    return metrics
