"""Building blocks of a tiny Qwen2.5-VL-architecture model (the shipped ``builtin:tiny-vlm``, tests).

* :func:`tiny_qwen2_5_vl_config`: a ``Qwen2_5_VLConfig`` for a model of about 1M parameters: a one-block vision
  tower (14-pixel patches, 2 x 2 spatial merge, heads of dim 32) feeding a small Qwen2 text model (heads of dim
  32, as vLLM's CPU attention needs ``head_dim >= 32``) with 3-D rope ("mrope") sections summing to half the head
  dim.
* :func:`tiny_image_processor`: the PIL-backend ``Qwen2VLImageProcessor`` bounded to a pixel range, so a 56 x 56
  image stays 56 x 56 (4 x 4 patches -> 4 image tokens).
* :func:`load_vlm_processor`: the processor of a saved model directory, built from its image processor and its
  tokenizer without the video part: transformers cannot build or save the full Qwen2.5-VL processor without
  torchvision (its video-processor type check), so a model directory carries ``preprocessor_config.json`` and
  the tokenizer files, and no ``processor_config.json``.

Qwen's vision special tokens are :data:`VISION_TOKENS`; a tokenizer that the processor uses must have them as
added special tokens (the processor looks ``<|image_pad|>`` up by name).
"""

from __future__ import annotations

import math
import os
from typing import Any

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)


def tiny_qwen2_5_vl_config(tokenizer: Any, *, hidden_size: int = 128, num_layers: int = 3,
                           vision_hidden_size: int = 64, vision_depth: int = 1, max_positions: int = 256) -> Any:
    """A fp32 ``Qwen2_5_VLConfig`` sized for CPU tests and the shipped tiny model.

    Text: ``hidden_size`` wide, ``num_layers`` layers, heads of dim 32 (``hidden_size // 32`` query heads, half
    as many key/value heads), MLP 3x wide, tied embeddings, vocab ``len(tokenizer)`` padded up to a multiple of
    64, mrope sections ``[4, 6, 6]`` (temporal, height, width; sum 16 = head_dim / 2). Vision: ``vision_depth``
    full-attention blocks of width ``vision_hidden_size`` (heads of dim 32), patch 14, temporal patch 2, spatial
    merge 2, output width ``hidden_size``. Special-token ids are read from ``tokenizer``.

    Raises:
        ValueError: the tokenizer lacks one of :data:`VISION_TOKENS` or has no pad/bos/eos token.
    """
    from transformers import Qwen2_5_VLConfig

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    missing = [t for t, i in ids.items() if i is None or i == tokenizer.unk_token_id]
    if missing or None in (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id):
        raise ValueError(f"tokenizer lacks vision tokens {missing} or pad/bos/eos: add them as special tokens")
    heads = hidden_size // 32
    text = dict(
        vocab_size=64 * math.ceil(len(tokenizer) / 64), hidden_size=hidden_size, intermediate_size=3 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
        head_dim=32, max_position_embeddings=max_positions, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = dict(
        depth=vision_depth, hidden_size=vision_hidden_size, intermediate_size=2 * vision_hidden_size,
        num_heads=vision_hidden_size // 32, out_hidden_size=hidden_size, patch_size=14, spatial_merge_size=2,
        temporal_patch_size=2, window_size=56, fullatt_block_indexes=list(range(vision_depth)),
    )
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True, dtype="float32",
    )


def tiny_image_processor(min_pixels: int = 56 * 56, max_pixels: int = 112 * 112) -> Any:
    """The PIL-backend Qwen2-VL image processor with images resized into ``[min_pixels, max_pixels]`` (both in
    pixels; sides are rounded to multiples of 28 = patch 14 x merge 2)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
                                    patch_size=14, temporal_patch_size=2, merge_size=2)


def load_vlm_processor(model_dir: str | os.PathLike) -> Any:
    """The ``Qwen2_5_VLProcessor`` of ``model_dir`` (its saved image processor and tokenizer, no video processor).

    Raises:
        OSError: ``model_dir`` has no image processor or tokenizer files.
    """
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    return image_only_processor(image_processor, tokenizer)


def image_only_processor(image_processor: Any, tokenizer: Any) -> Any:
    """A ``Qwen2_5_VLProcessor`` over ``image_processor`` and ``tokenizer`` with no video processor (calling it
    with ``videos=`` fails); its chat template is the tokenizer's. Needs no torchvision."""
    return _image_only_class()(image_processor, tokenizer, chat_template=tokenizer.chat_template)


def _image_only_class() -> type:
    """The ``Qwen2_5_VLProcessor`` subclass whose sub-processors are the image processor and the tokenizer only
    (transformers derives a processor's parts from its ``__init__`` signature)."""
    from transformers import Qwen2_5_VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None):
            self.image_token = getattr(tokenizer, "image_token", None) or IMAGE_PAD
            self.video_token = getattr(tokenizer, "video_token", None) or VIDEO_PAD
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            self.video_processor = None
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return ImageOnlyQwen2_5_VLProcessor
