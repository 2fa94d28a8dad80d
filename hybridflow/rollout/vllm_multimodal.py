"""Image prompts for the ``vllm`` rollout backend (Qwen2-VL / Qwen2.5-VL family), used by
:class:`hybridflow.rollout.vllm_rollout.VLLMRollout`.

Input (the data layer's contract): a prompt row's ``input_ids`` already hold each image's placeholder expanded to
its image tokens (``<|image_pad|>`` repeated ``t*h*w / merge**2`` times), and the non-tensor column
``multi_modal_data`` holds per row ``{"image": [PIL.Image, ...]}``: the images at the size the processor saw.

* :func:`image_requests`: vLLM takes a token prompt with *one* ``<|image_pad|>`` per image plus the images in
  ``multi_modal_data`` and expands each placeholder itself, so every run of image tokens is collapsed to one token
  (a run per image, in order; the row's image count must match).
* :func:`check_expansion`: after generation, each request's prompt as vLLM expanded it must equal the trainer's
  row token for token, otherwise the engine saw other image sizes than the trainer (a different resize) and its
  logprobs belong to another prompt: :class:`ImagePromptMismatchError`, never a silent mismatch.
* :func:`reset_encoder_cache`: vLLM caches the vision encoder's outputs per image; after an in-place weight load
  they are stale (they were computed with the old vision tower) and, reused, shift the logprobs silently (about
  0.09 on the tiny model), so every weight load resets this cache as well as the prefix cache.
* the carried 3-D rope positions ``mrope_position_ids`` (B, 3, P) are extended over the response as the hf rollout
  extends them (:func:`hybridflow.rollout.vision.add_rollout_positions`).

Shapes: B prompts, n samples per prompt, N = B*n rows, P prompt tokens, R response slots.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence


from hybridflow.errors import UserError
from hybridflow.models.vision_types import is_vision_model_dir

DATA_KEY = "multi_modal_data"  # non-tensor column: per row {"image": [PIL.Image, ...]}


class ImagePromptMismatchError(UserError, ValueError):
    """An image prompt whose image tokens do not match its images (count or expanded length)."""


def engine_multimodal_kwargs(model_path: str) -> dict:
    """Engine arguments a vision-language checkpoint at ``model_path`` needs (``{}`` for any other): its tokenizer
    (vLLM's multimodal processor cannot work without one, so ``skip_tokenizer_init`` is off) and no video
    inputs (``limit_mm_per_prompt``: the rollout sends images only, so no video memory is profiled)."""
    if not is_vision_model_dir(model_path):
        return {}
    return {"skip_tokenizer_init": False, "limit_mm_per_prompt": {"video": 0}}


def banned_logit_bias(llm: Any) -> Optional[dict[int, float]]:
    """``SamplingParams.logit_bias`` that keeps the engine from emitting the vision special tokens, as the trainer's
    policy never does (:func:`hybridflow.models.vlm.ban_vision_tokens`); None for a text-only model. vLLM clamps a
    bias to -100: their probability is then below e^-100 of the best token's, so the other tokens' processed logprobs
    equal the trainer's (whose banned logits are -1e4) to far below fp32 resolution."""
    from hybridflow.models.vlm import vision_token_ids

    ids = vision_token_ids(llm.llm_engine.vllm_config.model_config.hf_config)
    return {i: -100.0 for i in ids} or None


def image_token_id(llm: Any) -> Optional[int]:
    """The engine model's image placeholder id (``hf_config.image_token_id``), None for a text-only model."""
    config = llm.llm_engine.vllm_config.model_config.hf_config
    value = getattr(config, "image_token_id", None)
    return None if value is None else int(value)


def _collapse_runs(ids: Sequence[int], token: int) -> tuple[list[int], int]:
    """``ids`` with each run of ``token`` replaced by one ``token``, and the number of runs."""
    out: list[int] = []
    runs = 0
    for i, t in enumerate(ids):
        if t == token and i > 0 and ids[i - 1] == token:
            continue
        runs += t == token
        out.append(t)
    return out, runs


def image_requests(token_lists: list[list[int]], n: int, non_tensor: dict, image_token: Optional[int]) -> list:
    """vLLM token prompts, ``n`` per row of ``token_lists`` (the unpadded prompt ids), with the row's images.

    Rows without ``multi_modal_data`` (or with no image) are plain token prompts.

    Raises:
        ImagePromptMismatchError: a row with images whose ids hold another number of image-token runs, or images
            given to an engine whose model takes none.
    """
    from vllm.inputs import TokensPrompt

    column = non_tensor.get(DATA_KEY)
    requests = []
    for row, ids in enumerate(token_lists):
        images = list((column[row] or {}).get("image", [])) if column is not None else []
        if not images:
            requests.extend(TokensPrompt(prompt_token_ids=ids) for _ in range(n))
            continue
        if image_token is None:
            raise ImagePromptMismatchError(f"prompt row {row} has {len(images)} images but the vllm engine's model "
                                           "is not a vision-language model")
        short, runs = _collapse_runs(ids, image_token)
        if runs != len(images):
            raise ImagePromptMismatchError(f"prompt row {row} has {len(images)} images but {runs} runs of image "
                                           f"tokens (id {image_token}) in its input_ids")
        requests.extend(TokensPrompt(prompt_token_ids=short, multi_modal_data={"image": images}) for _ in range(n))
    return requests


def check_expansion(outputs: Sequence[Any], token_lists: list[list[int]], n: int) -> None:
    """Raise :class:`ImagePromptMismatchError` when vLLM's expanded prompt of a request differs from the trainer's
    ids of its row (request ``i`` is row ``i // n``)."""
    for i, output in enumerate(outputs):
        expected = token_lists[i // n]
        got = list(output.prompt_token_ids)
        if got != expected:
            raise ImagePromptMismatchError(
                f"prompt row {i // n}: vLLM expanded its image tokens to {len(got)} prompt tokens, the trainer has "
                f"{len(expected)}: the engine's image processor resized the image differently; pass the images "
                "at the processed size (multi_modal_data)")


def reset_encoder_cache(llm: Any) -> None:
    """Drop vLLM's cached vision-encoder outputs (stale after a weight load; see the module docstring)."""
    llm.llm_engine.reset_encoder_cache()


def has_images(non_tensor: dict) -> bool:
    """Whether a batch's non-tensor columns carry images for any row."""
    column = non_tensor.get(DATA_KEY)
    return column is not None and any((row or {}).get("image") for row in column)
