"""The sampling distribution: temperature, top-k and top-p (nucleus) truncation applied to logits.

One definition, used by the ``hf`` rollout to draw tokens and by the trainer to recompute their log-probabilities,
so the behaviour policy ``mu`` the rollout records and the policy the trainer evaluates are the same function of
the logits (vLLM's sampler applies the same rule; see :mod:`hybridflow.rollout.base` for the contract).

The truncated, tempered policy of logits ``z`` is ``pi_K(a) = exp(z_a / T) / sum_{b in K} exp(z_b / T)`` for
``a`` in the kept set ``K`` (the top-k tokens, then the smallest prefix of the rest by decreasing probability
whose mass reaches top-p; Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration", Sec. 3.1) and
0 outside it. ``K`` is piecewise constant in ``z``, so it carries no gradient:
``d log pi_K(a) / dz_b = (1[a = b] - pi_K(b)) / T`` for ``b`` in ``K`` and 0 outside.

Shapes: ``(..., V)`` logits over a vocabulary of ``V``; ``(...)`` token ids, e.g. ``(B, T)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["SamplingSpec", "sampling_logits", "truncation_mask"]


@dataclass(frozen=True)
class SamplingSpec:
    """What a sampler does to the logits before drawing a token.

    Attributes:
        temperature: > 0, divides the logits.
        top_k: keep the k largest logits (ties at the k-th value kept); <= 0 disables.
        top_p: nucleus mass in (0, 1]; 1.0 disables.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0

    @classmethod
    def of(cls, do_sample: bool, temperature: float, top_k: int = -1, top_p: float = 1.0) -> "SamplingSpec":
        """The spec of a rollout's sampling settings. Greedy decoding (``do_sample`` false or temperature 0)
        records logprobs under the plain softmax of the raw logits: temperature 1, no truncation."""
        if not do_sample or temperature == 0:
            return cls()
        return cls(float(temperature), int(top_k), float(top_p))


@torch.no_grad()
def truncation_mask(logits: torch.Tensor, top_k: int = -1, top_p: float = 1.0,
                    keep: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Which entries top-k, then top-p, remove (no gradient: the kept set is piecewise constant).

    Args:
        logits: ``(..., V)`` float logits (already divided by the temperature; top-p reads their softmax).
        top_k: keep the ``top_k`` largest logits of each row (ties at the k-th value kept); <= 0 disables.
        top_p: after top-k, keep the smallest prefix of tokens by decreasing probability whose mass reaches
            ``top_p`` (the most likely token always stays); 1.0 disables. A token is removed when the mass of the
            tokens before it reaches ``top_p`` (the rule of vLLM's sampler).
        keep: optional ``(...)`` token ids that are never removed (the tokens that were sampled: under the
            trainer's recomputed logits, which differ from the rollout's in the last bits, a token at the
            nucleus boundary could otherwise fall out and get logprob -inf).

    Returns:
        ``(..., V)`` bool, True where removed; None when neither truncation is active.
    """
    vocab = logits.shape[-1]
    if not (0 < top_k < vocab) and top_p >= 1.0:
        return None
    remove = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    if 0 < top_k < vocab:
        kth_value = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        remove |= logits < kth_value
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits.masked_fill(remove, float("-inf")), dim=-1, descending=True)
        sorted_probs = sorted_logits.float().softmax(dim=-1)
        sorted_remove = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        sorted_remove[..., 0] = False
        remove |= torch.zeros_like(sorted_remove).scatter(-1, sorted_idx, sorted_remove)
    if keep is not None:
        remove.scatter_(-1, keep.long().unsqueeze(-1), False)
    return remove


def sampling_logits(logits: torch.Tensor, spec: SamplingSpec, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The logits of the distribution a sampler with ``spec`` draws from: ``logits / temperature``, then
    ``-inf`` where top-k / top-p remove a token (:func:`truncation_mask`). ``softmax`` of the result
    is ``pi_K``; :func:`~hybridflow.algorithms.logprobs_from_logits` of it gives ``log pi_K(a)`` and
    :func:`~hybridflow.algorithms.entropy_from_logits` its entropy. Differentiable in ``logits`` (kept entries).

    Args:
        logits: ``(..., V)`` float logits.
        spec: the sampler's settings (for greedy decoding, ``SamplingSpec.of`` gives the plain softmax).
        keep: optional ``(...)`` token ids never truncated (see :func:`truncation_mask`).

    Returns:
        ``(..., V)`` float logits (``logits`` itself when the spec changes nothing). Memory: top-p sorts the
        whole ``(..., V)`` tensor (one more float and one int64 copy of it while the mask is computed).
    """
    if spec.temperature != 1.0:
        logits = logits / spec.temperature
    remove = truncation_mask(logits.detach(), spec.top_k, spec.top_p, keep)
    return logits if remove is None else logits.masked_fill(remove, float("-inf"))
