"""Packed training forwards that compute a prompt shared by several rows once (GRPO's n samples of one prompt).

With ``use_remove_padding`` a micro-batch is packed into one row of valid tokens. When rows share a prompt (the
rollout's ``n`` samples: same prompt tokens, same left padding), the packed row holds that prompt's tokens once,
followed by each sample's response tokens: ``[prompt | response_1 | response_2 | ...]`` per group. Attention is
confined so that every token sees exactly the keys it sees in its own sequence: a prompt token its earlier prompt
tokens, a response token the whole prompt and its own earlier response tokens (never another sample's). Positions
are the rows' own ``position_ids``, so each response continues at its prompt's length. The prompt's hidden states
are then computed once instead of n times, and its gradient is the sum of what the n samples send back through
attention, exactly what the n separate copies would accumulate into the weights: logits and gradients equal the
unshared packed forward's to float rounding (tests/training/test_shared_prompt.py). The idea is Prefix Grouper
(Liu et al. 2025, arXiv 2506.05433, "shared-prefix forward" for GRPO).

The attention runs as one SDPA call over the groups right-padded to a common length, with a (G, 1, L, L) boolean
mask built once per forward (:class:`SharedPromptLayout`); the CPU varlen attention
(:func:`hybridflow.training.packing.varlen_sdpa_attention`) hands it over when the forward carries
:data:`SHARED_PROMPT_KWARG`. Flash-attention models (GPU) keep the plain packed path: their varlen kernels take
sequence boundaries, not such a mask.

Shapes: B rows, W = P + R columns (P prompt, R response), G groups (distinct prompts), T packed tokens, L the
longest group, H / H_kv query / key-value heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

#: the forward kwarg that carries a :class:`SharedPromptLayout` down to the attention function
SHARED_PROMPT_KWARG = "hybridflow_shared_prompt"


@dataclass
class SharedPromptLayout:
    """One micro-batch packed with shared prompts.

    ``flat_index`` (T,) long: each packed token's index in the flattened (B*W,) rectangle (a shared prompt token
    is read from its group's first row); ``slot`` (T,) long: its place in the (G*L,) right-padded group layout;
    ``mask`` (G, 1, L, L) bool: who attends to whom; ``predictor`` (K,) long and ``target`` (K,) long: the packed
    position whose output predicts/scores each response token, and that token's index in the (B*R,) response
    rectangle (a group's last prompt token predicts the first token of each of its samples)."""

    flat_index: torch.Tensor
    slot: torch.Tensor
    mask: torch.Tensor
    groups: int
    longest: int
    predictor: torch.Tensor
    target: torch.Tensor


def shared_prompt_layout(mask: torch.Tensor, input_ids: torch.Tensor,
                         response_length: int) -> Optional[SharedPromptLayout]:
    """The :class:`SharedPromptLayout` of a micro-batch with ``attention_mask`` and ``input_ids`` (B, W), or None
    when no two rows share a prompt (or a row's prompt is empty), where sharing saves nothing, or when the grouped
    attention would cost more than the prompts it saves (:func:`_sharing_pays`)."""
    shared = _shared_groups(mask, input_ids, response_length)
    if shared is None:
        return None
    prompt_len, prompt_mask, _, group_of = shared
    width = mask.shape[1]
    groups = int(group_of.max()) + 1
    flat, block, predictor_rows = [], [], []
    lengths = []
    for g in range(groups):
        members = (group_of == g).nonzero().flatten().tolist()
        prompt_cols = prompt_mask[members[0]].nonzero().flatten()
        parts = [members[0] * width + prompt_cols]
        blocks = [torch.zeros(len(prompt_cols), dtype=torch.long)]
        for k, r in enumerate(members):
            cols = prompt_len + mask[r, prompt_len:].bool().nonzero().flatten()
            parts.append(r * width + cols)
            blocks.append(torch.full((len(cols),), k + 1, dtype=torch.long))
            predictor_rows.append((g, r, len(prompt_cols), int(sum(len(p) for p in parts[:-1])), len(cols)))
        flat.append(torch.cat(parts))
        block.append(torch.cat(blocks))
        lengths.append(len(flat[-1]))
    return _layout(flat, block, lengths, predictor_rows, response_length, mask.device)


def shared_prompt_tokens(mask: torch.Tensor, input_ids: torch.Tensor, response_length: int) -> Optional[int]:
    """The tokens a shared-prompt packed forward of this micro-batch computes (each distinct prompt's tokens once,
    every response token), or None when :func:`shared_prompt_layout` would not share (no two rows share a prompt,
    a row's prompt is empty, or the grouped attention would not pay)."""
    shared = _shared_groups(mask, input_ids, response_length)
    if shared is None:
        return None
    prompt_len, _, distinct, _ = shared
    return int((distinct >= 0).sum()) + int(mask[:, prompt_len:].sum())


def _shared_groups(mask: torch.Tensor, input_ids: torch.Tensor,
                   response_length: int) -> Optional[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(P, prompt mask (B, P) bool, distinct prompt keys (G, P), each row's group (B,))`` when the micro-batch
    shares prompts and sharing pays (:func:`_sharing_pays`), else None: the one decision
    :func:`shared_prompt_layout` and :func:`shared_prompt_tokens` both follow."""
    prompts = _prompts(mask, input_ids, response_length)
    if prompts is None:
        return None
    prompt_len, prompt_mask, keys = prompts
    distinct, group_of = torch.unique(keys, dim=0, return_inverse=True)
    if len(distinct) == len(keys) or not _sharing_pays(mask, prompt_mask, group_of, prompt_len):
        return None
    return prompt_len, prompt_mask, distinct, group_of


#: sharing is used while the grouped attention call computes at most this many times the attention scores of the
#: rows' own causal calls (sum of squared row lengths; see :func:`_sharing_pays`)
MAX_SHARED_SCORE_RATIO = 3.0


def _sharing_pays(mask: torch.Tensor, prompt_mask: torch.Tensor, group_of: torch.Tensor, prompt_len: int) -> bool:
    """Whether the shared layout's one (G, L, L) attention call (L: the longest group, its prompt once plus every
    sample's response) computes at most :data:`MAX_SHARED_SCORE_RATIO` times the scores of the unshared packed
    path (sum over rows of length squared). A group of n long responses behind a short prompt makes L about n
    times a row, so the grouped call computes about n times the scores to save (n - 1) prompts' tokens. Measured
    (forward + backward, one thread, 4 prompts of ~23 tokens x 4 samples): tiny-arith with 64-token responses
    (ratio 2.6) 103 ms shared against 110 ms unshared, with 256-token responses (ratio 3.5) 658 against 402 ms;
    the 25M-parameter preset with 128-token responses (ratio 2.9) the same within noise (3.1-3.2 s either way)."""
    prompt_tokens = prompt_mask.sum(dim=1)
    response_tokens = mask[:, prompt_len:].sum(dim=1)
    groups = int(group_of.max()) + 1
    group_len = torch.zeros(groups, dtype=torch.long, device=mask.device)
    group_len.index_add_(0, group_of, response_tokens.long())
    group_len += torch.zeros_like(group_len).index_put_((group_of,), prompt_tokens.long())
    shared = groups * int(group_len.max()) ** 2
    return shared <= MAX_SHARED_SCORE_RATIO * int(((prompt_tokens + response_tokens).long() ** 2).sum())


def _prompts(mask: torch.Tensor, input_ids: torch.Tensor,
             response_length: int) -> Optional[tuple[int, torch.Tensor, torch.Tensor]]:
    """``(P, prompt mask (B, P) bool, prompt keys (B, P): the ids with -1 on padding)``, or None when there are
    fewer than two rows or a row's prompt is empty (nothing to share)."""
    prompt_len = mask.shape[1] - response_length
    prompt_mask = mask[:, :prompt_len].bool()
    if len(mask) < 2 or not bool(prompt_mask.any(dim=1).all()):
        return None
    return prompt_len, prompt_mask, input_ids[:, :prompt_len].masked_fill(~prompt_mask, -1)


def _layout(flat: list[torch.Tensor], block: list[torch.Tensor], lengths: list[int], predictor_rows: list[tuple],
            response_length: int, device: torch.device) -> SharedPromptLayout:
    """Assemble the layout from per-group flat indices and block ids (0: prompt, k+1: the group's k-th sample)."""
    groups, longest = len(lengths), max(lengths)
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    slot = torch.cat([g * longest + torch.arange(n) for g, n in enumerate(lengths)])
    block_ids = torch.full((groups, longest), -1, dtype=torch.long)
    for g, ids in enumerate(block):
        block_ids[g, : len(ids)] = ids
    pos = torch.arange(longest)
    causal = pos[None, :, None] >= pos[None, None, :]  # (1, L_q, L_k)
    query_block, key_block = block_ids[:, :, None], block_ids[:, None, :]
    allowed = causal & (key_block == 0) | causal & (key_block == query_block)
    allowed &= query_block >= 0
    allowed |= torch.eye(longest, dtype=torch.bool)[None]  # a padding slot attends to itself (never NaN)
    predictor, target = [], []
    for g, row, prompt_n, offset, response_n in predictor_rows:
        if response_n == 0:
            continue
        first = starts[g] + prompt_n - 1  # the prompt's last token predicts the first response token
        rest = starts[g] + offset + torch.arange(response_n - 1)
        predictor.append(torch.cat([torch.tensor([first]), rest]))
        target.append(row * response_length + torch.arange(response_n))
    empty = torch.zeros(0, dtype=torch.long)
    return SharedPromptLayout(
        flat_index=torch.cat(flat).to(device), slot=slot.to(device), mask=allowed[:, None].to(device),
        groups=groups, longest=longest, predictor=(torch.cat(predictor) if predictor else empty).to(device),
        target=(torch.cat(target) if target else empty).to(device))


def shared_prompt_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            layout: SharedPromptLayout, dropout: float, scaling: Optional[float]) -> torch.Tensor:
    """Attention of a packed (1, H, T, D) / (1, H_kv, T, D) row under ``layout``'s mask, as one SDPA call over
    the (G, H, L, D) right-padded groups; returns (1, T, H, D) like transformers' attention functions."""
    size = layout.groups * layout.longest

    def grouped(x: torch.Tensor) -> torch.Tensor:  # (1, h, T, D) -> (G, h, L, D), zeros in the padding slots
        tokens = x[0].transpose(0, 1)
        full = tokens.new_zeros(size, *tokens.shape[1:]).index_copy(0, layout.slot, tokens)
        return full.view(layout.groups, layout.longest, *tokens.shape[1:]).transpose(1, 2)

    out = torch.nn.functional.scaled_dot_product_attention(
        grouped(query), grouped(key), grouped(value), attn_mask=layout.mask, dropout_p=dropout, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1])  # (G, H, L, D)
    return out.transpose(1, 2).reshape(size, *out.shape[1:2], out.shape[-1])[layout.slot][None]
