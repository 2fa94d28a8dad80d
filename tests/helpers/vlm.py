"""A tiny random-init Qwen2.5-VL for tests (no downloads): the tiny-arith tokenizer plus Qwen's vision special
tokens, a PIL image processor with 14-pixel patches merged 2x2 (a 56x56 image is 4 image tokens), a 2-layer text
model (hidden 64, head_dim 32, mrope sections 4/6/6) and a 1-block vision tower, fp32.

``tiny_vlm()`` -> (model, processor); ``save_tiny_vlm(path)`` writes a model dir (config, weights, tokenizer,
``preprocessor_config.json``) that :class:`hybridflow.models.vlm.ImageTextProcessor` and the workers load.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import transformers

from hybridflow.models.vlm import IMAGE_PAD, VISION_END, VISION_START, ImageTextProcessor, ban_vision_tokens

ARITH = os.path.join(os.path.dirname(__file__), "..", "..", "hybridflow", "assets", "tiny-arith")


def tiny_tokenizer():
    """tiny-arith's tokenizer (494 ids) with the vision special tokens added (ids 494-497)."""
    tok = transformers.AutoTokenizer.from_pretrained(ARITH)
    tok.add_special_tokens({"additional_special_tokens": [VISION_START, VISION_END, IMAGE_PAD, "<|video_pad|>"]})
    return tok


def tiny_image_processor():
    """PIL Qwen2-VL image processor: 14-pixel patches, 2x2 merge, 28x28 to 112x112 pixels."""
    return transformers.Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 16, patch_size=14,
                                                 merge_size=2, temporal_patch_size=2)


def tiny_vlm_config(tok) -> transformers.Qwen2_5_VLConfig:
    ids = tok.convert_tokens_to_ids([VISION_START, VISION_END, IMAGE_PAD, "<|video_pad|>"])
    text = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[0])
    return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, vision_start_token_id=ids[0],
                                         vision_end_token_id=ids[1], image_token_id=ids[2], video_token_id=ids[3],
                                         tie_word_embeddings=True)


def tiny_vlm(seed: int = 0):
    """(a random fp32 eval-mode ``Qwen2_5_VLForConditionalGeneration``, its :class:`ImageTextProcessor`)."""
    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(tiny_vlm_config(tok)).float().eval()
    ban_vision_tokens(model)  # as load_vision_model does
    return model, ImageTextProcessor(tiny_image_processor(), tok)


def save_tiny_vlm(path: str, seed: int = 0) -> str:
    """Write :func:`tiny_vlm`'s model, tokenizer and image processor to the directory ``path``; returns it."""
    model, processor = tiny_vlm(seed)
    model.save_pretrained(path)
    processor.tokenizer.save_pretrained(path)
    processor.image_processor.save_pretrained(path)
    return path


def random_image(height: int, width: int, seed: int):
    """A random RGB PIL image of ``height`` x ``width``."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
