"""The value function's computations on one rank of its data-parallel group, through its training engine
(:class:`hybridflow.training.TrainEngine`, ``kind="value"``).

Shapes: (B, R) = sequences on this rank, response tokens.
"""

from __future__ import annotations

import torch

from hybridflow.algorithms import compute_value_loss
from hybridflow.protocol import DataProto
from hybridflow.training import update_mini_batches
from hybridflow.training.micro import global_agg_kwargs
from hybridflow.training.token_batches import gather_in_order, micro_batch_indices
from hybridflow.training.update import loss_metric
from hybridflow.utils.metrics import Mean, Metric, accumulate
from hybridflow.workers.engine_model import EngineModel


class PPOCritic(EngineModel):
    """Values and the clipped value-loss update (PPO, Schulman et al. 2017) for one dp rank (engine, optimizer,
    ``module``, ``optimizer`` and ``skipped_steps``: :class:`~hybridflow.workers.engine_model.EngineModel`).

    Args:
        engine: the value model's engine, or a value module (wrapped in an ``fsdp2`` engine with ``optimizer``,
            ``config.grad_clip`` and ``nonfinite_grad``).
        optimizer: with a module, its optimizer; None with an engine.
        config: the ``critic`` config section.
        nonfinite_grad: (with a module) ``skip`` or ``error``, as for :class:`~hybridflow.workers.ppo_actor.PPOActor`.
        use_remove_padding: (with a module) padding-free forwards (``critic.model.use_remove_padding``); an engine
            carries it in its spec.

    ``critic.use_dynamic_bsz``: token-budget micro-batches (``critic.ppo_max_token_len_per_gpu`` in the update, the
    ``max_token_len`` argument of :meth:`compute_values`; :mod:`hybridflow.training.token_batches`).
    """

    KIND, ROLE = "value", "critic"

    @torch.no_grad()
    def compute_values(self, data: DataProto, micro_batch_size: int, max_token_len: int | None = None) -> torch.Tensor:
        """V(s_t) for every response position, (B, R) fp32, zero at padded positions. With ``use_dynamic_bsz``,
        micro-batches of at most ``max_token_len`` tokens (a collective over the dp ranks)."""
        self.engine.set_train(False)
        budget = max_token_len if self.config.use_dynamic_bsz else None
        indices = micro_batch_indices(data, micro_batch_size, budget)
        values = [self.engine.forward(data[i] if i.numel() else data[:1])["values"] for i in indices]
        return gather_in_order(values, indices, len(data)) * data.batch["response_mask"]

    def update_critic(self, data: DataProto, mini_batch_size: int, seed: int = 0) -> dict[str, float]:
        """Clipped value regression towards ``returns`` (B, R); ``values`` (B, R) are the rollout-time values.
        ``mini_batch_size`` is in sequences per rank. Returns the metrics pooled by kind over mini-batches,
        micro-batches and ranks (the loop: :func:`hybridflow.training.update_mini_batches`): ``critic/vf_loss`` as
        the mini-batch's loss, ``critic/vf_clipfrac`` and ``critic/vpred_mean`` token-weighted."""
        cfg = self.config

        def micro_loss(micro: DataProto, outputs: dict, agg: dict, stats: dict[str, Metric]) -> torch.Tensor:
            b = micro.batch
            mask = b["response_mask"]
            vpreds = outputs["values"]
            vf_loss, vf_clipfrac = compute_value_loss(
                vpreds, b["returns"], b["values"], mask, cfg.cliprange_value, cfg.loss_agg_mode, **agg
            )
            tokens = float(mask.sum().item())
            accumulate(stats, "critic/vf_loss", loss_metric(vf_loss, agg, tokens))
            accumulate(stats, "critic/vf_clipfrac", Mean(float(vf_clipfrac.item()) * tokens, tokens))
            accumulate(stats, "critic/vpred_mean", Mean.of(vpreds.detach()[mask.bool()]))
            return vf_loss

        return update_mini_batches(
            self.engine, data, micro_loss, lambda mini: global_agg_kwargs(mini, mini.batch["responses"].shape[1]),
            mini_batch_size=mini_batch_size, micro_batch_size=cfg.ppo_micro_batch_size_per_gpu,
            epochs=cfg.ppo_epochs, shuffle=cfg.shuffle, seed=seed, prefix="critic",
            max_token_len=cfg.ppo_max_token_len_per_gpu if cfg.use_dynamic_bsz else None)
