"""A lean decoding forward for Llama-family causal LMs, used by the ``hf`` rollout in place of transformers' forward.

On CPU a decode step of a small model is mostly per-operator cost, not arithmetic: at the tiny-arith shape (16 rows,
4 layers, hidden 128, fp32, one thread) transformers' ``LlamaForCausalLM`` forward took 2.9 ms per step, of which
the matrix products were ~0.6 ms (torch.profiler: 174 ``aten::mm`` in 5 steps, the rest mask building, cache
bookkeeping, rotary, RMSNorm's six ops, output wrappers). :class:`LeanDecoder` runs the same layers with fewer
operators and owns its KV cache:

- RMSNorm through ``torch.nn.functional.rms_norm`` on fp32 (bit-equal to the module's pow/mean/rsqrt/mul here),
  times the weight in the input dtype, as the module does;
- rotary embedding as ``x * cos + roll(x, D/2) * sin'`` with ``sin' = (-sin_1, sin_2)`` (``roll`` is
  ``rotate_half`` up to that sign), cos/sin computed once per step by the model's own ``rotary_emb`` (so every
  rope type transformers implements is honoured);
- a (N, H_kv, capacity, D) cache per layer written in place, and one boolean mask per step shared by all layers;
- the output head on the last position only.

Queries, keys and values still come from the model's own ``q_proj``/``k_proj``/``v_proj`` modules (so LoRA and
int8 wrappers work), attention is ``scaled_dot_product_attention`` with the module's ``scaling`` and grouped-query
heads (``enable_gqa``). Logits agree with transformers' forward to fp32 rounding
(``tests/rollout/test_fast_decode.py``).

Supported: ``model_type`` llama, mistral, qwen2, qwen3 (q/k norms) and the mixture-of-experts qwen2_moe, qwen3_moe,
mixtral, with full attention in every layer (no sliding window) and ``pretraining_tp`` 1; :func:`lean_decoder` returns
None for anything else and the caller keeps transformers' forward. An MoE layer's MLP is the model's own sparse block
(router and experts, so routing record and replay hooks see every forward,
:mod:`hybridflow.rollout.routing_record`); for an MoE model the prompt forward runs on every row (no sharing between
copies of a prompt), which is the layout the routing record expects.

Shape legend: N rows, L new tokens this step, T tokens cached after it, H / H_kv query / key-value heads, D head
dim, V vocabulary.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from hybridflow.models.moe import is_moe

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral")


def lean_decoder(module: torch.nn.Module) -> Optional["LeanDecoder"]:
    """A :class:`LeanDecoder` over ``module`` (a transformers causal LM), or None when its architecture is not one
    it reproduces exactly (then decode with ``module(...)``)."""
    config = getattr(module, "config", None)
    inner = getattr(module, "model", None)
    if config is None or inner is None or getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return None
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return None
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return None
    if getattr(config, "pretraining_tp", 1) != 1:
        return None
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if not all(hasattr(inner, name) for name in needed) or not hasattr(module, "lm_head"):
        return None
    if not all(_plain_layer(layer) for layer in inner.layers):
        return None
    return LeanDecoder(module)


def _plain_layer(layer: torch.nn.Module) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    return (attn is not None and mlp is not None
            and all(hasattr(attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim"))
            and (all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj")) or is_moe(mlp))
            and all(hasattr(getattr(layer, norm, None), "variance_epsilon")
                    for norm in ("input_layernorm", "post_attention_layernorm")))


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' ``*RMSNorm`` forward: normalize in fp32, cast back, times the weight."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon)
    return norm.weight * normed.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for x (N, L, heads, D); ``sin_signed`` is sin with its first half
    negated, so ``rotate_half(x) * sin == roll(x, D/2) * sin_signed``."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


def _grouped_copies(copies: int, *tables: torch.Tensor) -> bool:
    """Whether every (N, L) table's rows are groups of ``copies`` identical consecutive rows."""
    if copies <= 1:
        return False
    grouped = [table.view(-1, copies, table.shape[-1]) for table in tables]
    return all(bool((table == table[:, :1]).all()) for table in grouped)


class LeanDecoder:
    """Decode with a Llama-family model's weights (see the module docstring). :meth:`start` allocates the cache for
    a micro-batch, then each :meth:`step` appends L tokens and returns the last position's logits.

    Args:
        module: the causal LM (``model``, ``lm_head``); used in place and never modified.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.inner = module.model
        self.layers = list(self.inner.layers)
        attn = self.layers[0].self_attn
        self.head_dim = int(attn.head_dim)
        self.qk_norm = hasattr(attn, "q_norm") and hasattr(attn, "k_norm")
        self.copies = 1
        self.moe = is_moe(module)  # MoE: no shared prompt forward (the routing record needs every row's)
        # per layer (N, H_kv, capacity, D), allocated by the prompt step (H_kv: this rank's heads under tp)
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._valid = torch.empty(0, 0, dtype=torch.bool)
        self._filled = 0

    def start(self, attention_mask: torch.Tensor, capacity: int, copies: int = 1) -> None:
        """Begin a micro-batch whose prompts have ``attention_mask`` (N, P) (0 on left padding) and whose prompt +
        response take at most ``capacity`` tokens. ``copies``: the rows come in groups of that many copies of one
        prompt (the rollout's n samples); the first :meth:`step` then runs the prompt forward once per group and
        copies its keys and values (when the rows it is given are indeed such copies). Raises ValueError if
        ``capacity`` < P."""
        rows, prompt_len = attention_mask.shape
        if capacity < prompt_len:
            raise ValueError(f"LeanDecoder capacity {capacity} is below the prompt length {prompt_len}")
        self.copies = copies if copies > 1 and rows % copies == 0 and not self.moe else 1
        self._keys, self._values = [], []
        self._valid = torch.ones((rows, capacity), dtype=torch.bool, device=attention_mask.device)
        self._valid[:, :prompt_len] = attention_mask.bool()
        self._filled = 0

    def release(self) -> None:
        """Free the cache."""
        self._keys, self._values, self._filled = [], [], 0

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Append ``input_ids`` (N, L) at ``position_ids`` (N, L) (the prompt at the first step, then one token per
        row); returns the logits (N, V) float32 of the last position. Raises ValueError past the capacity."""
        start, length = self._filled, input_ids.shape[1]
        end = start + length
        if end > self._valid.shape[1] or (start == 0) == bool(self._keys):
            raise ValueError(f"LeanDecoder: {end} tokens exceed the cache capacity {self._valid.shape[1]}, or the "
                             "micro-batch was not started (start() before the first step)")
        copies = self.copies if start == 0 and _grouped_copies(self.copies, input_ids, position_ids, self._valid) else 1
        if copies > 1:  # the prompt forward once per group of identical rows
            input_ids, position_ids = input_ids[::copies], position_ids[::copies]
        x = self.inner.embed_tokens(input_ids)
        cos, sin = self.inner.rotary_emb(x, position_ids)
        half = cos.shape[-1] // 2
        cos, sin_signed = cos.unsqueeze(2), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(2)
        mask = self._mask(start, end, copies)
        for index, layer in enumerate(self.layers):
            x = self._layer(layer, x, cos, sin_signed, mask, index, start, end, copies)
        self._filled = end
        last = _rms_norm(self.inner.norm, x[:, -1:])
        logits = self.module.lm_head(last)[:, -1].float()
        return logits.repeat_interleave(copies, dim=0) if copies > 1 else logits

    def _mask(self, start: int, end: int, copies: int) -> torch.Tensor:
        """(N, 1, L, T) bool (N / ``copies`` rows): query i (position start + i) sees cached keys j <= start + i
        that are valid, and always itself (a left-padding query then attends to itself alone instead of to
        nothing, which would make its output NaN; valid queries never read it)."""
        valid = self._valid[::copies, :end]
        if end - start == 1:
            return valid[:, None, None, :]
        queries = torch.arange(start, end, device=valid.device)[:, None]
        keys = torch.arange(end, device=valid.device)[None, :]
        return ((keys <= queries) & (valid[:, None, :] | (keys == queries)))[:, None]

    def _layer(self, layer: Any, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, mask: torch.Tensor,
               index: int, start: int, end: int, copies: int) -> torch.Tensor:
        """One decoder layer on x (N, L, hidden): attention over the cache (the prompt step: over its own keys,
        which go into the cache ``copies`` times each), then the gated MLP (``down(act(gate(h)) * up(h))``; an MoE
        layer: its sparse block's own forward), each with its residual."""
        rows, length, _ = x.shape
        attn, mlp = layer.self_attn, layer.mlp
        h = _rms_norm(layer.input_layernorm, x)
        q = attn.q_proj(h).view(rows, length, -1, self.head_dim)
        k = attn.k_proj(h).view(rows, length, -1, self.head_dim)
        v = attn.v_proj(h).view(rows, length, -1, self.head_dim)
        if self.qk_norm:
            q, k = _rms_norm(attn.q_norm, q), _rms_norm(attn.k_norm, k)
        k, v = _rotate(k, cos, sin_signed).transpose(1, 2), v.transpose(1, 2)
        if start == 0:  # the prompt attends to its own keys; the cache holds each prompt's copies
            shape = (len(self._valid), k.shape[1], self._valid.shape[1], self.head_dim)
            keys, values = k.new_empty(shape), v.new_empty(shape)
            self._keys.append(keys)
            self._values.append(values)
            keys[:, :, :end] = k.repeat_interleave(copies, dim=0) if copies > 1 else k
            values[:, :, :end] = v.repeat_interleave(copies, dim=0) if copies > 1 else v
        else:
            keys, values = self._keys[index], self._values[index]
            keys[:, :, start:end], values[:, :, start:end] = k, v
            k, v = keys[:, :, :end], values[:, :, :end]
        out = F.scaled_dot_product_attention(_rotate(q, cos, sin_signed).transpose(1, 2), k, v, attn_mask=mask,
                                             scale=attn.scaling, enable_gqa=q.shape[2] != k.shape[1])
        x = x + attn.o_proj(out.transpose(1, 2).reshape(rows, length, -1))
        h = _rms_norm(layer.post_attention_layernorm, x)
        if not hasattr(mlp, "gate_proj"):  # an MoE block (router + experts)
            return x + mlp(h)
        return x + mlp.down_proj(mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h))
