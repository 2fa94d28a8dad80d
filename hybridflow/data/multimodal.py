"""Image prompts for vision-language RL: parquet rows in verl's convention -> processed prompts -> ``DataProto``.

A row adds to :mod:`hybridflow.data.dataset`'s schema an ``images`` column: a list per row of ``{"bytes": b"..."}``
or ``{"path": "..."}`` (the Hugging Face datasets ``Image`` feature layout; a bare path str is accepted), and its
``prompt`` messages mark where each image goes: a user content string with ``<image>`` placeholders, or a list of
``{"type": "image"}`` / ``{"type": "text", "text": ...}`` parts. The chat template renders the text, then
:class:`hybridflow.models.vlm.ImageTextProcessor` (applied once, here) resizes the images, computes their patches
and expands each placeholder into the image's tokens.

``collate_multimodal`` gives ``collate_fn``'s batch plus: tensor ``mrope_position_ids`` (B, 3, P) long (the carried
3-D rope positions, :mod:`hybridflow.models.vlm`), non-tensor ``multi_modal_inputs`` (per row ``{"pixel_values":
(M_i, D) float32, "image_grid_thw": (N_i, 3) long}``) and ``multi_modal_data`` (per row ``{"image": [PIL.Image,
...]}`` at the processed size: exactly the pixels the trainer sees, for vLLM).

Bad images fail at load (before Ray), one line naming the file and row (:class:`ImageError`): unreadable, zero-size,
too many tokens for ``data.max_prompt_length``, or a placeholder count that differs from the images.
"""

from __future__ import annotations

import io
import os
from typing import Any, Optional, Sequence

import numpy as np
import torch

from hybridflow.data.dataset import RLHFDataset, collate_fn
from hybridflow.errors import DataError
from hybridflow.models.vlm import (DATA_KEY, IMAGE_PLACEHOLDER, INPUTS_KEY, MROPE_KEY, ImageTextProcessor,
                                   rope_positions)

__all__ = ["ImageError", "load_image", "MultimodalDataset", "collate_multimodal", "has_images", "vision_dataset"]


class ImageError(DataError):
    """An image a row cannot use; the message names the file (where known), the row and the image."""


def has_images(rows: Sequence[dict], image_key: str = "images") -> bool:
    """Whether any row has a non-empty ``image_key`` column."""
    return any(row.get(image_key) is not None and len(row.get(image_key)) for row in rows)


def load_image(entry: Any, where: str, row: Optional[int] = None) -> Any:
    """An RGB PIL image from an ``images`` entry (``{"bytes": ...}``, ``{"path": ...}`` or a path str).

    Raises:
        ImageError: unreadable or zero-size (``where`` names the image in the message; ``error.row`` is ``row``).
    """
    from PIL import Image

    try:
        if isinstance(entry, dict) and entry.get("bytes") is not None:
            image = Image.open(io.BytesIO(entry["bytes"]))
        else:
            path = entry.get("path") if isinstance(entry, dict) else entry
            if not isinstance(path, (str, os.PathLike)):
                raise ImageError(f"{where}: neither bytes nor a path: {type(entry).__name__}", row=row)
            image = Image.open(path)
        image.load()
    except ImageError:
        raise
    except Exception as exc:  # PIL raises several types for damaged or missing data
        raise ImageError(f"{where}: unreadable ({type(exc).__name__}: {exc})", row=row) from None
    if image.width == 0 or image.height == 0:
        raise ImageError(f"{where}: zero-size ({image.width}x{image.height})", row=row)
    return image.convert("RGB")


def _text_messages(prompt: Any) -> Any:
    """``prompt`` with list-of-parts contents flattened to strings (an image part becomes ``<image>``)."""
    if isinstance(prompt, np.ndarray):
        prompt = list(prompt)
    if not isinstance(prompt, (list, tuple)):
        return prompt
    messages = []
    for m in prompt:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, (list, tuple, np.ndarray)):
            content = "".join(IMAGE_PLACEHOLDER if part.get("type") == "image" else str(part.get("text", ""))
                              for part in content)
        messages.append({**m, "content": content} if isinstance(m, dict) else m)
    return messages


class MultimodalDataset(RLHFDataset):
    """:class:`~hybridflow.data.dataset.RLHFDataset` for image prompts (see the module docstring). ``source``
    (optional) names the rows' file in errors; ``error.row`` is the row index (the trainer maps it to its file).
    Over-long prompts always raise (``data.truncation`` does not apply: cutting an image's tokens is not
    meaningful). Items add ``multi_modal_inputs`` and ``multi_modal_data`` (shared, read-only).

    Raises:
        ImageError: a bad image, an over-long prompt (naming the row and its image tokens) or a placeholder/image
            count mismatch; DataError as ``RLHFDataset``.
    """

    def __init__(self, rows: Sequence[dict], processor: ImageTextProcessor, max_prompt_length: int,
                 prompt_key: str = "prompt", image_key: str = "images", source: str = "",
                 tools: Optional[Sequence[dict]] = None) -> None:
        texts = [{**row, prompt_key: _text_messages(row.get(prompt_key))} for row in rows]
        super().__init__(texts, processor.tokenizer, 10 ** 9, prompt_key, "error", tools)  # lengths checked below
        self.max_prompt_length = max_prompt_length
        self._inputs, self._data = [], []
        for i, (row, record) in enumerate(zip(rows, self._records)):
            where = f"image {{}} of {source}" if source else "image {}"
            entries = row.get(image_key)
            entries = [] if entries is None else list(entries)
            images = [load_image(e, where.format(j), row=i) for j, e in enumerate(entries)]
            try:
                out = processor.process(record["raw_prompt"], images)
            except ValueError as exc:
                raise ImageError(str(exc), row=i) from None
            if len(out.input_ids) > max_prompt_length:
                image_tokens = sum(int(g.prod()) // processor.merge_size ** 2 for g in out.image_grid_thw)
                raise ImageError(f"prompt has {len(out.input_ids)} tokens ({image_tokens} of them image "
                                 f"tokens) > data.max_prompt_length={max_prompt_length}; raise "
                                 "data.max_prompt_length or use smaller images", row=i)
            bos_id = processor.tokenizer.bos_token_id  # the no-template rule's prepended BOS, kept
            first = self._input_ids[i][:1].tolist()
            bos = first if first == [bos_id] and out.input_ids[:1] != [bos_id] else []
            self._input_ids[i] = torch.tensor(bos + out.input_ids, dtype=torch.long)
            self._inputs.append({"pixel_values": out.pixel_values, "image_grid_thw": out.image_grid_thw})
            self._data.append({"image": out.images})
        self.image_token_id = processor.image_token_id
        self.merge_size = processor.merge_size

    def __getitem__(self, i: int) -> dict:
        item = super().__getitem__(i)
        item[INPUTS_KEY], item[DATA_KEY] = self._inputs[i], self._data[i]  # shared, read-only
        return item


def collate_multimodal(features: Sequence[dict], pad_token_id: int, image_token_id: int, merge_size: int,
                       max_prompt_length: Optional[int] = None) -> Any:
    """``collate_fn`` plus the VLM columns (module docstring); ``image_token_id``/``merge_size`` from the
    processor. Returns a ``DataProto``."""
    batch = collate_fn(features, pad_token_id, max_prompt_length)
    inputs = [f[INPUTS_KEY] for f in features]
    grid = torch.cat([x["image_grid_thw"] for x in inputs])
    batch.batch[MROPE_KEY] = rope_positions(batch.batch["input_ids"], batch.batch["attention_mask"], grid,
                                            image_token_id, merge_size)
    for key in (INPUTS_KEY, DATA_KEY):
        column = np.empty(len(features), dtype=object)
        column[:] = [f[key] for f in features]
        batch.non_tensor_batch[key] = column
    return batch


def vision_dataset(rows: Sequence[dict], tokenizer: Any, model_path: str, max_prompt_length: int,
                   prompt_key: str = "prompt", tools: Optional[Sequence[dict]] = None) -> Optional[MultimodalDataset]:
    """The :class:`MultimodalDataset` of ``rows`` when the model at ``model_path`` is a VLM and a row has images;
    None otherwise (text rows for a text model: the caller's ``RLHFDataset``).

    Raises:
        ImageError: rows with images for a model that is not a vision-language model, or a bad image.
    """
    from hybridflow.models.vlm import is_vision_model_dir

    if not has_images(rows):
        return None
    if not is_vision_model_dir(model_path):
        first = next(i for i, row in enumerate(rows) if row.get("images") is not None and len(row["images"]))
        raise ImageError(f"has images but the model {model_path} is not a vision-language model "
                         "(qwen2_vl / qwen2_5_vl)", row=first)
    return MultimodalDataset(rows, ImageTextProcessor.from_pretrained(model_path, tokenizer), max_prompt_length,
                             prompt_key, tools=tools)
