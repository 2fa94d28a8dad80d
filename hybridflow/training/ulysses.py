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

Mixture-of-experts models route each token by itself, so each rank routes its slice; routing replay gives rank
``r`` the rows of the ``routed_experts`` column of its slice (:func:`routing_index`) and a recorded routing is
gathered over the sp group (:func:`gather_routing`). Vision-language models (Qwen2.5-VL: mrope positions carried in
the batch) run the vision tower and the token embedding over the whole micro-batch on every sp rank; the language
model gets this rank's slice of the embedded sequence and of the mrope positions ((3, N, S) padded, (4, 1, S)
packed), split like the tokens (:func:`_split_language_model`).

Equal results: every valid token attends to exactly the keys of the sp=1 forward (tests/training/test_ulysses.py:
logprobs, values, losses and gradients within 1e-5 fp32, padded and packed, sp=2 and sp=2 x dp=2, GQA, MoE with and
without routing replay, Qwen2.5-VL).

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
from hybridflow.errors import UserError
from hybridflow.distributed.sequence_parallel import all_to_all, gather_sequence
from hybridflow.models.vlm import forward_kwargs as vision_kwargs
from hybridflow.protocol import DataProto
from hybridflow.training.packing import (VARLEN_ATTENTION, pack, padded_columns, upcast_for_cpu_backward,
                                         varlen_sdpa_attention)

__all__ = ["LAYOUT_KWARG", "SP_KEYS", "ULYSSES_ATTENTION", "SequenceLayout", "UlyssesAttentionError",
           "check_ulysses_attention", "sequence_layout", "ulysses_attention", "ulysses_forward",
           "use_ulysses_attention"]

ULYSSES_ATTENTION = "hybridflow_ulysses"


@dataclass
class SequenceLayout:
    """The full (unsplit) token rows of one micro-batch forward.

    Attributes:
        input_ids / position_ids / labels: (N, S) long, S a multiple of ``sp``; ``labels[:, t]`` is the token after
            position t (0 where there is none). A vision-language batch's ``position_ids`` are its carried mrope
            positions instead: (3, N, S) padded, (4, 1, S) ``[text; t; h; w]`` packed
            (:func:`hybridflow.models.vlm.forward_kwargs`), split on the last dim like the tokens.
        segments: per row, the ``(start, stop)`` column spans that attend causally within themselves (a padded
            row's valid span; the packed row's sequences); tokens outside every span are padding.
        flat: (N, S) long, each column's token index in the flattened (B*(P+R),) micro-batch rectangle; -1 at the
            columns added to reach a multiple of ``sp`` (the MoE routing of :func:`routing_index`).
        valid: (N, S) bool, the tokens of the micro-batch's ``attention_mask``.
        group: the sp process group; ``sp``/``rank``: its size and this rank's place.
        vision: a VLM batch's ``pixel_values`` / ``image_grid_thw`` (the whole micro-batch's images, every sp rank
            runs the vision tower on all of them); empty for text.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    segments: list[list[tuple[int, int]]]
    flat: torch.Tensor
    valid: torch.Tensor
    group: dist.ProcessGroup
    sp: int
    rank: int
    vision: dict

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's columns of an (..., S) tensor: (..., S/sp)."""
        step = x.shape[-1] // self.sp
        return x[..., self.rank * step: (self.rank + 1) * step]


# the forward kwarg that carries the SequenceLayout down to the attention (transformers passes a model's extra
# kwargs through its decoder layers to the attention function, and gradient checkpointing's recomputation in the
# backward gets them again: a context set around the forward would be gone by then)
LAYOUT_KWARG = "hybridflow_sequence_layout"


def _pad_to(x: torch.Tensor, multiple: int, value: int = 0) -> torch.Tensor:
    """``x`` (..., S) padded on the last dim with ``value`` to a multiple of ``multiple``."""
    extra = -x.shape[-1] % multiple
    return F.pad(x, (0, extra), value=value) if extra else x


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
    (N, H_kv, S/sp, D) -> ``(out (N, S/sp, H, D), None)`` like transformers' ``sdpa_attention_forward``; the layout
    comes as the ``hybridflow_sequence_layout`` kwarg (:data:`LAYOUT_KWARG`). Without it (outside a
    :func:`ulysses_forward`, or a VLM's vision tower) it is
    :func:`hybridflow.training.packing.varlen_sdpa_attention` (plain sdpa).

    Raises:
        ValueError: the query heads are not divisible by the sp size.
    """
    layout = kwargs.pop(LAYOUT_KWARG, None)
    if layout is None:
        return varlen_sdpa_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
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
    if upcast_for_cpu_backward(q, k, v):  # bf16 attention backward on CPU is torch's slow kernel: fp32 instead
        with torch.autocast("cpu", enabled=False):
            out = _segment_attention(q.float(), k.float(), v.float(), layout.segments, dropout, scaling).to(v.dtype)
    else:
        out = _segment_attention(q, k, v, layout.segments, dropout, scaling)
    out = all_to_all(out, layout.group, scatter_dim=2, gather_dim=1)  # (N, H, S/sp, D)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention)
AttentionMaskInterface.register(ULYSSES_ATTENTION, sdpa_mask)  # forwards outside sp get sdpa's masks


class UlyssesAttentionError(UserError, ValueError):
    """A model whose attention the Ulysses path does not wrap, with ``ulysses_sequence_parallel_size > 1``."""


#: the engine role (``EngineSpec.role``) -> its sp config key
SP_KEYS = {"actor": "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
           "ref": "actor_rollout_ref.ref.ulysses_sequence_parallel_size",
           "critic": "critic.ulysses_sequence_parallel_size"}


def check_ulysses_attention(module: torch.nn.Module, sp: int, role: str) -> None:
    """At engine build: with ``sp > 1`` the model must attend with ``sdpa`` (what :func:`use_ulysses_attention`
    wraps); e.g. ``eager`` (an architecture without sdpa support) or ``flash_attention_2`` is refused in one line
    naming the role's sp key and the implementation.

    Raises:
        UlyssesAttentionError: the model runs another attention implementation.
    """
    current = getattr(module.config, "_attn_implementation", None) or "sdpa"
    if sp > 1 and current not in ("sdpa", VARLEN_ATTENTION, ULYSSES_ATTENTION):
        key = SP_KEYS.get(role, f"{role}.ulysses_sequence_parallel_size")
        raise UlyssesAttentionError(f"{key}={sp}: Ulysses sequence parallelism wraps sdpa attention, but the {role} "
                                    f"model runs attn_implementation={current!r} (not supported under sp yet)")


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


def _response_length(micro: DataProto) -> int:
    return micro.batch["responses"].shape[1] if "responses" in micro.batch.keys() else 0


def _padded_layout(micro: DataProto, group: dist.ProcessGroup, vision: bool) -> SequenceLayout:
    """The padded rows, the columns no row attends to cut (:func:`hybridflow.training.packing.padded_columns`)."""
    batch = micro.batch
    mask = batch["attention_mask"].bool()
    rows, width = mask.shape
    first, end = padded_columns(mask, _response_length(micro))
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    ids, pos, mask = (_pad_to(x[:, first:end], sp) for x in (batch["input_ids"], batch["position_ids"], mask))
    flat = _pad_to(torch.arange(rows * width, device=mask.device).view(rows, width)[:, first:end], sp, value=-1)
    spans = _valid_spans(mask)
    if spans is None:
        raise ValueError("ulysses sequence parallelism needs each row's attention_mask ones to be contiguous")
    extra = vision_kwargs(micro, first, end) if vision else {}  # a VLM: images, (3, B, end-first) mrope positions
    if "position_ids" in extra:
        pos = _pad_to(extra.pop("position_ids"), sp)
    return SequenceLayout(ids, pos, _shift_labels(ids), spans, flat, mask, group, sp, rank, extra)


def _packed_layout(micro: DataProto, group: dist.ProcessGroup, vision: bool) -> SequenceLayout:
    """The packed (1, T) row of valid tokens (padded to a multiple of sp)."""
    packed = pack(micro)
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    bounds = packed.cu_seqlens.tolist()
    spans = [[(s, e) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]]
    labels = _shift_labels(packed.input_ids)  # a sequence's last label is the next one's first: never used
    flat = _pad_to(packed.flat_index[None], sp, value=-1)
    extra = vision_kwargs(micro, flat_index=packed.flat_index) if vision else {}  # a VLM: (4, 1, T) positions
    pos = _pad_to(extra.pop("position_ids", packed.position_ids), sp)
    return SequenceLayout(_pad_to(packed.input_ids, sp), pos, _pad_to(labels, sp), spans, flat, flat >= 0, group,
                          sp, rank, extra)


def sequence_layout(micro: DataProto, remove_padding: bool, group: dist.ProcessGroup,
                    vision: bool = True) -> SequenceLayout:
    """The :class:`SequenceLayout` of the engine's sp forward of ``micro`` (packed with ``remove_padding``);
    ``vision=False`` leaves a VLM batch's images and mrope positions out (token bookkeeping only).

    Raises:
        ValueError: a padded row whose valid tokens are not contiguous.
    """
    return (_packed_layout if remove_padding else _padded_layout)(micro, group, vision)


def routing_index(micro: DataProto, remove_padding: bool, group: dist.ProcessGroup) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
    """For a mixture-of-experts forward under sp: ``(index, valid)``, both (N*S/sp,), for each token of this rank's
    shard in the order the model flattens it, its index in the flattened (B*(P+R),) micro-batch rectangle (long;
    0 for the columns added to reach a multiple of sp: their routing is never used) and whether it is a valid token
    (bool). Rank r replays the rows ``index`` of the ``routed_experts`` column: the same split as its tokens."""
    layout = sequence_layout(micro, remove_padding, group, vision=False)
    return layout.shard(layout.flat).flatten().clamp(min=0), layout.shard(layout.valid).flatten()


def gather_routing(stacked: torch.Tensor, micro: DataProto, remove_padding: bool,
                   group: dist.ProcessGroup) -> torch.Tensor:
    """Every sp rank's routing of its shard, ``stacked`` (N*S/sp, Ly, k) int, gathered (a collective over
    ``group``) into the (B, P+R, Ly, k) int16 ``routed_experts`` layout of the whole micro-batch (0 where no token
    was computed)."""
    layout = sequence_layout(micro, remove_padding, group, vision=False)
    local = stacked.to(torch.int32).reshape(layout.flat.shape[0], -1, *stacked.shape[1:]).contiguous()
    parts = [torch.empty_like(local) for _ in range(layout.sp)]
    dist.all_gather(parts, local, group=group)
    full, flat = torch.cat(parts, dim=1).flatten(0, 1), layout.flat.flatten()
    mask = micro.batch["attention_mask"]
    out = torch.zeros(mask.numel(), *stacked.shape[1:], dtype=torch.int16, device=stacked.device)
    out[flat[flat >= 0]] = full[flat >= 0].to(torch.int16)
    return out.view(*mask.shape, *stacked.shape[1:])


def _language_model(module: torch.nn.Module) -> torch.nn.Module:
    for name, sub in module.named_modules():
        if name.endswith("language_model") and hasattr(sub, "layers"):
            return sub
    raise ValueError(f"ulysses: {type(module).__name__} got mrope positions but has no language_model to split")


@contextlib.contextmanager
def _split_language_model(module: torch.nn.Module, layout: SequenceLayout) -> Iterator[None]:
    """A VLM forward over the whole (N, S) micro-batch: the vision tower and the token embedding run on every sp
    rank over all of it (the image features land at their tokens), then a pre-hook hands the language model this
    rank's slice of ``inputs_embeds`` (N, S/sp, H) and of the mrope positions, and turns the sp attention on for
    its layers only (the vision tower's attention is not split). Each rank's embedding / vision gradients come
    from its slice's tokens only, so the dp x sp average is exact (as :func:`gather_sequence`)."""
    language = _language_model(module)

    def pre(_mod: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
        embeds = kwargs["inputs_embeds"]
        step = embeds.shape[1] // layout.sp
        kwargs["inputs_embeds"] = embeds[:, layout.rank * step: (layout.rank + 1) * step]
        kwargs["position_ids"] = layout.shard(kwargs["position_ids"])
        kwargs[LAYOUT_KWARG] = layout
        return args, kwargs

    handle = language.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _token_outputs(module: torch.nn.Module, layout: SequenceLayout, kind: str, sampling: Optional[SamplingSpec],
                   entropy: bool) -> dict[str, torch.Tensor]:
    """Run ``module`` on this rank's shard; per-token results gathered to (N, S) fp32 (``log_probs`` of the
    shifted labels (+ ``entropy``) for a policy, ``values`` for a value model / scorer)."""
    use_ulysses_attention(module)
    dummy = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=layout.input_ids.device)  # attention uses segments
    if layout.position_ids.dim() == 3:  # a VLM batch (mrope positions): split after the embedding
        with _split_language_model(module, layout):
            out = module(input_ids=layout.input_ids, attention_mask=dummy, position_ids=layout.position_ids,
                         use_cache=False, **layout.vision).logits
    else:
        out = module(input_ids=layout.shard(layout.input_ids), attention_mask=dummy,
                     position_ids=layout.shard(layout.position_ids), use_cache=False, **{LAYOUT_KWARG: layout}).logits
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
    layout = sequence_layout(micro, remove_padding, group)
    outputs = _token_outputs(module, layout, kind, sampling, entropy)
    flat = layout.flat.flatten()
    kept = flat >= 0
    result = {}
    for name, full in outputs.items():  # back to the (B, L) rectangle, 0 where no token was computed
        full = full.new_zeros(rows * width).index_copy(0, flat[kept], full.flatten()[kept]).view(rows, width)
        if kind == "score":
            result["token_scores"] = full
            continue
        prompt_len = width - _response_length(micro)
        result[name] = full[:, prompt_len - 1: width - 1]  # position t predicts/scores response token t
    return result
