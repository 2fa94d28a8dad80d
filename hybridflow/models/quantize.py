"""Weight-only int8 quantization of ``nn.Linear`` layers, for a generator's copy of the policy weights.

LlamaRL (Meta 2025, arXiv 2505.24034) lets the generators run a lower-precision copy of the policy; the
log-probability gap to the full-precision policy that this opens is then one more part of the off-policy gap
that AIPO's importance weights (or truncated importance sampling) correct, because the generator records the
log-probs it actually sampled with.

Scheme: symmetric, per output channel. For a weight ``W`` of shape ``(out, in)`` (``out``: output features,
``in``: input features), row ``i`` gets the fp32 scale ``s_i = max_j |W_ij| / 127`` (``s_i = 1`` for an
all-zero row) and the int8 values ``q_ij = round(W_ij / s_i)`` in ``[-127, 127]``; the layer computes with
``W'_ij = q_ij * s_i``. Rounding to the nearest integer gives ``|W_ij - W'_ij| <= s_i / 2`` (no value is
clipped, since ``|W_ij / s_i| <= 127``). Storage is one byte per weight plus one fp32 per row (about a quarter
of fp32, half of bf16).

No speedup is claimed: :class:`Int8Linear` dequantizes the whole weight to the input's dtype on every forward
(there is no int8 matmul kernel here), so on CPU it is slower than the plain layer; it saves memory only.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterable, Sequence
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

INT8_MAX = 127  # symmetric range [-127, 127]; -128 is never used


def _quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: int8 ``(out, in)`` and fp32 ``(out,)`` with ``weight ~= q * scale[:, None]``."""
    w = weight.detach().float()
    if not torch.isfinite(w).all():
        raise ValueError(f"cannot quantize a weight of shape {tuple(weight.shape)} holding NaN or inf values")
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))  # an all-zero row: q = 0, any scale
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """A linear layer ``y = x W'^T + b`` whose weight is stored as int8 with one fp32 scale per output row.

    Inference only: ``qweight`` (int8 ``(out, in)``), ``scale`` (fp32 ``(out,)``) and ``bias`` (``(out,)`` in
    the dtype of the layer it replaced, or None) are buffers, not parameters. ``forward`` takes ``x`` of shape
    ``(..., in)`` in any floating dtype and returns ``(..., out)`` in that dtype, computing with
    ``W' = qweight * scale[:, None]`` cast to ``x.dtype``. Cast the model to its final dtype before quantizing:
    ``module.to(dtype)`` would cast ``scale`` too.

    Args:
        in_features: ``in``.
        out_features: ``out``.
        bias: whether the layer has a bias.
        device: device of the buffers.
        dtype: dtype of the bias.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: Optional[torch.device] = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        """A quantized copy of ``linear`` (same device; the bias keeps its dtype). ``linear`` is not changed."""
        weight = linear.weight
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, weight.device, weight.dtype)
        layer.load_weight(weight)
        if linear.bias is not None:
            with torch.no_grad():
                layer.bias.copy_(linear.bias)
        return layer

    @torch.no_grad()
    def load_weight(self, weight: torch.Tensor) -> None:
        """Re-quantize from a full-precision weight ``(out, in)`` of any floating dtype, in place.

        Called when the trainer pushes new weights; ``qweight`` and ``scale`` keep their storage and device.

        Raises:
            ValueError: ``weight`` has another shape, or holds NaN/inf.
        """
        if tuple(weight.shape) != tuple(self.qweight.shape):
            raise ValueError(f"Int8Linear.load_weight: expected a weight of shape {tuple(self.qweight.shape)} "
                             f"(out_features, in_features), got {tuple(weight.shape)}")
        q, scale = _quantize_per_channel(weight.to(self.qweight.device))
        self.qweight.copy_(q)
        self.scale.copy_(scale)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the layer computes with, ``qweight * scale[:, None]``, as ``(out, in)`` in ``dtype``."""
        return self.qweight.to(dtype) * self.scale[:, None].to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _is_skipped(name: str, skip: Sequence[str]) -> bool:
    return any(name == s or name.endswith("." + s) for s in skip)


def quantize_linear_layers(model: nn.Module, skip: Sequence[str] = ("lm_head",)) -> list[str]:
    """Replace the ``nn.Linear`` layers of ``model`` by :class:`Int8Linear` copies, in place.

    Only modules whose type is exactly ``nn.Linear`` are replaced; subclasses (which may carry behaviour
    of their own, or be read through ``.weight``) are left alone.

    A layer is skipped when its qualified name equals an entry of ``skip`` or ends with ``"." + entry``
    (``"lm_head"`` matches ``lm_head`` and ``model.lm_head``). A layer whose weight is shared with another
    parameter (tied, e.g. ``lm_head`` with ``tie_word_embeddings``) is always kept in full precision: a
    quantized copy would no longer follow the tied tensor when new weights arrive. Layers already quantized
    are left alone, so calling this twice is harmless.

    Args:
        model: any module, e.g. a Hugging Face causal LM.
        skip: names (or name suffixes) of layers to keep in full precision.

    Returns:
        Qualified names of the replaced layers, in module order.
    """
    names_of_param: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of_param.setdefault(id(param), []).append(name)
    replaced = []
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or not name or _is_skipped(name, skip):
            continue
        aliases = names_of_param.get(id(module.weight), [])
        if len(aliases) > 1:
            logger.info("quantize_linear_layers: %s keeps full precision; its weight is tied to %s", name,
                        ", ".join(a for a in aliases if a != f"{name}.weight"))
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8Linear.from_linear(module))
        replaced.append(name)
    return replaced


@torch.no_grad()
def load_weights_quantized(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy full-precision ``(name, tensor)`` pairs (Hugging Face names) into a model quantized in place.

    ``"x.y.weight"`` where module ``x.y`` is an :class:`Int8Linear` re-quantizes that layer
    (:meth:`Int8Linear.load_weight`); any other name is copied (``copy_``, cast to the target's dtype and
    device) into the parameter or buffer of that name. Tied parameters share one tensor, and the model's own
    names include every alias (``lm_head.weight`` as well as ``model.embed_tokens.weight`` for a Llama with
    ``tie_word_embeddings``), so a tensor sent under either name updates both, and sending both is harmless.
    ``named_tensors`` may be a generator and may cover part of the model.

    Raises:
        KeyError: a name the model does not have (the message lists close names).
        ValueError: a tensor whose shape differs from its target's, or (for an :class:`Int8Linear` weight)
            that holds NaN/inf.
    """
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, Int8Linear)}
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(model.named_buffers(remove_duplicate=False))
    for name, tensor in named_tensors:
        module_name, _, leaf = name.rpartition(".")
        if leaf == "weight" and module_name in quantized:
            quantized[module_name].load_weight(tensor)
            continue
        target = targets.get(name)
        if target is None:
            close = difflib.get_close_matches(name, list(targets) + [f"{m}.weight" for m in quantized], n=3)
            raise KeyError(f"load_weights_quantized: model has no parameter {name!r}; close names: {close}")
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"load_weights_quantized: {name!r} has shape {tuple(target.shape)}, "
                             f"got {tuple(tensor.shape)}")
        target.copy_(tensor)
