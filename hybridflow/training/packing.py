"""Padding-free training forwards (``*.model.use_remove_padding``): the valid tokens of a micro-batch packed into one
row, so no FLOP is spent on padding.

A micro-batch is a (B, P+R) rectangle: prompts left-padded to the longest, responses right-padded to R. Packing keeps
the tokens whose ``attention_mask`` is 1, row after row, as one (1, T) sequence, T = the number of valid tokens;
``position_ids`` keep their per-sequence values (they restart at every sequence), and attention is confined to each
sequence:

- ``flash_attention_2/3/4`` (GPU): the model's own varlen path, from ``cu_seq_lens_q/k`` and ``max_length_q/k`` (the
  cumulative sequence lengths) passed as forward kwargs;
- any other implementation (``sdpa``, ``eager``; CPU): :func:`varlen_sdpa_attention`, registered with transformers'
  ``AttentionInterface`` as ``hybridflow_varlen``: the sequences as one right-padded batch in one causal SDPA call
  when their lengths are close (:data:`BATCHED_ATTENTION_WASTE`), else one causal SDPA call per sequence (exactly
  the FLOPs of the valid tokens); never a (T, T) mask. Called without ``cu_seq_lens_q`` (generation, padded
  forwards of the same module) it is plain ``sdpa``, so switching a module to it changes nothing else.

Equal results: each token sees exactly the keys it sees in the padded forward (its own sequence's earlier tokens, at
the same positions), so logits agree to float rounding (tests/workers/test_packing.py: <= 1e-5 fp32).

The same attention function also serves bf16 training on CPU, packed or not (:func:`use_fp32_attention_backward`,
switched on by the fsdp2 engine): attention that autograd will differentiate runs in fp32 there, because torch's
bf16 CPU attention backward is the slow kernel (tests/training/test_cpu_attention_dtype.py).

Shapes: B sequences, P prompt width, R response width, T valid tokens, V vocabulary (1 for a value model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hybridflow.models.hf import accepts_logits_to_keep
from hybridflow.models.vlm import MROPE_KEY, forward_kwargs as vision_kwargs
from hybridflow.protocol import DataProto
from hybridflow.training.shared_prompt import (SHARED_PROMPT_KWARG, shared_prompt_attention, shared_prompt_layout,
                                               shared_prompt_tokens)
from hybridflow.utils.metrics import Metric, Sum, accumulate

VARLEN_ATTENTION = "hybridflow_varlen"
_PLAIN_ATTENTION_KWARGS = {"position_ids", "use_cache", "cache_position"}  # kwargs that do not change attention
_FLASH_PREFIX = "flash_attention"
#: the packed row's sequences attend as one right-padded batch when that computes at most this many times the
#: attention scores of one call per sequence (S x L^2 against the sum of squared lengths); else one call each
BATCHED_ATTENTION_WASTE = 2.0


def varlen_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          **kwargs) -> tuple[torch.Tensor, None]:
    """Attention for a packed (1, T) row: ``query`` (1, H, T, D), ``key``/``value`` (1, H_kv, T, D) and
    ``cu_seq_lens_q`` (S+1,) int32 in ``kwargs`` (S sequences); each sequence attends causally to itself only.
    Returns ``(out (1, T, H, D), None)`` like transformers' ``sdpa_attention_forward``. Without ``cu_seq_lens_q``
    (or with a KV cache: key length != query length) it is ``sdpa_attention_forward`` unchanged."""
    if upcast_for_cpu_backward(query, key, value):
        with torch.autocast("cpu", enabled=False):
            mask = attention_mask.float() if attention_mask is not None and attention_mask.is_floating_point() \
                else attention_mask
            out, _ = varlen_sdpa_attention(module, query.float(), key.float(), value.float(), mask, dropout, scaling,
                                           **kwargs)
        return out.to(value.dtype), None
    shared = kwargs.pop(SHARED_PROMPT_KWARG, None)
    if shared is not None:  # prompts shared by several rows (hybridflow/training/shared_prompt.py)
        return shared_prompt_attention(query, key, value, shared, dropout, scaling), None
    cu = kwargs.pop("cu_seq_lens_q", None)
    if cu is None or query.shape[2] != key.shape[2]:
        if _masked_gqa(module, query, attention_mask, kwargs):
            return _gqa_sdpa(query, key, value, attention_mask, dropout, scaling), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    for name in ("cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids"):
        kwargs.pop(name, None)
    bounds = cu.tolist()
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    if len(lengths) > 1 and len(lengths) * max(lengths) ** 2 <= BATCHED_ATTENTION_WASTE * sum(n * n for n in lengths):
        return _batched_causal(module, query, key, value, cu, lengths, dropout, scaling, kwargs), None
    outs = [sdpa_attention_forward(module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], None, dropout=dropout,
                                   scaling=scaling, is_causal=True, **kwargs)[0]
            for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    return torch.cat(outs, dim=1), None


def _batched_causal(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    cu: torch.Tensor, lengths: list[int], dropout: float, scaling: float | None,
                    kwargs: dict) -> torch.Tensor:
    """The packed row's S sequences as one right-padded (S, H, L, D) batch, L the longest, in one causal SDPA call;
    returns (1, T, H, D). Exact for every real token: under the causal mask query i of a sequence sees keys
    0..i, all its own, and the padding sits after its last token. One call instead of S (each costs ~0.1 ms of
    fixed overhead forward and backward on CPU); the padded rows' outputs are dropped."""
    total, longest = query.shape[2], max(lengths)
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=query.device),
                                  torch.tensor(lengths, device=query.device))
    index = seq * longest + torch.arange(total, device=query.device) - cu[:-1].long()[seq]  # (T,) slot in S x L

    def batched(x: torch.Tensor) -> torch.Tensor:  # (1, H, T, D) -> (S, H, L, D), zeros after each sequence
        rows = x[0].transpose(0, 1)
        full = rows.new_zeros(len(lengths) * longest, *rows.shape[1:]).index_copy(0, index, rows)
        return full.view(len(lengths), longest, *rows.shape[1:]).transpose(1, 2)

    out = sdpa_attention_forward(module, batched(query), batched(key), batched(value), None, dropout=dropout,
                                 scaling=scaling, is_causal=True, **kwargs)[0]  # (S, L, H, D)
    return out.reshape(len(lengths) * longest, *out.shape[2:])[index][None]


def upcast_for_cpu_backward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether a bf16/fp16 attention on CPU that autograd will differentiate should run in fp32: torch's CPU
    flash-attention *backward* in bf16 is 2-6x slower than in fp32 (torch 2.13, 1 thread: (8, 4, 29, 32)
    fwd+bwd 2.3 ms vs 0.39 ms; (16, 8, 160, 64) 53 ms vs 30 ms), while its forward is about 2x faster at most, so the
    training forward + backward is faster in fp32 (the casts are O(T x H x D)). Forwards without grad (reference,
    old logprobs, rollout) keep their dtype. Under CPU autocast the dtype is autocast's (SDPA is on its bf16 list;
    the rotary embedding hands attention fp32 queries)."""
    if query.device.type != "cpu" or not torch.is_grad_enabled():
        return False
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype  # autocast casts
    return dtype in (torch.bfloat16, torch.float16) and (query.requires_grad or key.requires_grad
                                                         or value.requires_grad)


def _masked_gqa(module: torch.nn.Module, query: torch.Tensor, attention_mask: torch.Tensor | None,
                kwargs: dict) -> bool:
    """Whether a masked grouped-query attention on CPU should skip transformers' ``repeat_kv``: its sdpa path
    copies every key/value head ``num_key_value_groups`` times when a mask is given (each decode step of the hf
    rollout, over the whole KV cache), while torch's CPU SDPA takes ``enable_gqa`` with a boolean mask."""
    return (query.device.type == "cpu" and getattr(module, "num_key_value_groups", 1) > 1
            and attention_mask is not None and attention_mask.dtype == torch.bool
            and set(kwargs) <= _PLAIN_ATTENTION_KWARGS and not getattr(module, "training", False))


def _gqa_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
              dropout: float, scaling: float | None) -> torch.Tensor:
    """SDPA with ``enable_gqa`` over (B, H, Q, D) / (B, H_kv, K, D); returns (B, Q, H, D) like transformers."""
    mask = attention_mask[:, :, :, : key.shape[-2]]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous()


AttentionInterface.register(VARLEN_ATTENTION, varlen_sdpa_attention)
AttentionMaskInterface.register(VARLEN_ATTENTION, sdpa_mask)  # padded forwards get sdpa's masks, as before


@dataclass
class Packed:
    """One micro-batch packed: ``input_ids``/``position_ids`` (1, T) long; ``flat_index`` (T,) long, each packed
    token's index in the flattened (B*(P+R),) rectangle; ``cu_seqlens`` (B+1,) int32, the sequence boundaries in the
    packed row; ``max_seqlen`` the longest sequence."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    flat_index: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int


def pack(micro: DataProto) -> Packed:
    """Pack the valid tokens (``attention_mask`` == 1) of ``micro``'s ``input_ids``/``position_ids`` (B, P+R)."""
    batch = micro.batch
    mask = batch["attention_mask"].bool()
    lengths = mask.sum(dim=1)
    flat_index = mask.flatten().nonzero().flatten()
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=lengths.device)
    cu[1:] = torch.cumsum(lengths, dim=0)
    return Packed(
        input_ids=batch["input_ids"].flatten()[flat_index][None],
        position_ids=batch["position_ids"].flatten()[flat_index][None],
        flat_index=flat_index, cu_seqlens=cu, max_seqlen=int(lengths.max()) if len(lengths) else 0,
    )


def padded_columns(mask: torch.Tensor, response_length: int) -> tuple[int, int]:
    """The columns ``[first, end)`` of a padded forward over ``mask`` (B, P+R): left padding common to every prompt
    and response slots after the longest response are cut (at least the last prompt column and one response column
    stay)."""
    prompt_len = mask.shape[1] - response_length
    used = mask.bool().any(dim=0).nonzero().flatten()
    if not used.numel():
        return 0, mask.shape[1]
    first = min(int(used[0]), prompt_len - 1)
    return first, prompt_len + max(1, int(used[-1]) + 1 - prompt_len)


def computed_tokens(micro: DataProto, response_length: int, remove_padding: bool,
                    shares_prompts: bool = False) -> tuple[int, int]:
    """``(computed, valid)`` token counts of one micro-batch forward: the valid tokens (``attention_mask`` ones) and
    the tokens the forward computes (the same when packed, else B x the kept columns of :func:`padded_columns`;
    packed with ``shares_prompts``, each shared prompt once: then fewer than the valid tokens,
    :mod:`hybridflow.training.shared_prompt`)."""
    mask = micro.batch["attention_mask"]
    valid = int(mask.sum())
    if remove_padding:
        shared = shared_prompt_tokens(mask, micro.batch["input_ids"], response_length) if shares_prompts else None
        return (valid if shared is None else shared), valid
    first, end = padded_columns(mask, response_length)
    return mask.shape[0] * (end - first), valid


def add_token_counts(stats: dict[str, Metric], role: str, micro: DataProto, remove_padding: bool,
                     module: torch.nn.Module | None = None) -> None:
    """Pool a training micro-batch's :func:`computed_tokens` into ``stats`` as the ``Sum`` metrics
    ``perf/<role>_computed_tokens`` and ``perf/<role>_valid_tokens`` (their ratio is the padding overhead that
    benchmarks/step_profile.py reports; below 1 valid per computed token when shared prompts are computed once).
    ``module``: the model whose packed forwards ran (shared prompts count only where its attention shares them: not
    flash attention)."""
    shares = module is not None and remove_padding and _attention_implementation(module) in ("sdpa", "eager",
                                                                                           VARLEN_ATTENTION)
    computed, valid = computed_tokens(micro, micro.batch["responses"].shape[1], remove_padding, shares)
    accumulate(stats, f"perf/{role}_computed_tokens", Sum(float(computed)))
    accumulate(stats, f"perf/{role}_valid_tokens", Sum(float(valid)))


def _attention_implementation(module: torch.nn.Module) -> str | None:
    """The attention implementation ``module``'s config names (``sdpa`` when unset; None without a config)."""
    config = getattr(module, "config", None)
    return (getattr(config, "_attn_implementation", None) or "sdpa") if config is not None else None


def use_varlen_attention(module: torch.nn.Module) -> bool:
    """Make ``module`` attend with :func:`varlen_sdpa_attention` unless it runs a flash-attention kernel (which has
    its own varlen path). Returns True when the module's attention is now ``hybridflow_varlen``."""
    config = module.config
    current = _attention_implementation(module)
    if current.startswith(_FLASH_PREFIX):
        return False
    if current != VARLEN_ATTENTION:
        for sub in [config, *[getattr(config, k) for k in getattr(config, "sub_configs", {}) or {}]]:
            if sub is not None:
                sub._attn_implementation = VARLEN_ATTENTION
    return True


def use_fp32_attention_backward(module: torch.nn.Module) -> bool:
    """Make an ``sdpa`` module attend with :func:`varlen_sdpa_attention`, which runs bf16/fp16 attention that will be
    differentiated on CPU in fp32 (:func:`upcast_for_cpu_backward`); everything else is plain ``sdpa``. Other
    implementations (``eager`` for a model that needs it, flash kernels) are left alone. Returns whether it
    switched (or had already)."""
    return _attention_implementation(module) in ("sdpa", VARLEN_ATTENTION) and use_varlen_attention(module)


def _packed_outputs(module: torch.nn.Module, micro: DataProto,
                    keep: torch.Tensor | None = None) -> tuple[torch.Tensor, Packed]:
    """(outputs (T, V) of one packed forward, the packing). ``keep`` (K,) long: packed positions whose outputs are
    needed; a causal LM then runs its output head on those only (transformers' ``logits_to_keep``) and the outputs
    are (K, V)."""
    packed = pack(micro)
    varlen = {"cu_seq_lens_q": packed.cu_seqlens, "cu_seq_lens_k": packed.cu_seqlens,
              "max_length_q": packed.max_seqlen, "max_length_k": packed.max_seqlen}
    if keep is not None:
        varlen["logits_to_keep"] = keep
    # a 1x1x1x1 mask is taken as "already prepared" by transformers (no (T, T) mask is built); the varlen attention
    # ignores it. Flash attention gets no mask: its varlen path reads cu_seq_lens.
    device = packed.input_ids.device
    dummy = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device) if use_varlen_attention(module) else None
    extra = vision_kwargs(micro, flat_index=packed.flat_index)  # a VLM: images, (4, 1, T) [text; mrope] positions
    out = module(input_ids=packed.input_ids, attention_mask=dummy,
                 position_ids=extra.pop("position_ids", packed.position_ids), use_cache=False, **varlen,
                 **extra).logits[0]
    return out, packed


def packed_forward(module: torch.nn.Module, micro: DataProto) -> torch.Tensor:
    """``module``'s outputs for every token of ``micro`` (B, P+R) from one packed (1, T) forward: (B, P+R, V),
    0 at padded positions (their outputs are never used). The module must accept ``position_ids`` and pass extra
    kwargs on to its attention (every transformers decoder does)."""
    mask = micro.batch["attention_mask"]
    out, packed = _packed_outputs(module, micro)
    full = out.new_zeros(mask.numel(), out.shape[-1]).index_copy(0, packed.flat_index, out)
    return full.view(*mask.shape, out.shape[-1])


def packed_response_forward(module: torch.nn.Module, micro: DataProto, response_length: int) -> torch.Tensor:
    """:func:`hybridflow.workers.micro.response_forward` without padding: the same (B, R, V) output rows
    (``logits[:, P-1 : P+R-1]``: position t predicts/scores response token t) from one packed forward; only those
    rows are materialised. Rows whose input token is padding are 0 (the padded path leaves arbitrary finite values
    there)."""
    mask = micro.batch["attention_mask"]
    rows, width = mask.shape
    # not flash attention (its varlen kernels take no such mask), not a VLM batch (its images are per row)
    if use_varlen_attention(module) and MROPE_KEY not in micro.batch.keys():
        layout = shared_prompt_layout(mask, micro.batch["input_ids"], response_length)
        if layout is not None:
            return _shared_prompt_response_forward(module, micro, response_length, layout)
    prompt_len = width - response_length
    flat_index = mask.bool().flatten().nonzero().flatten()
    row, col = flat_index // width, flat_index % width
    keep = (col >= prompt_len - 1) & (col < width - 1)  # the tokens whose output predicts/scores a response slot
    head_only = accepts_logits_to_keep(module)
    out, _ = _packed_outputs(module, micro, keep.nonzero().flatten() if head_only else None)
    out = out if head_only else out[keep]
    result = out.new_zeros(rows * response_length, out.shape[-1])
    target = row[keep] * response_length + col[keep] - (prompt_len - 1)
    return result.index_copy(0, target, out).view(rows, response_length, out.shape[-1])



def _shared_prompt_response_forward(module: torch.nn.Module, micro: DataProto, response_length: int,
                                    layout) -> torch.Tensor:
    """:func:`packed_response_forward` with each shared prompt computed once (``layout``: a
    :class:`~hybridflow.training.shared_prompt.SharedPromptLayout`); the same (B, R, V) rows."""
    batch = micro.batch
    input_ids = batch["input_ids"].flatten()[layout.flat_index][None]
    position_ids = batch["position_ids"].flatten()[layout.flat_index][None]
    head_only = accepts_logits_to_keep(module)
    extra = {"logits_to_keep": layout.predictor} if head_only else {}
    dummy = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=input_ids.device)  # see _packed_outputs
    out = module(input_ids=input_ids, attention_mask=dummy, position_ids=position_ids, use_cache=False,
                 **{SHARED_PROMPT_KWARG: layout}, **extra).logits[0]
    out = out if head_only else out[layout.predictor]
    rows = batch["attention_mask"].shape[0]
    result = out.new_zeros(rows * response_length, out.shape[-1])
    return result.index_copy(0, layout.target, out).view(rows, response_length, out.shape[-1])
