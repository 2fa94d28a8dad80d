"""The value function's computations on one rank of its data-parallel group (FSDP2-sharded value model).

Shapes: (B, R) = sequences on this rank, response tokens.
"""

from __future__ import annotations

import torch

from hybridflow.algorithms import compute_value_loss, masked_mean
from hybridflow.distributed import all_reduce_mean
from hybridflow.protocol import DataProto
from hybridflow.workers.micro import apply_gradients, global_agg_kwargs, mini_batches, response_forward
from hybridflow.workers.packing import add_token_counts
from hybridflow.workers.token_batches import gather_in_order, iter_micro_batches, micro_batch_indices


class PPOCritic:
    """Values and the clipped value-loss update (PPO, Schulman et al. 2017) for one dp rank.

    ``use_remove_padding``: padding-free forwards (``critic.model.use_remove_padding``); ``critic.use_dynamic_bsz``:
    token-budget micro-batches (``critic.ppo_max_token_len_per_gpu`` in the update, the ``max_token_len`` argument of
    :meth:`compute_values`; :mod:`hybridflow.workers.token_batches`)."""

    def __init__(self, module: torch.nn.Module, optimizer, config, nonfinite_grad: str = "skip",
                 use_remove_padding: bool = False) -> None:
        self.module = module
        self.use_remove_padding = use_remove_padding
        self.nonfinite_grad = nonfinite_grad
        self.optimizer = optimizer
        self.config = config
        self.skipped_steps = 0

    def _values(self, micro: DataProto) -> torch.Tensor:
        responses = micro.batch["responses"]
        return response_forward(self.module, micro, responses.shape[1], self.use_remove_padding).squeeze(-1).float()

    @torch.no_grad()
    def compute_values(self, data: DataProto, micro_batch_size: int, max_token_len: int | None = None) -> torch.Tensor:
        """V(s_t) for every response position, (B, R) fp32, zero at padded positions. With ``use_dynamic_bsz``,
        micro-batches of at most ``max_token_len`` tokens (a collective over the dp ranks)."""
        self.module.eval()
        budget = max_token_len if self.config.use_dynamic_bsz else None
        indices = micro_batch_indices(data, micro_batch_size, budget)
        values = [self._values(data[i] if i.numel() else data[:1]) for i in indices]
        return gather_in_order(values, indices, len(data)) * data.batch["response_mask"]

    def update_critic(self, data: DataProto, mini_batch_size: int, seed: int = 0) -> dict[str, float]:
        """Clipped value regression towards ``returns`` (B, R); ``values`` (B, R) are the rollout-time values.
        ``mini_batch_size`` is in sequences per rank. Returns metrics averaged over mini-batches and ranks."""
        cfg = self.config
        self.module.train()
        sums: dict[str, float] = {}
        n_minis = 0
        for mini in mini_batches(data, mini_batch_size, cfg.ppo_epochs, cfg.shuffle, seed):
            agg_kwargs = global_agg_kwargs(mini, mini.batch["responses"].shape[1])
            self.optimizer.zero_grad(set_to_none=True)
            stats: dict[str, float] = {}
            budget = cfg.ppo_max_token_len_per_gpu if cfg.use_dynamic_bsz else None
            for micro, dummy in iter_micro_batches(mini, cfg.ppo_micro_batch_size_per_gpu, budget):
                b = micro.batch
                mask = b["response_mask"]
                vpreds = self._values(micro)
                vf_loss, vf_clipfrac = compute_value_loss(
                    vpreds, b["returns"], b["values"], mask, cfg.cliprange_value, cfg.loss_agg_mode, **agg_kwargs
                )
                if dummy:  # keeps this rank's collectives in step with ranks that have more micro-batches
                    (vf_loss * 0.0).backward()
                    continue
                vf_loss.backward()
                add_token_counts(stats, "critic", micro, self.use_remove_padding)
                frac = mask.sum().item() / max(agg_kwargs["num_tokens"], 1.0)
                stats["critic/vf_loss"] = stats.get("critic/vf_loss", 0.0) + vf_loss.item()
                stats["critic/vf_clipfrac"] = stats.get("critic/vf_clipfrac", 0.0) + vf_clipfrac.item() * frac
                vpred_mean = masked_mean(vpreds.detach(), mask).item() * frac
                stats["critic/vpred_mean"] = stats.get("critic/vpred_mean", 0.0) + vpred_mean
            grad_norm, skipped = apply_gradients(self.module, self.optimizer, cfg.grad_clip, self.nonfinite_grad,
                                                 "critic")
            self.skipped_steps += int(skipped)
            stats["critic/grad_norm"] = grad_norm
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + value
            n_minis += 1
        metrics = all_reduce_mean({k: v / max(n_minis, 1) for k, v in sums.items()})
        metrics["critic/skipped_steps"] = float(self.skipped_steps)
        return metrics
