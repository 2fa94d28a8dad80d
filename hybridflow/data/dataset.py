"""Prompt dataset for RL: parquet rows in verl's schema -> tokenized prompts -> left-padded ``DataProto`` batches.

A row (one parquet record, or one dict) looks like::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "What is 2 + 3?"}],   # or a plain str
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "5"},
     "extra_info": {"split": "train", "index": 0}}

Prompt text rule (``RLHFDataset``):

* ``prompt`` is a list of messages and ``tokenizer.chat_template`` is set:
  ``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)``; the text is
  tokenized with ``add_special_tokens=False`` (the template already placed any BOS / role tokens).
* ``prompt`` is a list of messages and there is no chat template: the ``content`` fields joined with ``"\\n"``.
* ``prompt`` is a plain ``str``: used as is.
* In the last two cases the text is tokenized with ``add_special_tokens=False`` and the tokenizer's
  ``bos_token_id`` (if it has one) is prepended.

Pad token rule: this module never invents a pad token. ``collate_fn`` takes ``pad_token_id`` from the caller,
e.g. ``functools.partial(collate_fn, pad_token_id=tokenizer.pad_token_id, max_prompt_length=64)``.

Notation: ``B`` batch (prompts), ``P`` the longest prompt in the batch (tokens).
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any, Optional, Sequence, Union

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset

from hybridflow.errors import DataError
from hybridflow.protocol import DataProto

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left", "right", "filter")

__all__ = ["first_rows", "load_rows", "RLHFDataset", "collate_fn", "compute_position_ids", "TRUNCATION_MODES"]

PathLike = Union[str, "os.PathLike[str]"]


def load_rows(files: Union[PathLike, Sequence[PathLike]], prompt_key: str = "prompt") -> list[dict]:
    """Read one parquet file or a list of them into a list of row dicts (in file order, then row order).

    Required columns: ``data_source``, ``prompt_key`` and ``reward_model``.

    Raises:
        ValueError: ``files`` is an empty list.
        DataError: a file is not parquet, lacks a required column (names the file and column) or has no rows (names
            the file).
        FileNotFoundError: a file does not exist (names the file).
    """
    paths = [files] if isinstance(files, (str, os.PathLike)) else list(files)
    if not paths:
        raise ValueError("no parquet files given")
    rows: list[dict] = []
    for path in paths:
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"parquet file not found: {path}")
        try:
            table = pq.read_table(path)
        except pa.ArrowException as exc:  # not parquet, or damaged
            raise DataError(f"{path} is not a readable parquet file ({type(exc).__name__}: {exc})") from None
        for column in ("data_source", prompt_key, "reward_model"):
            if column not in table.column_names:
                raise DataError(f"{path} has no required column {column!r}; columns: {table.column_names}")
        if table.num_rows == 0:
            raise DataError(f"{path} has no rows")
        rows.extend(table.to_pylist())
    return rows


def first_rows(rows: list[dict], limit: int, key: str = "max_samples") -> list[dict]:
    """The first ``limit`` of ``rows`` (in load order; all of them for -1 or a limit over their number).

    Raises:
        ValueError: ``limit`` is 0 or below -1 (the message names ``key``, the option that set it).
    """
    if limit == 0 or limit < -1:
        raise ValueError(f"{key} must be -1 (all rows) or >= 1, got {limit}")
    return rows if limit == -1 else rows[:limit]


def _prompt_text(row: dict, i: int, prompt_key: str, tokenizer: Any,
                 tools: Optional[Sequence[dict]] = None) -> tuple[str, bool]:
    """Return ``(text, add_bos)`` for row ``i`` per the module's prompt text rule; raise DataError if malformed."""
    if prompt_key not in row:
        raise DataError(f"missing prompt key {prompt_key!r}; keys: {sorted(row)}", row=i)
    prompt = row[prompt_key]
    if isinstance(prompt, str):
        return prompt, True
    if isinstance(prompt, np.ndarray):  # rows that went through pandas hold arrays of dicts
        prompt = list(prompt)
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise DataError(
            f"{prompt_key!r} must be a str or a non-empty list of messages, got {type(prompt).__name__}"
            + (" (empty)" if isinstance(prompt, (list, tuple)) else ""), row=i
        )
    for j, m in enumerate(prompt):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"message {j} of {prompt_key!r} must be a dict with str 'role' and 'content'",
                            row=i)
    messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    if getattr(tokenizer, "chat_template", None):
        kwargs = {"tools": list(tools)} if tools else {}  # multi-turn: the tool schemas the model may call
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs), False
    return "\n".join(m["content"] for m in messages), True


def _ground_truth(row: dict, i: int) -> str:
    """``row["reward_model"]["ground_truth"]`` as a str (ints/floats are converted); raise DataError if missing."""
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise DataError(f"missing reward_model.ground_truth (reward_model is {reward_model!r})", row=i)
    truth = reward_model["ground_truth"]
    if isinstance(truth, str):
        return truth
    if isinstance(truth, (int, float)) and not isinstance(truth, bool):
        return str(truth)
    raise DataError(f"reward_model.ground_truth must be a str, got {type(truth).__name__}", row=i)


class RLHFDataset(Dataset):
    """Prompts tokenized once at construction (fail fast on malformed or over-long rows).

    Args:
        rows: row dicts in verl's schema (see the module docstring), e.g. from ``load_rows``.
        tokenizer: a Hugging Face tokenizer; see the module's prompt text rule.
        max_prompt_length: maximum prompt length in tokens (>= 1).
        prompt_key: the row key holding the messages or the prompt string.
        truncation: what to do with a prompt longer than ``max_prompt_length``: ``"error"`` raises,
            ``"left"`` keeps the last ``max_prompt_length`` tokens, ``"right"`` keeps the first ones,
            ``"filter"`` drops the row (``self.num_filtered`` counts them; a warning is logged).
        tools: tool schemas passed to the chat template as ``tools=`` (multi-turn rollouts,
            :meth:`hybridflow.rollout.multi_turn.MultiTurnLoop.tool_schemas`); None renders without tools.

    Raises:
        ValueError: an unknown ``truncation`` or ``max_prompt_length < 1``.
        DataError: a malformed row (missing prompt key, prompt of the wrong type, missing
            ``reward_model.ground_truth``, non-str ``data_source``, prompt with no tokens) or, with
            ``truncation="error"``, over-long prompts, all reported in one error naming the longest one's row
            (``error.row``), its length, how many rows are over the limit and the config keys to change. The
            message of a malformed row names the row index and ``error.row`` holds it. With ``"filter"``, also
            when every row is filtered out.

    ``self[i]`` is a dict: ``input_ids`` (1-D ``torch.long``, unpadded, possibly truncated), ``raw_prompt``
    (the prompt text before tokenization and truncation, after the chat template, without the prepended BOS),
    ``data_source`` (str), ``ground_truth`` (str), ``extra_info`` (dict, a copy) and ``index`` (int:
    ``extra_info["index"]`` when present, else the row's position in ``rows``).
    """

    def __init__(
        self,
        rows: Sequence[dict],
        tokenizer: Any,
        max_prompt_length: int,
        prompt_key: str = "prompt",
        truncation: str = "error",
        tools: Optional[Sequence[dict]] = None,
    ) -> None:
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"truncation must be one of {TRUNCATION_MODES}, got {truncation!r}")
        if not isinstance(max_prompt_length, int) or max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be a positive int, got {max_prompt_length!r}")
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation

        texts, add_bos, records = [], [], []
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise DataError(f"expected a dict, got {type(row).__name__}", row=i)
            text, bos = _prompt_text(row, i, prompt_key, tokenizer, tools)
            data_source = row.get("data_source")
            if not isinstance(data_source, str):
                raise DataError(f"data_source must be a str, got {data_source!r}", row=i)
            extra_info = row.get("extra_info") or {}
            if not isinstance(extra_info, dict):
                raise DataError(f"extra_info must be a dict, got {type(extra_info).__name__}", row=i)
            index = extra_info.get("index")
            if index is not None and not isinstance(index, (int, np.integer)):
                raise DataError(f"extra_info.index must be an int, got {index!r}", row=i)
            records.append(
                {
                    "raw_prompt": text,
                    "data_source": data_source,
                    "ground_truth": _ground_truth(row, i),
                    "extra_info": extra_info,
                    "index": int(index) if index is not None else i,
                }
            )
            texts.append(text)
            add_bos.append(bos)

        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        bos_id = getattr(tokenizer, "bos_token_id", None)
        ids_per_row = [([bos_id] if bos and bos_id is not None else []) + list(ids)
                       for ids, bos in zip(encoded, add_bos)]
        for i, ids in enumerate(ids_per_row):
            if not ids:
                raise DataError("prompt has no tokens", row=i)
        if truncation == "error":
            _check_lengths(ids_per_row, max_prompt_length)
        self._records: list[dict] = []
        self._input_ids: list[torch.Tensor] = []
        self.num_filtered = 0
        for ids, record in zip(ids_per_row, records):
            if len(ids) > max_prompt_length:
                if truncation == "filter":
                    self.num_filtered += 1
                    continue
                ids = ids[-max_prompt_length:] if truncation == "left" else ids[:max_prompt_length]
            self._records.append(record)
            self._input_ids.append(torch.tensor(ids, dtype=torch.long))
        if self.num_filtered:
            logger.warning("filtered out %d of %d rows longer than data.max_prompt_length=%d (data.truncation=filter)",
                           self.num_filtered, len(records), max_prompt_length)
            if not self._records:
                raise DataError(f"all {len(records)} rows are longer than data.max_prompt_length={max_prompt_length} "
                                "and data.truncation=filter dropped them all; raise data.max_prompt_length")

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, i: int) -> dict:
        record = self._records[i]
        return {
            "input_ids": self._input_ids[i].clone(),
            "raw_prompt": record["raw_prompt"],
            "data_source": record["data_source"],
            "ground_truth": record["ground_truth"],
            "extra_info": copy.deepcopy(record["extra_info"]),
            "index": record["index"],
        }


def _check_lengths(ids_per_row: Sequence[list[int]], max_prompt_length: int) -> None:
    """With ``truncation="error"``: every over-long prompt reported at once, in one line.

    Raises:
        DataError: some prompts have more than ``max_prompt_length`` tokens; ``error.row`` is the longest one's
            index (the first of equal ones) and the message gives how many rows are over, the longest length and
            the config keys that fix it (``data.max_prompt_length``, ``data.truncation`` and its values).
    """
    lengths = [len(ids) for ids in ids_per_row]
    over = sum(n > max_prompt_length for n in lengths)
    if not over:
        return
    longest = max(range(len(lengths)), key=lambda i: (lengths[i], -i))
    modes = ", ".join(TRUNCATION_MODES)
    raise DataError(f"prompt has {lengths[longest]} tokens > max_prompt_length={max_prompt_length}, the longest of "
                    f"{over} of {len(lengths)} prompts over the limit; set data.max_prompt_length >= "
                    f"{lengths[longest]}, or data.truncation (one of {modes}) to left, right or filter",
                    row=longest)


def compute_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids for left-padded rows: ``cumsum(attention_mask) - 1`` clamped at 0.

    Args:
        attention_mask: ``(B, L)``, 1 for real tokens, 0 for padding (any integer or bool dtype).

    Returns:
        ``(B, L)`` ``torch.long``; the first real token of each row has position 0, padding has position 0.
    """
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def collate_fn(features: Sequence[dict], pad_token_id: int, max_prompt_length: Optional[int] = None) -> DataProto:
    """Left-pad a list of ``RLHFDataset`` items to the longest prompt in the batch and build a ``DataProto``.

    Use with a DataLoader as ``functools.partial(collate_fn, pad_token_id=..., max_prompt_length=...)``.

    Args:
        features: items from ``RLHFDataset.__getitem__`` (B of them).
        pad_token_id: id written into padding positions (the caller decides; see the module docstring).
        max_prompt_length: guard; a prompt longer than this raises (``None`` skips the check).

    Returns:
        ``DataProto`` with tensors ``input_ids``, ``attention_mask`` (1 = real token) and ``position_ids``
        (see ``compute_position_ids``), each ``(B, P)`` ``torch.long``, and object arrays ``(B,)``
        ``raw_prompt``, ``data_source``, ``ground_truth``, ``extra_info``, ``index``.

    Raises:
        ValueError: ``features`` is empty, ``pad_token_id`` is None, or a prompt exceeds ``max_prompt_length``.
    """
    if not features:
        raise ValueError("collate_fn: got an empty batch")
    if pad_token_id is None:
        raise ValueError("collate_fn: pad_token_id is None; pass the tokenizer's pad id (or another id to pad with)")
    lengths = [int(f["input_ids"].shape[0]) for f in features]
    if max_prompt_length is not None and max(lengths) > max_prompt_length:
        worst = int(np.argmax(lengths))
        raise ValueError(
            f"collate_fn: item {worst} has {lengths[worst]} tokens > max_prompt_length={max_prompt_length}"
        )
    width = max(lengths)
    input_ids = torch.full((len(features), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(features), width), dtype=torch.long)
    for row, (f, n) in enumerate(zip(features, lengths)):
        if n:
            input_ids[row, width - n:] = f["input_ids"]
            attention_mask[row, width - n:] = 1
    keys = ("raw_prompt", "data_source", "ground_truth", "extra_info", "index")
    return DataProto.from_dict(
        tensors={
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": compute_position_ids(attention_mask),
        },
        non_tensors={k: [f[k] for f in features] for k in keys},
    )
