"""Vision-language models (the Qwen2-VL / Qwen2.5-VL family): the image + text processor, the 3-D rope ("mrope")
positions, the forward kwargs of a training micro-batch, the image-less-rank dummy vision forward and vision tower
freezing.

Carried mrope positions (computed once, in the data layer, never recomputed with other inputs): the ``DataProto``
tensor ``mrope_position_ids`` (B, 3, L) long holds, per row and column, the (temporal, height, width) rope position
of the token: text tokens have the same value on the 3 axes, image tokens their grid coordinates offset by the text
before them (:func:`rope_positions`; padding 0). ``position_ids`` (B, L) stays the 1-D text position
(``cumsum(attention_mask) - 1``). A rollout extends both over the response (:func:`extend_rope_positions`: response
tokens are text, so their mrope position is their text position plus the row's rope delta). A padded forward gets
``position_ids = mrope.transpose(0, 1)`` (3, B, L); a packed one the 4-row (4, 1, T) stack ``[text; t; h; w]`` with
``use_cache=False`` (the text row confines attention to each sequence; :func:`forward_kwargs`).

Per-row vision inputs: the non-tensor column ``multi_modal_inputs`` holds per row a dict ``{"pixel_values":
(patches_i, C*tp*p*p) float32, "image_grid_thw": (images_i, 3) long}``; a micro-batch's are concatenated in row
order (:func:`hybridflow.protocol_rows.cat_row_tensors`), the order of the image tokens in ``input_ids``.

Without torchvision transformers cannot build the Qwen2.5-VL processor (its video-processor check), so
:class:`ImageTextProcessor` is the image processor + tokenizer saved separately, with the placeholder expansion done
here. Shapes: B rows, L tokens, T packed tokens, N images, M patches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from hybridflow.errors import UserError
from hybridflow.models.vision_types import VISION_MODEL_TYPES, is_vision_model_dir  # noqa: F401 (re-exported)

IMAGE_PLACEHOLDER = "<image>"  # verl's placeholder in a user message's content string
VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"
MROPE_KEY = "mrope_position_ids"
INPUTS_KEY = "multi_modal_inputs"
DATA_KEY = "multi_modal_data"


class VisionModelError(UserError):
    """A vision-language model used where it is not supported (e.g. the megatron strategy)."""


def is_vision_config(config: Any) -> bool:
    """Whether a transformers config (or its ``model_type``) is a supported vision-language model."""
    return getattr(config, "model_type", None) in VISION_MODEL_TYPES


def refuse_vision_model(path: str, engine: str, role: str) -> None:
    """For an engine without VLM support (``engine`` its name, e.g. megatron): raises VisionModelError, one line,
    when the model at ``path`` is a VLM."""
    if is_vision_model_dir(path):
        raise VisionModelError(f"{role}: {path} is a vision-language model; strategy {engine} does not support VLMs "
                               "(use strategy=fsdp2)")


def load_vision_model(path: str, dtype: torch.dtype, value_head: bool = False,
                      trust_remote_code: bool = False) -> torch.nn.Module:
    """A VLM (``AutoModelForImageTextToText``) from a local directory, in ``dtype``, on CPU. ``value_head``: the
    output head replaced by a fresh scalar head (N(0, initializer_range) weights, no bias; untied from the
    embeddings), so ``logits`` are (B, L, 1): the critic."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    if value_head:
        text = model.config.get_text_config()
        head = torch.nn.Linear(text.hidden_size, 1, bias=False, dtype=dtype)
        torch.nn.init.normal_(head.weight, std=getattr(text, "initializer_range", 0.02))
        model.lm_head = head
        model.config.tie_word_embeddings = False
        text.tie_word_embeddings = False
        model._tied_weights_keys = {}  # noqa: SLF001 (transformers would re-tie the scalar head to the embeddings)
    else:
        ban_vision_tokens(model)
    return model


def vision_model_from_config(config: Any, dtype: torch.dtype, tp_size: int = 1) -> torch.nn.Module:
    """The VLM of ``config`` (the current default device, e.g. ``meta``) with the vision special tokens banned, for
    the 3D-HybridEngine's generation model; its parameter names are the trainer's, the vision tower's included, so
    every weight sync covers the tower.

    Raises:
        VisionModelError: ``tp_size`` > 1 (no tensor-parallel generation plan for VLMs).
    """
    from transformers import AutoModelForImageTextToText

    if tp_size > 1:
        raise VisionModelError(f"rollout.tensor_model_parallel_size={tp_size}: the hf rollout has no tensor-parallel "
                               "plan for vision-language models; use 1")
    model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    ban_vision_tokens(model)
    return model


#: the logit given to banned tokens: probability exactly 0 in fp32/bf16 softmax (also after a temperature of 0.01),
#: while entropy's p * logit stays 0 (a -inf logit would make it NaN)
BANNED_LOGIT = -1e4


def vision_token_ids(config: Any) -> list[int]:
    """The sorted ids of a VLM config's vision special tokens (image/video pads, vision start/end) that a policy
    never emits (:func:`ban_vision_tokens`); ``[]`` for a text model's config."""
    keys = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return sorted({int(getattr(config, key)) for key in keys if getattr(config, key, None) is not None})


def ban_vision_tokens(model: torch.nn.Module) -> list[int]:
    """Make the policy never emit the vision special tokens (image/video pads, vision start/end): a forward hook
    on the output head sets their logits to :data:`BANNED_LOGIT`. A generated ``<|image_pad|>`` would be taken as
    an image placeholder by the next forward (placeholders and image features would no longer match), so the
    policy is defined without them, in the trainer and in the ``hf`` rollout alike (both load through
    :func:`load_vision_model`: their logprobs agree). A vLLM rollout must ban the same ids. Returns the ids."""
    ids = vision_token_ids(model.config)

    def hook(_module: torch.nn.Module, _inputs: tuple, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_fill(-1, torch.tensor(ids, dtype=torch.long, device=logits.device), BANNED_LOGIT)

    model.lm_head.register_forward_hook(hook)
    return ids


@dataclass
class Processed:
    """One prompt processed: ``input_ids`` list of ints (image pads expanded), ``pixel_values`` (M, D) float32,
    ``image_grid_thw`` (N, 3) long, ``images`` the N PIL images at the processed size (what vLLM must see)."""

    input_ids: list
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    images: list


class ImageTextProcessor:
    """Image processor + tokenizer of a Qwen2-VL-family model dir (no video processor, no torchvision).

    ``process(text, images)``: each ``<image>`` (or an unexpanded ``<|vision_start|><|image_pad|><|vision_end|>``)
    in ``text`` becomes ``<|vision_start|>`` + ``<|image_pad|>`` x (grid tokens) + ``<|vision_end|>``; images are
    first resized to the processor's target size so the pixels the trainer sees are those of the returned images.
    """

    def __init__(self, image_processor: Any, tokenizer: Any) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.merge_size = int(image_processor.merge_size)
        self.patch_size = int(image_processor.patch_size)
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)

    @classmethod
    def from_pretrained(cls, path: str, tokenizer: Any = None) -> "ImageTextProcessor":
        from transformers import AutoImageProcessor, AutoTokenizer

        from hybridflow.models.builtin import resolve_model_path

        path = resolve_model_path(str(path))  # builtin:NAME or a hub id -> its directory
        tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(path)
        return cls(AutoImageProcessor.from_pretrained(path), tokenizer)

    def target_size(self, image: Any) -> tuple[int, int]:
        """(height, width) the image processor resizes ``image`` to (multiples of patch x merge)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        size = self.image_processor.size
        factor = self.patch_size * self.merge_size
        return smart_resize(image.height, image.width, factor=factor, min_pixels=size["shortest_edge"],
                            max_pixels=size["longest_edge"])

    def process(self, text: str, images: Sequence[Any]) -> Processed:
        """Expand ``text``'s placeholders for ``images`` (PIL, RGB) and tokenize (no special tokens added)."""
        from PIL import Image

        resized = []
        for image in images:
            h, w = self.target_size(image)
            resized.append(image if image.size == (w, h) else image.resize((w, h), Image.Resampling.BICUBIC))
        if resized:
            out = self.image_processor(images=resized, return_tensors="pt")
            pixels, grid = out["pixel_values"].float(), out["image_grid_thw"].long()
        else:
            dim = 3 * int(self.image_processor.temporal_patch_size) * self.patch_size ** 2
            pixels, grid = torch.zeros(0, dim), torch.zeros(0, 3, dtype=torch.long)
        text = text.replace(f"{VISION_START}{IMAGE_PAD}{VISION_END}", IMAGE_PLACEHOLDER)
        parts = text.split(IMAGE_PLACEHOLDER)
        if len(parts) - 1 != len(resized):
            raise ValueError(f"{len(parts) - 1} image placeholders for {len(resized)} images")
        pieces = [parts[0]]
        for thw, part in zip(grid.tolist(), parts[1:]):
            count = thw[0] * thw[1] * thw[2] // self.merge_size ** 2
            pieces += [VISION_START + IMAGE_PAD * count + VISION_END, part]
        ids = self.tokenizer("".join(pieces), add_special_tokens=False)["input_ids"]
        return Processed(list(ids), pixels, grid, resized)


def rope_positions(input_ids: torch.Tensor, attention_mask: torch.Tensor, image_grid_thw: torch.Tensor,
                   image_token_id: int, merge_size: int) -> torch.Tensor:
    """The mrope positions (B, 3, L) long of left- or right-padded rows ``input_ids``/``attention_mask`` (B, L)
    whose images (in row order) have grids ``image_grid_thw`` (N, 3) (t, h, w in patches). Per row, over its real
    tokens: a text token's 3 positions are ``p, p, p`` then p += 1; an image's g_t x (g_h/m) x (g_w/m) tokens get
    ``p + (t, i, j)`` and then p += max(g_h/m, g_w/m) (Qwen2-VL, Wang et al. 2024, sec. 2.1 "M-RoPE"; still images,
    g_t = 1).
    Padding gets 0.

    Raises:
        ValueError: the image tokens of the batch do not match ``image_grid_thw``.
    """
    rows, width = input_ids.shape
    out = torch.zeros(rows, 3, width, dtype=torch.long)
    grids = iter(image_grid_thw.tolist())
    for b in range(rows):
        cols = attention_mask[b].bool().nonzero().flatten()
        is_image = (input_ids[b, cols] == image_token_id).tolist()
        pos, k, axes = 0, 0, []
        while k < len(is_image):
            if not is_image[k]:
                axes.append(torch.full((3, 1), pos))
                pos, k = pos + 1, k + 1
                continue
            try:
                t, h, w = next(grids)
            except StopIteration:
                raise ValueError(f"row {b}: more image token runs than image_grid_thw entries") from None
            h, w = h // merge_size, w // merge_size
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
            axes.append(torch.stack([tt.flatten(), hh.flatten(), ww.flatten()]) + pos)
            pos, k = pos + max(h, w), k + t * h * w
        if axes:
            out[b][:, cols] = torch.cat(axes, dim=1)[:, : len(cols)]
    if next(grids, None) is not None:
        raise ValueError("image_grid_thw has more images than the rows' image tokens")
    return out


def extend_rope_positions(prompt_mrope: torch.Tensor, prompt_positions: torch.Tensor,
                          positions: torch.Tensor) -> torch.Tensor:
    """The mrope positions (B, 3, P+R) of prompts (B, 3, P) extended over text responses: ``positions`` (B, P+R)
    are the 1-D text positions of the whole rows, ``prompt_positions`` (B, P) the prompts'; a response token's mrope
    position is its text position + the row's rope delta (last prompt token's mrope minus its text position; left
    padding, so the last prompt column is a real token)."""
    delta = prompt_mrope[:, 0, -1] - prompt_positions[:, -1]  # (B,)
    width = prompt_mrope.shape[-1]
    response = (positions[:, width:] + delta[:, None])[:, None, :].expand(-1, 3, -1)
    return torch.cat([prompt_mrope, response], dim=-1)


def vision_inputs(micro: Any, device: torch.device) -> dict:
    """``pixel_values`` (M, D) and ``image_grid_thw`` (N, 3) of a micro-batch's rows (concatenated in row order),
    or ``{}`` when its rows have no image."""
    from hybridflow.protocol_rows import cat_row_tensors

    column = micro.non_tensor_batch.get(INPUTS_KEY)
    if column is None:
        return {}
    cat = cat_row_tensors(column, ("pixel_values", "image_grid_thw"))
    if cat["image_grid_thw"].shape[0] == 0:
        return {}
    return {k: v.to(device) for k, v in cat.items()}


def forward_kwargs(micro: Any, first: int = 0, end: int | None = None,
                   flat_index: torch.Tensor | None = None) -> dict:
    """The VLM kwargs of a training forward over ``micro`` (empty for a text model's batch, without
    ``mrope_position_ids``): the vision inputs and the carried positions, as ``position_ids`` (3, B, end-first) of
    the padded columns ``[first, end)``, or, packed (``flat_index`` (T,): the kept tokens of the flattened (B*L,)
    rows), the (4, 1, T) rows ``[text; t; h; w]``."""
    batch = micro.batch
    if MROPE_KEY not in batch.keys():
        return {}
    mrope = batch[MROPE_KEY]
    kwargs = vision_inputs(micro, mrope.device)
    if flat_index is None:
        kwargs["position_ids"] = mrope[..., first:end].transpose(0, 1)
    else:
        text = batch["position_ids"].flatten()[flat_index][None]
        axes = mrope.transpose(0, 1).reshape(3, -1)[:, flat_index]
        kwargs["position_ids"] = torch.cat([text, axes])[:, None, :]
    return kwargs


def _language_model(module: torch.nn.Module) -> torch.nn.Module | None:
    """The decoder of a VLM module (a ``...ForConditionalGeneration``, a value/score model on it, or LoRA-wrapped)."""
    for name, sub in module.named_modules():
        if name.endswith("language_model") and hasattr(sub, "layers"):
            return sub
    return None


def _visual(module: torch.nn.Module) -> torch.nn.Module | None:
    for name, sub in module.named_modules():
        if name.endswith("visual") and hasattr(sub, "blocks"):
            return sub
    return None


def install_dummy_vision(module: torch.nn.Module) -> bool:
    """Make forwards without images still run the vision tower (FSDP2 shards it: every rank must gather/reduce
    its blocks in the same order, else a rank whose micro-batch has no image deadlocks the others): a forward
    pre-hook on the language model, run first, that feeds the tower one 1x2x2-patch dummy image when the call
    got no image, and adds 0 x its output sum to ``inputs_embeds`` (in the graph, zero contribution: the tower's
    gradients are exactly 0 from it). Returns False for a module without a vision tower. Idempotent."""
    language, visual = _language_model(module), _visual(module)
    if language is None or visual is None or getattr(language, "_hybridflow_dummy_vision", False):
        return language is not None and visual is not None
    state = {"images": False}

    def mark(_mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:  # the VLM's forward: did it get images?
        state["images"] = kwargs.get("pixel_values") is not None

    def pre(_mod: torch.nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        if state["images"] or kwargs.get("inputs_embeds") is None:
            return None
        embeds = kwargs["inputs_embeds"]
        config = visual.config
        dim = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
        pixels = torch.zeros(4, dim, dtype=embeds.dtype, device=embeds.device)
        grid = torch.tensor([[1, 2, 2]], device=embeds.device)
        out = visual(pixels, grid_thw=grid)
        features = out.pooler_output if hasattr(out, "pooler_output") else out
        features = torch.cat(list(features)) if isinstance(features, (list, tuple)) else features
        kwargs["inputs_embeds"] = embeds + 0.0 * features.sum().to(embeds.dtype)
        return args, kwargs

    outer = next(sub for name, sub in module.named_modules() if hasattr(sub, "language_model") and
                 getattr(sub, "language_model") is language)
    outer.register_forward_pre_hook(mark, with_kwargs=True, prepend=True)
    language.register_forward_pre_hook(pre, with_kwargs=True, prepend=True)
    language._hybridflow_dummy_vision = True
    return True


def freeze_vision_tower(module: torch.nn.Module) -> int:
    """``requires_grad_(False)`` on the vision tower (``actor_rollout_ref.model.freeze_vision_tower``); returns
    how many parameters were frozen (0 for a text model)."""
    visual = _visual(module)
    if visual is None:
        return 0
    params = list(visual.parameters())
    for p in params:
        p.requires_grad_(False)
    return len(params)
