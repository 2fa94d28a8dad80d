"""Ulysses sequence parallelism for the fsdp2 engine (``*.ulysses_sequence_parallel_size``, verl's key): the ``sp``
ranks of a data-parallel group share one micro-batch and split its sequence dimension, so each rank holds the
activations of ``1/sp`` of the tokens (DeepSpeed-Ulysses: Jacobs et al. 2023, "System Optimizations for Enabling
Training of Extreme Long Sequence Transformer Models", Sec. 3; the all-to-alls are
:mod:`hybridflow.distributed.sequence_parallel`).

One micro-batch forward (:func:`ulysses_forward`):

1. The micro-batch becomes rows of tokens: padded, the (B, L) rectangle (its columns no row attends to cut as in
   :func:`hybridflow.training.micro.response_forward`); packed (``use_remove_padding``), the (1, T) row of valid
   tokens (:func:`hybridflow.training.packing.pack`). Labels are shifted (the token after each position) and
   ``position_ids`` taken BEFORE the split, so every shard carries its global positions and the labels of its
   last token come from the next shard. The rows are padded to a multiple of ``sp`` and rank ``r`` keeps columns
   ``[r * S/sp, (r+1) * S/sp)``.
2. The module runs on its shard with its attention switched to :func:`ulysses_attention` (registered with
   transformers' ``AttentionInterface`` as ``hybridflow_ulysses``, so Hugging Face Llama/Qwen-class models run
   unmodified): queries/keys/values (B, H, S/sp, D) go all-to-all to (B, H/sp, S, D), attention runs over the whole
   sequence on the rank's heads, and the output goes back to (B, S/sp, H, D). Each query-head group stays with its
   KV head (contiguous head slices); with fewer KV heads than ``sp`` (or a count it does not divide) the KV heads
   are repeated to one per query head first. Attention is confined to each sequence's valid tokens: padded rows
   attend causally within their valid span, the packed row within each ``cu_seqlens`` segment (padding tokens
   attend to nothing and output 0).
3. The per-token results (logprobs and entropy of the shifted labels, values, scores) of each shard are gathered
   over the sp group (:func:`hybridflow.distributed.sequence_parallel.gather_sequence`) and placed like the
   engine's sp=1 forward returns them, so the result contract is unchanged. Gradients are exact: see
   ``gather_sequence`` for why the dp x sp average of the gradients is the dp average without sp.

Equal results: every valid token attends to exactly the keys of the sp=1 forward (tests/training/test_ulysses.py:
logprobs, values, losses and gradients within 1e-5 fp32, padded and packed, sp=2 and sp=2 x dp=2, GQA).

Shapes: B sequences, L = P + R tokens, S the (padded) sequence length that is split, H query heads, D head dim.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hybridflow.algorithms import entropy_from_logits, logprobs_from_logits
from hybridflow.algorithms.sampling import SamplingSpec, sampling_logits
from hybridflow.distributed.sequence_parallel import all_to_all, gather_sequence
from hybridflow.protocol import DataProto
from hybridflow.training.packing import (VARLEN_ATTENTION, _upcast_for_cpu_backward, pack, padded_columns,
                                         varlen_sdpa_attention)

__all__ = ["ULYSSES_ATTENTION", "SequenceLayout", "ulysses_attention", "ulysses_forward", "use_ulysses_attention"]

ULYSSES_ATTENTION = "hybridflow_ulysses"


@dataclass
class SequenceLayout:
    """The full (unsplit) token rows of one micro-batch forward.

    Attributes:
        input_ids / position_ids / labels: (N, S) long, S a multiple of ``sp``; ``labels[:, t]`` is the token after
            position t (0 where there is none).
        segments: per row, the ``(start, stop)`` column spans that attend causally within themselves (a padded
            row's valid span; the packed row's sequences); tokens outside every span are padding.
        group: the sp process group; ``sp``/``rank``: its size and this rank's place.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    segments: list[list[tuple[int, int]]]
    group: dist.ProcessGroup
    sp: int
    rank: int

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's columns of an (N, S) tensor: (N, S/sp)."""
        step = x.shape[1] // self.sp
        return x[:, self.rank * step: (self.rank + 1) * step]


_ACTIVE: list[SequenceLayout] = []  # the layout of the forward in progress (a stack: one entry while it runs)


def _pad_to(x: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -x.shape[1] % multiple
    return F.pad(x, (0, extra)) if extra else x


def _shift_labels(ids: torch.Tensor) -> torch.Tensor:
    """(N, S) -> (N, S): the next token of each position, 0 after the last."""
    return F.pad(ids[:, 1:], (0, 1))


def _valid_spans(mask: torch.Tensor) -> Optional[list[list[tuple[int, int]]]]:
    """Per row of ``mask`` (N, S) bool the one span of its ones; None when some row's ones are not contiguous."""
    spans = []
    for row in mask:
        ones = row.nonzero().flatten()
        if not ones.numel():
            spans.append([])
            continue
        start, stop = int(ones[0]), int(ones[-1]) + 1
        if stop - start != ones.numel():
            return None
        spans.append([(start, stop)])
    return spans


def _segment_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       segments: list[list[tuple[int, int]]], dropout: float,
                       scaling: Optional[float]) -> torch.Tensor:
    """Causal attention within each segment of each row: (N, h, S, D) each -> (N, h, S, D), 0 outside segments."""
    rows = []
    for n, spans in enumerate(segments):
        pieces, at = [], 0
        for start, stop in spans:
            if start > at:
                pieces.append(query.new_zeros(query.shape[1], start - at, value.shape[-1]))
            pieces.append(F.scaled_dot_product_attention(
                query[n:n + 1, :, start:stop], key[n:n + 1, :, start:stop], value[n:n + 1, :, start:stop],
                dropout_p=dropout, is_causal=True, scale=scaling)[0])
            at = stop
        if at < query.shape[2]:
            pieces.append(query.new_zeros(query.shape[1], query.shape[2] - at, value.shape[-1]))
        rows.append(torch.cat(pieces, dim=1))
    return torch.stack(rows)


def ulysses_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """Attention over the whole sequence for a sequence shard: ``query`` (N, H, S/sp, D), ``key``/``value``
    (N, H_kv, S/sp, D) -> ``(out (N, S/sp, H, D), None)`` like transformers' ``sdpa_attention_forward``. Outside a
    :func:`ulysses_forward` it is :func:`hybridflow.training.packing.varlen_sdpa_attention` (plain sdpa).

    Raises:
        ValueError: the query heads are not divisible by the sp size.
    """
    if not _ACTIVE:
        return varlen_sdpa_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    layout = _ACTIVE[-1]
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % layout.sp:
        raise ValueError(f"ulysses_sequence_parallel_size={layout.sp} must divide the {heads} attention heads")
    if kv_heads % layout.sp:  # too few KV heads to split: one per query head (head h keeps its KV head h // g)
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    q, k, v = (all_to_all(x, layout.group, scatter_dim=1, gather_dim=2) for x in (query, key, value))
    groups = q.shape[1] // k.shape[1]  # contiguous head slices keep each query group with its KV head
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    dropout = dropout if module.training else 0.0
    if _upcast_for_cpu_backward(q, k, v):  # bf16 attention backward on CPU is torch's slow kernel: fp32 instead
        with torch.autocast("cpu", enabled=False):
            out = _segment_attention(q.float(), k.float(), v.float(), layout.segments, dropout, scaling).to(v.dtype)
    else:
        out = _segment_attention(q, k, v, layout.segments, dropout, scaling)
    out = all_to_all(out, layout.group, scatter_dim=2, gather_dim=1)  # (N, H, S/sp, D)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention)
AttentionMaskInterface.register(ULYSSES_ATTENTION, sdpa_mask)  # forwards outside sp get sdpa's masks


def use_ulysses_attention(module: torch.nn.Module) -> None:
    """Make ``module`` (and its sub-configs) attend with :func:`ulysses_attention` (plain sdpa outside sp forwards).

    Raises:
        ValueError: the module runs another attention than ``sdpa`` / ``hybridflow_varlen`` (e.g. ``eager`` or a
            flash kernel, which this sp path does not wrap yet).
    """
    config = module.config
    current = getattr(config, "_attn_implementation", None) or "sdpa"
    if current == ULYSSES_ATTENTION:
        return
    if current not in ("sdpa", VARLEN_ATTENTION):
        raise ValueError(f"ulysses sequence parallelism wraps sdpa attention; the model runs {current!r}")
    for sub in [config, *[getattr(config, k) for k in getattr(config, "sub_configs", {}) or {}]]:
        if sub is not None:
            sub._attn_implementation = ULYSSES_ATTENTION


@contextlib.contextmanager
def _active(layout: SequenceLayout) -> Iterator[None]:
    _ACTIVE.append(layout)
    try:
        yield
    finally:
        _ACTIVE.pop()


def _padded_layout(micro: DataProto, response_length: int, group: dist.ProcessGroup) -> tuple[SequenceLayout, int]:
    """The padded rows (columns no row attends to cut) and the first kept column."""
    batch = micro.batch
    mask = batch["attention_mask"].bool()
    first, end = padded_columns(mask, response_length)
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    ids, pos, mask = (_pad_to(x[:, first:end], sp) for x in (batch["input_ids"], batch["position_ids"], mask))
    spans = _valid_spans(mask)
    if spans is None:
        raise ValueError("ulysses sequence parallelism needs each row's attention_mask ones to be contiguous")
    labels = _shift_labels(ids)
    return SequenceLayout(ids, pos, labels, spans, group, sp, rank), first


def _packed_layout(micro: DataProto, group: dist.ProcessGroup) -> tuple[SequenceLayout, torch.Tensor]:
    """The packed (1, T) row of valid tokens (padded to a multiple of sp) and each token's flat index."""
    packed = pack(micro)
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    bounds = packed.cu_seqlens.tolist()
    spans = [[(s, e) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]]
    labels = _shift_labels(packed.input_ids)  # a sequence's last label is the next one's first: never used
    layout = SequenceLayout(_pad_to(packed.input_ids, sp), _pad_to(packed.position_ids, sp), _pad_to(labels, sp),
                            spans, group, sp, rank)
    return layout, packed.flat_index


def _token_outputs(module: torch.nn.Module, layout: SequenceLayout, kind: str, sampling: Optional[SamplingSpec],
                   entropy: bool) -> dict[str, torch.Tensor]:
    """Run ``module`` on this rank's shard; per-token results gathered to (N, S) fp32 (``log_probs`` of the
    shifted labels (+ ``entropy``) for a policy, ``values`` for a value model / scorer)."""
    use_ulysses_attention(module)
    ids = layout.shard(layout.input_ids)
    dummy = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=ids.device)  # "mask prepared": attention uses segments
    with _active(layout):
        out = module(input_ids=ids, attention_mask=dummy, position_ids=layout.shard(layout.position_ids),
                     use_cache=False).logits
    if kind != "policy":
        return {"values": gather_sequence(out.squeeze(-1).float(), layout.group)}
    labels = layout.shard(layout.labels)
    logits = sampling_logits(out.float(), sampling or SamplingSpec(), keep=labels)
    result = {"log_probs": gather_sequence(logprobs_from_logits(logits, labels), layout.group)}
    if entropy:
        result["entropy"] = gather_sequence(entropy_from_logits(logits), layout.group)
    return result


def ulysses_forward(module: torch.nn.Module, micro: DataProto, kind: str, remove_padding: bool,
                    group: dist.ProcessGroup, sampling: Optional[SamplingSpec] = None,
                    entropy: bool = False) -> dict[str, torch.Tensor]:
    """:meth:`hybridflow.training.base.TrainEngine.forward` of the fsdp2 engine with the sequence split over
    ``group`` (every rank of it calls this with the same ``micro``). Returns the same keys and shapes as the sp=1
    forward: ``log_probs`` (+ ``entropy``) (B, R) fp32 for a policy, ``values`` (B, R) fp32 for a value model,
    ``token_scores`` (B, L) fp32 for a scorer. Response slots whose input token is padding hold 0 (or a finite
    value), as in the sp=1 forwards.

    Raises:
        ValueError: heads not divisible by the sp size; a padded row whose valid tokens are not contiguous.
    """
    mask = micro.batch["attention_mask"]
    rows, width = mask.shape
    response_length = micro.batch["responses"].shape[1] if "responses" in micro.batch.keys() else 0
    if remove_padding:
        layout, flat_index = _packed_layout(micro, group)
    else:
        layout, first = _padded_layout(micro, response_length, group)
    outputs = _token_outputs(module, layout, kind, sampling, entropy)
    result = {}
    for name, full in outputs.items():
        if remove_padding:  # packed row -> (B, L), 0 at padding
            full = full.new_zeros(rows * width).index_copy(0, flat_index, full[0, :flat_index.numel()])
            full, first = full.view(rows, width), 0
        else:
            full = F.pad(full, (first, 0))[:, :width]  # back to the (B, L) columns (cut ones 0)
            full = F.pad(full, (0, width - full.shape[1]))
        if kind == "score":
            result["token_scores"] = full
            continue
        prompt_len = width - response_length
        result[name] = full[:, prompt_len - 1: width - 1]  # position t predicts/scores response token t
    return result
