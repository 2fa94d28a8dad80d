"""The policy's computations on one rank of its data-parallel group, through its training engine
(:class:`hybridflow.training.TrainEngine`; the PPO loss here, the forward/backward/step there).

Shapes: (B, R) = sequences on this rank, response tokens; (B, P+R) = prompt + response tokens.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from hybridflow.algorithms import (agg_loss, get_policy_loss_fn, kl_penalty, masked_token_fractions,
                                   overlong_filter_mask)
from hybridflow.algorithms.sampling import SamplingSpec
from hybridflow.protocol import DataProto
from hybridflow.training import TrainEngine, update_mini_batches
from hybridflow.training.micro import global_agg_kwargs
from hybridflow.models.moe import ROUTING_KEY
from hybridflow.training.routing_replay import RECORD_ROUTING, add_router_stats, replay_view
from hybridflow.training.token_batches import gather_in_order, micro_batch_indices
from hybridflow.training.update import loss_metric
from hybridflow.utils.metrics import Max, Mean, Metric, Min, accumulate
from hybridflow.workers.engine_model import EngineModel


class PPOActor(EngineModel):
    """Log-probabilities and the PPO policy update for one dp rank (engine, optimizer, ``module``, ``optimizer``
    and ``skipped_steps``: :class:`~hybridflow.workers.engine_model.EngineModel`).

    Args:
        engine: the policy's training engine (``kind="policy"``), or a causal LM module (possibly FSDP2-sharded),
            which is wrapped in an ``fsdp2`` engine with ``optimizer``, ``config.grad_clip`` and ``nonfinite_grad``.
        optimizer: with a module, the optimizer over its parameters (None for a frozen reference policy); must be
            None with an engine (the engine owns its optimizer).
        config: the ``actor_rollout_ref.actor`` config section.
        sampling: what the rollout's sampler does to the logits (temperature, top-k, top-p; see
            :mod:`hybridflow.algorithms.sampling`). Every logprob and entropy here is of that distribution, so
            the recomputed old logprobs are those of the distribution the rollout sampled from (the contract of
            :mod:`hybridflow.rollout.base`); the sampled token is always kept in the truncated set. A reference
            policy gets the temperature only (its logprobs anchor the KL term, see docs/concepts/rollout.md).
        nonfinite_grad: (with a module) ``skip`` drops an optimizer step whose gradient norm is NaN/inf (counted in
            ``actor/skipped_steps``); ``error`` raises ``FloatingPointError`` instead. Either way the
            non-finite gradient never reaches the weights.
        loss_scale_factor: the constant L of ``loss_agg_mode=seq-mean-token-sum-norm`` (Dr. GRPO); the worker
            passes ``actor.loss_scale_factor`` or ``data.max_response_length``. None: the response width R of
            the batch.
        use_remove_padding: (with a module) padding-free forwards (``model.use_remove_padding``,
            :mod:`hybridflow.training.packing`); an engine carries it in its spec.

    With ``config.use_dynamic_bsz`` micro-batches are formed by a token budget
    (:mod:`hybridflow.training.token_batches`):
    ``actor.ppo_max_token_len_per_gpu`` in the update, the ``max_token_len`` argument of :meth:`compute_log_prob`.
    """

    KIND, ROLE = "policy", "actor"

    def __init__(self, engine: Union[TrainEngine, torch.nn.Module], optimizer: Optional[torch.optim.Optimizer],
                 config: Any, sampling: SamplingSpec, nonfinite_grad: str = "skip",
                 loss_scale_factor: float | None = None, use_remove_padding: bool = False) -> None:
        if not isinstance(sampling, SamplingSpec):
            raise TypeError(f"PPOActor: sampling must be a SamplingSpec, got {type(sampling).__name__}")
        super().__init__(engine, optimizer, config, nonfinite_grad, use_remove_padding)
        self.loss_scale_factor = loss_scale_factor
        self.sampling = sampling
        self.recorded_routing: Optional[torch.Tensor] = None  # compute_log_prob(record_routing=True)

    def _log_prob(self, micro: DataProto, calculate_entropy: bool):
        out = self.engine.forward(micro, sampling=self.sampling, entropy=calculate_entropy)
        return out["log_probs"], out.get("entropy"), out.get(ROUTING_KEY)

    @torch.no_grad()
    def compute_log_prob(self, data: DataProto, micro_batch_size: int, calculate_entropy: bool = False,
                         max_token_len: int | None = None, record_routing: bool = False):
        """Log-probabilities of ``responses`` (B, R) fp32 under the current policy; also the entropy (B, R)
        when ``calculate_entropy`` (else None). Padded positions hold arbitrary finite values. Micro-batches hold
        ``micro_batch_size`` sequences, or with ``use_dynamic_bsz`` at most ``max_token_len`` tokens (a collective
        over the dp ranks, see :mod:`hybridflow.training.token_batches`).

        ``record_routing`` with ``router_replay=recompute`` and an MoE policy: the forwards' own routing is kept in
        :attr:`recorded_routing` ((B, P+R, Ly, k) int16, :mod:`hybridflow.training.routing_replay`), else that is
        None."""
        self.engine.set_train(False)
        data = replay_view(data, getattr(self.config, "router_replay", "off"))
        if record_routing and getattr(self.config, "router_replay", "off") == "recompute":
            data = data.select()  # a shallow copy: the caller's meta_info is left as it was
            data.meta_info[RECORD_ROUTING] = True
        budget = max_token_len if self.config.use_dynamic_bsz else None
        indices = micro_batch_indices(data, micro_batch_size, budget)
        log_probs, entropies, routings = [], [], []
        for index in indices:
            log_prob, entropy, routing = self._log_prob(data[index] if index.numel() else data[:1], calculate_entropy)
            log_probs.append(log_prob)
            entropies.append(entropy)
            routings.append(routing)
        recorded = all(r is not None for r in routings) and data.meta_info.get(RECORD_ROUTING, False)
        self.recorded_routing = gather_in_order(routings, indices, len(data)) if recorded else None
        log_prob = gather_in_order(log_probs, indices, len(data))
        return log_prob, (gather_in_order(entropies, indices, len(data)) if calculate_entropy else None)

    def update_policy(self, data: DataProto, mini_batch_size: int, seed: int = 0) -> dict[str, float]:
        """PPO policy update over this rank's share of the batch.

        ``data`` needs ``input_ids``, ``attention_mask``, ``position_ids``, ``responses``, ``response_mask``,
        ``old_log_probs``, ``advantages`` (and ``ref_log_prob`` with ``use_kl_loss``; ``rollout_log_probs``, passed to
        the policy loss when present, for ``aipo``, ``icepop``, ``tis_imp_ratio_cap`` and ``rollout_rs``). ``mini_batch_size`` is
        in sequences per rank. Each mini-batch is one optimizer step, accumulated over micro-batches with the
        normalisation of :mod:`hybridflow.training.micro` (the loop: :func:`hybridflow.training.update_mini_batches`). With ``actor.overlong_filter`` the loss (policy, entropy
        and KL terms) counts only responses whose ``truncated`` flag (B,) is False (:meth:`_loss_mask`). A non-finite gradient norm skips the step (counted in
        ``actor/skipped_steps``). Returns the metrics pooled by kind over mini-batches, micro-batches and dp ranks
        (:func:`~hybridflow.training.update.update_mini_batches`): the losses as the mini-batch's loss
        (token-weighted over mini-batches), clip fractions and ``ppo_kl`` token-weighted; with
        ``rollout_log_probs`` also the importance weights pi_theta / mu of the valid tokens as they enter the loss:
        ``actor/is_weight_mean`` (token-weighted), ``actor/is_weight_max`` and ``actor/is_weight_min`` (over every
        valid token of every rank), and the share of the valid tokens a mismatch mask took out of the loss:
        ``actor/mis_masked_frac`` (``actor.rollout_rs``) and ``actor/icepop_masked_frac`` (``policy_loss=icepop``),
        token-weighted like ``actor/pg_clipfrac``.

        Without ``old_log_probs`` (the driver skipped that forward: the samples come from exactly these weights and
        this is the only update of the batch, :mod:`hybridflow.trainer.old_log_prob`) pi_old is the detached current
        logprob (ratio 1, as verl and TRL do), and the update logs what that forward's metrics would have been.
        Micro-batches hold ``actor.ppo_micro_batch_size_per_gpu`` sequences or, with ``use_dynamic_bsz``, at most
        ``actor.ppo_max_token_len_per_gpu`` tokens (:mod:`hybridflow.training.token_batches`).

        Raises:
            ValueError: no ``old_log_probs`` but more than one mini-batch or epoch.
        """
        cfg = self.config
        replay = getattr(cfg, "router_replay", "off")  # recompute: the old-logprob forward's routing is replayed
        data = replay_view(data, "rollout" if replay == "recompute" else replay)
        aux_coef = getattr(cfg, "router_aux_loss_coef", 0.0)
        loss_fn = get_policy_loss_fn(cfg.policy_loss)
        mode = cfg.loss_agg_mode
        on_policy = _on_policy(data, cfg.ppo_epochs, mini_batch_size)
        need_entropy = cfg.entropy_coeff != 0 or on_policy

        def agg_kwargs(mini: DataProto) -> dict:
            scale = self.loss_scale_factor or mini.batch["responses"].shape[1]
            return global_agg_kwargs(mini, scale, *self._loss_mask(mini.batch))

        def micro_loss(micro: DataProto, outputs: dict, agg: dict, stats: dict[str, Metric]) -> torch.Tensor:
            b = micro.batch
            mask, _ = self._loss_mask(b)
            log_prob, entropy = outputs["log_probs"], outputs.get("entropy")
            old_log_prob = log_prob.detach() if on_policy else b["old_log_probs"]
            pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower = loss_fn(
                old_log_prob, log_prob, b["advantages"], mask, mode, cfg,
                rollout_log_probs=b.get("rollout_log_probs"), **agg
            )
            loss = pg_loss
            if cfg.entropy_coeff != 0:
                loss = loss - cfg.entropy_coeff * agg_loss(entropy, mask, mode, **agg)
            tokens = float(mask.sum().item())  # the micro-batch's loss tokens: the weight of its local means
            if cfg.use_kl_loss:
                kl = kl_penalty(log_prob, b["ref_log_prob"], cfg.kl_loss_type)
                kl_loss = agg_loss(kl, mask, mode, **agg)
                loss = loss + cfg.kl_loss_coef * kl_loss
                accumulate(stats, "actor/kl_loss", loss_metric(kl_loss, agg, tokens))
            if aux_coef != 0 and "router_aux_loss" in outputs:  # MoE load balancing (Switch Transformer); each
                # micro-batch's term weighted by its share of the mini-batch's tokens: the applied gradient is that of
                # the token-weighted mean of the micro-batch terms (the dp mean cancels as in training.micro)
                loss = loss + aux_coef * outputs["router_aux_loss"] * (tokens / agg["num_tokens"])
            add_router_stats(stats, "actor", outputs, tokens)
            if on_policy:
                _add_on_policy_stats(stats, b, log_prob.detach(), entropy.detach(), mask)
            accumulate(stats, "actor/pg_loss", loss_metric(pg_loss, agg, tokens))
            for key, local_mean in (("pg_clipfrac", pg_clipfrac), ("pg_clipfrac_lower", pg_clipfrac_lower),
                                    ("ppo_kl", ppo_kl)):  # means over this micro-batch's loss tokens
                accumulate(stats, f"actor/{key}", Mean(float(local_mean.item()) * tokens, tokens))
            if "rollout_log_probs" in b:  # pi_theta / mu: how far the sampling policy is from the trained one
                _add_is_weight_stats(stats, b["rollout_log_probs"], log_prob.detach(), mask)
                for name, share in masked_token_fractions(old_log_prob, b["rollout_log_probs"], mask, cfg).items():
                    accumulate(stats, name, Mean(share * tokens, tokens))  # MIS / IcePop: share masked out
            return loss

        return update_mini_batches(self.engine, data, micro_loss, agg_kwargs, mini_batch_size=mini_batch_size,
                                   micro_batch_size=cfg.ppo_micro_batch_size_per_gpu, epochs=cfg.ppo_epochs,
                                   shuffle=cfg.shuffle, seed=seed, prefix="actor", sampling=self.sampling,
                                   entropy=need_entropy,
                                   max_token_len=cfg.ppo_max_token_len_per_gpu if cfg.use_dynamic_bsz else None)

    def _loss_mask(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The (B, R) mask of the tokens in the loss and the (B,) bool rows counted as sequences (None: all rows):
        ``response_mask`` and every row, or with ``actor.overlong_filter`` those of the responses that were not
        truncated (DAPO's overlong filtering, :func:`~hybridflow.algorithms.overlong_filter_mask`).

        Raises:
            KeyError: ``overlong_filter`` is on and the batch has no ``truncated`` flag from the rollout.
        """
        if not self.config.overlong_filter:
            return batch["response_mask"], None
        if "truncated" not in batch:
            raise KeyError("actor.overlong_filter=true needs the rollout's per-response 'truncated' flag (B,) in "
                           f"the batch; got keys {sorted(batch.keys())}")
        return overlong_filter_mask(batch["response_mask"], batch["truncated"])


def _on_policy(data: DataProto, epochs: int, mini_batch_size: int) -> bool:
    """True when ``data`` has no ``old_log_probs`` (pi_old = the update's own detached logprobs).

    Raises:
        ValueError: no ``old_log_probs`` but more than one optimizer step on the batch (later steps would need the
            logprobs of the weights before the first one).
    """
    if "old_log_probs" in data.batch:
        return False
    if epochs != 1 or len(data) > mini_batch_size:
        raise ValueError("update_policy without old_log_probs needs one update per batch (ppo_epochs=1 and one "
                         f"mini-batch), got ppo_epochs={epochs} and {len(data)} rows for mini-batches of "
                         f"{mini_batch_size}")
    return True


def _add_is_weight_stats(stats: dict[str, Metric], rollout_log_probs: torch.Tensor, log_prob: torch.Tensor,
                         mask: torch.Tensor) -> None:
    """``actor/is_weight_mean`` (token-weighted), ``_max`` and ``_min`` of pi_theta / mu over the valid tokens of
    ``mask`` (B, R); logprobs (B, R) fp32."""
    w = torch.exp((log_prob - rollout_log_probs).clamp(max=20.0))[mask.bool()]
    accumulate(stats, "actor/is_weight_mean", Mean.of(w))
    accumulate(stats, "actor/is_weight_max", Max.of(w))
    accumulate(stats, "actor/is_weight_min", Min.of(w))


def _add_on_policy_stats(stats: dict[str, Metric], b, log_prob: torch.Tensor, entropy: torch.Tensor,
                         mask: torch.Tensor) -> None:
    """What the skipped old-logprob pass would have logged (``hybridflow.trainer.steps.compute_data_metrics``),
    from the update's own forward: ``actor/entropy``, ``rollout/kl`` (with ``ref_log_prob``) and
    ``rollout/logprob_diff_max`` (with ``rollout_log_probs``), over the valid tokens of ``mask`` (B, R)."""
    valid = mask.bool()
    accumulate(stats, "actor/entropy", Mean.of(entropy[valid]))
    if "ref_log_prob" in b:
        accumulate(stats, "rollout/kl", Mean.of((log_prob - b["ref_log_prob"])[valid]))
    if "rollout_log_probs" in b:
        accumulate(stats, "rollout/logprob_diff_max", Max.of((b["rollout_log_probs"] - log_prob).abs()[valid]))
