"""The policy's computations on one rank of its data-parallel group (the module is FSDP2-sharded).

Shapes: (B, R) = sequences on this rank, response tokens; (B, P+R) = prompt + response tokens.
"""

from __future__ import annotations


import torch

from hybridflow.algorithms import (agg_loss, entropy_from_logits, get_policy_loss_fn, kl_penalty, logprobs_from_logits,
                                   overlong_filter_mask)
from hybridflow.algorithms.sampling import SamplingSpec, sampling_logits
from hybridflow.distributed import all_reduce_mean
from hybridflow.protocol import DataProto
from hybridflow.workers.micro import apply_gradients, global_agg_kwargs, mini_batches, response_forward
from hybridflow.workers.packing import add_token_counts
from hybridflow.workers.token_batches import gather_in_order, iter_micro_batches, micro_batch_indices


class PPOActor:
    """Log-probabilities and the PPO policy update for one dp rank.

    Args:
        module: the causal LM (possibly FSDP2-sharded).
        optimizer: optimizer over ``module``'s parameters (None for a frozen reference policy).
        config: the ``actor_rollout_ref.actor`` config section.
        sampling: what the rollout's sampler does to the logits (temperature, top-k, top-p; see
            :mod:`hybridflow.algorithms.sampling`). Every logprob and entropy here is of that distribution, so
            the recomputed old logprobs are those of the distribution the rollout sampled from (the contract of
            :mod:`hybridflow.rollout.base`); the sampled token is always kept in the truncated set. A reference
            policy gets the temperature only (its logprobs anchor the KL term, see README "Sampling logprobs").
        nonfinite_grad: ``skip`` drops an optimizer step whose gradient norm is NaN/inf (counted in
            ``actor/skipped_steps``); ``error`` raises ``FloatingPointError`` instead. Either way the
            non-finite gradient never reaches the weights.
        loss_scale_factor: the constant L of ``loss_agg_mode=seq-mean-token-sum-norm`` (Dr. GRPO); the worker
            passes ``actor.loss_scale_factor`` or ``data.max_response_length``. None: the response width R of
            the batch.
        use_remove_padding: padding-free forwards (``model.use_remove_padding``, :mod:`hybridflow.workers.packing`).

    With ``config.use_dynamic_bsz`` micro-batches are formed by a token budget
    (:mod:`hybridflow.workers.token_batches`):
    ``actor.ppo_max_token_len_per_gpu`` in the update, the ``max_token_len`` argument of :meth:`compute_log_prob`.
    """

    def __init__(self, module: torch.nn.Module, optimizer, config, sampling: SamplingSpec,
                 nonfinite_grad: str = "skip", loss_scale_factor: float | None = None,
                 use_remove_padding: bool = False) -> None:
        if not isinstance(sampling, SamplingSpec):
            raise TypeError(f"PPOActor: sampling must be a SamplingSpec, got {type(sampling).__name__}")
        self.module = module
        self.loss_scale_factor = loss_scale_factor
        self.nonfinite_grad = nonfinite_grad
        self.optimizer = optimizer
        self.config = config
        self.sampling = sampling
        self.skipped_steps = 0
        self.use_remove_padding = use_remove_padding

    def _log_prob(self, micro: DataProto, calculate_entropy: bool):
        responses = micro.batch["responses"]
        logits = response_forward(self.module, micro, responses.shape[1], self.use_remove_padding).float()
        logits = sampling_logits(logits, self.sampling, keep=responses)
        log_prob = logprobs_from_logits(logits, responses)
        entropy = entropy_from_logits(logits) if calculate_entropy else None
        return log_prob, entropy

    @torch.no_grad()
    def compute_log_prob(self, data: DataProto, micro_batch_size: int, calculate_entropy: bool = False,
                         max_token_len: int | None = None):
        """Log-probabilities of ``responses`` (B, R) fp32 under the current policy; also the entropy (B, R)
        when ``calculate_entropy`` (else None). Padded positions hold arbitrary finite values. Micro-batches hold
        ``micro_batch_size`` sequences, or with ``use_dynamic_bsz`` at most ``max_token_len`` tokens (a collective
        over the dp ranks, see :mod:`hybridflow.workers.token_batches`)."""
        self.module.eval()
        budget = max_token_len if self.config.use_dynamic_bsz else None
        indices = micro_batch_indices(data, micro_batch_size, budget)
        log_probs, entropies = [], []
        for index in indices:
            log_prob, entropy = self._log_prob(data[index] if index.numel() else data[:1], calculate_entropy)
            log_probs.append(log_prob)
            entropies.append(entropy)
        log_prob = gather_in_order(log_probs, indices, len(data))
        return log_prob, (gather_in_order(entropies, indices, len(data)) if calculate_entropy else None)

    def update_policy(self, data: DataProto, mini_batch_size: int, seed: int = 0) -> dict[str, float]:
        """PPO policy update over this rank's share of the batch.

        ``data`` needs ``input_ids``, ``attention_mask``, ``position_ids``, ``responses``, ``response_mask``,
        ``old_log_probs``, ``advantages`` (and ``ref_log_prob`` with ``use_kl_loss``; ``rollout_log_probs``, passed to
        the policy loss when present, for ``aipo`` and ``tis_imp_ratio_cap``). ``mini_batch_size`` is
        in sequences per rank. Each mini-batch is one optimizer step, accumulated over micro-batches with the
        normalisation of :mod:`hybridflow.workers.micro`. With ``actor.overlong_filter`` the loss (policy, entropy
        and KL terms) counts only responses whose ``truncated`` flag (B,) is False (:meth:`_loss_mask`). A non-finite gradient norm skips the step (counted in
        ``actor/skipped_steps``). Returns metrics averaged over mini-batches and dp ranks; with ``rollout_log_probs``
        also the importance weights pi_theta / mu of the valid tokens as they enter the loss:
        ``actor/is_weight_mean``, ``actor/is_weight_max`` and ``actor/is_weight_min`` (max/min over micro-batches,
        averaged over ranks).

        Without ``old_log_probs`` (the driver skipped that forward: the samples come from exactly these weights and
        this is the only update of the batch, :mod:`hybridflow.trainer.old_log_prob`) pi_old is the detached current
        logprob (ratio 1, as verl and TRL do), and the update logs what that forward's metrics would have been.
        Micro-batches hold ``actor.ppo_micro_batch_size_per_gpu`` sequences or, with ``use_dynamic_bsz``, at most
        ``actor.ppo_max_token_len_per_gpu`` tokens (:mod:`hybridflow.workers.token_batches`).

        Raises:
            ValueError: no ``old_log_probs`` but more than one mini-batch or epoch.
        """
        cfg = self.config
        self.module.train()
        loss_fn = get_policy_loss_fn(cfg.policy_loss)
        mode = cfg.loss_agg_mode
        sums: dict[str, float] = {}
        n_minis = 0
        on_policy = _on_policy(data, cfg.ppo_epochs, mini_batch_size)
        for mini in mini_batches(data, mini_batch_size, cfg.ppo_epochs, cfg.shuffle, seed):
            scale = self.loss_scale_factor or mini.batch["responses"].shape[1]
            agg_kwargs = global_agg_kwargs(mini, scale, *self._loss_mask(mini.batch))
            self.optimizer.zero_grad(set_to_none=True)
            stats: dict[str, float] = {}
            budget = cfg.ppo_max_token_len_per_gpu if cfg.use_dynamic_bsz else None
            for micro, dummy in iter_micro_batches(mini, cfg.ppo_micro_batch_size_per_gpu, budget):
                b = micro.batch
                mask, _ = self._loss_mask(b)
                need_entropy = cfg.entropy_coeff != 0 or on_policy
                log_prob, entropy = self._log_prob(micro, need_entropy)
                old_log_prob = log_prob.detach() if on_policy else b["old_log_probs"]
                pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower = loss_fn(
                    old_log_prob, log_prob, b["advantages"], mask, mode, cfg,
                    rollout_log_probs=b.get("rollout_log_probs"), **agg_kwargs
                )
                loss = pg_loss
                if cfg.entropy_coeff != 0:
                    loss = loss - cfg.entropy_coeff * agg_loss(entropy, mask, mode, **agg_kwargs)
                if cfg.use_kl_loss:
                    kl_loss = agg_loss(kl_penalty(log_prob, b["ref_log_prob"], cfg.kl_loss_type), mask, mode,
                                       **agg_kwargs)
                    loss = loss + cfg.kl_loss_coef * kl_loss
                if dummy:  # keeps this rank's collectives in step with ranks that have more micro-batches
                    (loss * 0.0).backward()
                    continue
                loss.backward()
                if cfg.use_kl_loss:
                    _add(stats, "actor/kl_loss", kl_loss.item())
                add_token_counts(stats, "actor", micro, self.use_remove_padding)
                frac = mask.sum().item() / max(agg_kwargs["num_tokens"], 1.0)
                if on_policy:
                    _add_on_policy_stats(stats, b, log_prob.detach(), entropy.detach(), mask, frac)
                _add(stats, "actor/pg_loss", pg_loss.item())
                _add(stats, "actor/pg_clipfrac", pg_clipfrac.item() * frac)
                _add(stats, "actor/pg_clipfrac_lower", pg_clipfrac_lower.item() * frac)
                _add(stats, "actor/ppo_kl", ppo_kl.item() * frac)
                if "rollout_log_probs" in b:  # pi_theta / mu: how far the sampling policy is from the trained one
                    _add_is_weight_stats(stats, b["rollout_log_probs"], log_prob.detach(), mask, frac)
            grad_norm, skipped = apply_gradients(self.module, self.optimizer, cfg.grad_clip, self.nonfinite_grad,
                                                 "actor")
            self.skipped_steps += int(skipped)
            stats["actor/grad_norm"] = grad_norm
            for key, value in stats.items():
                _add(sums, key, value)
            n_minis += 1
        metrics = all_reduce_mean({k: v / max(n_minis, 1) for k, v in sums.items()})
        metrics["actor/skipped_steps"] = float(self.skipped_steps)
        return metrics


    def _loss_mask(self, batch) -> tuple[torch.Tensor, torch.Tensor | None]:
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


def _add_is_weight_stats(stats: dict[str, float], rollout_log_probs: torch.Tensor, log_prob: torch.Tensor,
                         mask: torch.Tensor, frac: float) -> None:
    """``actor/is_weight_mean`` (token-weighted by ``frac``), ``_max`` and ``_min`` of pi_theta / mu over the valid
    tokens of ``mask`` (B, R)."""
    w = torch.exp((log_prob - rollout_log_probs).clamp(max=20.0))[mask.bool()]
    if w.numel():
        _add(stats, "actor/is_weight_mean", w.mean().item() * frac)
        stats["actor/is_weight_max"] = max(stats.get("actor/is_weight_max", 0.0), w.max().item())
        stats["actor/is_weight_min"] = min(stats.get("actor/is_weight_min", 1e30), w.min().item())


def _add_on_policy_stats(stats: dict[str, float], b, log_prob: torch.Tensor, entropy: torch.Tensor,
                         mask: torch.Tensor, frac: float) -> None:
    """What the skipped old-logprob pass would have logged (``hybridflow.trainer.steps.compute_data_metrics``),
    from the update's own forward: ``actor/entropy``, ``rollout/kl`` (with ``ref_log_prob``) and
    ``rollout/logprob_diff_max`` (with ``rollout_log_probs``); token-weighted by ``frac`` like the losses."""
    maskf = mask.float()
    n = maskf.sum().clamp(min=1.0)
    _add(stats, "actor/entropy", ((entropy * maskf).sum() / n).item() * frac)
    if "ref_log_prob" in b:
        _add(stats, "rollout/kl", (((log_prob - b["ref_log_prob"]) * maskf).sum() / n).item() * frac)
    if "rollout_log_probs" in b:
        diff = (b["rollout_log_probs"] - log_prob).abs()[mask.bool()]
        stats["rollout/logprob_diff_max"] = max(stats.get("rollout/logprob_diff_max", 0.0),
                                                diff.max().item() if diff.numel() else 0.0)


def _add(d: dict[str, float], key: str, value: float) -> None:
    d[key] = d.get(key, 0.0) + value
