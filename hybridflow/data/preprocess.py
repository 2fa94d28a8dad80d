"""Convert public math datasets in their original formats to parquet in verl's schema.

* GSM8K (Cobbe et al. 2021): rows with ``question`` and ``answer``; the answer is a worked solution whose last
  ``#### N`` marker gives the final number. Written with ``data_source="openai/gsm8k"``; ground truth ``N``
  without thousands commas or ``$``.
* MATH (Hendrycks et al. 2021): rows with ``problem`` and ``solution``; the final answer is the argument of the
  solution's last ``\\boxed{...}`` (nested braces allowed). Written with
  ``data_source="DigitalLearningGmbH/MATH-lighteval"`` (verl's name); ground truth the bare LaTeX answer.
* Geometry3K (Lu et al. 2021, Inter-GPS), in the ``hiyouga/geometry3k`` layout: rows with ``images`` (a list of
  ``{"bytes": ...}`` / ``{"path": ...}``, the HF datasets Image feature), ``problem`` (text with one ``<image>``
  placeholder per image) and ``answer``. Written with ``data_source="hiyouga/geometry3k"`` (scored by the MATH
  reward, the last ``\\boxed{}``), the images column kept as given (image paths made absolute against the input
  file's folder), the prompt ``problem + " " + GEOMETRY3K_INSTRUCTION``; every image must be readable (PIL).

Input files: ``.jsonl`` (one JSON object per line; blank lines are ignored), ``.json`` (a list of objects) or
``.parquet``. Output: ``OUT_DIR/<split>.parquet`` with one row per input row::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": question + " " + instruction}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, "answer": <original answer>, "question": <original question>}}

(MATH rows carry ``solution`` instead of ``answer`` in ``extra_info``; Geometry3K rows add ``images``.) ``index`` is the row's 0-based position
in the input file, so a row can be traced back even when malformed rows were skipped.

A malformed row (bad JSON, not an object, a missing or empty field, no final answer) raises
``MalformedRowError`` naming the file and the row (1-based line number for ``.jsonl``, 1-based row/element number
otherwise); with ``skip_bad=True`` it is skipped, logged and counted instead.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional, Union

import pyarrow as pa
import pyarrow.parquet as pq

from hybridflow.rewards import gsm8k
from hybridflow.rewards.math import extract_boxed_answer

logger = logging.getLogger(__name__)

GSM8K_DATA_SOURCE = "openai/gsm8k"
MATH_DATA_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
GEOMETRY3K_DATA_SOURCE = "hiyouga/geometry3k"
GEOMETRY3K_INSTRUCTION = "Think step by step and put the final answer within \\boxed{}."
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
INPUT_FORMATS = (".jsonl", ".json", ".parquet")

__all__ = [
    "GSM8K_DATA_SOURCE", "MATH_DATA_SOURCE", "GEOMETRY3K_DATA_SOURCE", "GSM8K_INSTRUCTION", "MATH_INSTRUCTION",
    "GEOMETRY3K_INSTRUCTION", "INPUT_FORMATS", "MalformedRowError", "PreprocessResult", "read_records", "gsm8k_row",
    "math_row", "geometry3k_row", "convert", "DATASETS",
]

PathLike = Union[str, "os.PathLike[str]"]


class MalformedRowError(ValueError):
    """An input row that cannot be converted; the message names the file and the row."""


@dataclasses.dataclass(frozen=True)
class PreprocessResult:
    """What :func:`convert` wrote: the parquet path, rows written, rows skipped as malformed."""

    output: str
    num_rows: int
    num_skipped: int


def _row_label(path: str, number: int) -> str:
    return f"{path}: {'line' if Path(path).suffix.lower() == '.jsonl' else 'row'} {number}"


def read_records(path: PathLike) -> Iterator[tuple[int, Any]]:
    """Yield ``(row_number, record)`` for each input row (``row_number`` 1-based: the line number for
    ``.jsonl``, the element/row number for ``.json``/``.parquet``). A ``.jsonl`` line that is not valid JSON
    yields a ``MalformedRowError`` (without the location) as its record, so the caller decides whether to
    stop or skip.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: an unsupported extension, or a ``.json`` file that is not a JSON list.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"input file not found: {path}")
    suffix = Path(path).suffix.lower()
    if suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    yield number, json.loads(line)
                except json.JSONDecodeError as exc:
                    yield number, MalformedRowError(f"invalid JSON ({exc.msg} at column {exc.colno})")
    elif suffix == ".json":
        with open(path, encoding="utf-8") as f:
            records = json.load(f)
        if not isinstance(records, list):
            raise ValueError(f"{path}: a .json input must hold a list of objects, got {type(records).__name__}")
        yield from enumerate(records, start=1)
    elif suffix == ".parquet":
        yield from enumerate(pq.read_table(path).to_pylist(), start=1)
    else:
        raise ValueError(f"{path}: unsupported input format {suffix!r}; expected one of {list(INPUT_FORMATS)}")


def _text_fields(record: Any, fields: tuple[str, ...]) -> list[str]:
    """The non-empty str values of ``fields`` in ``record``; raise MalformedRowError (without location)."""
    if not isinstance(record, dict):
        raise MalformedRowError(f"expected a JSON object with {list(fields)}, got {type(record).__name__}")
    values = []
    for field in fields:
        value = record.get(field)
        if not isinstance(value, str) or not value.strip():
            got = "missing" if field not in record else f"{type(value).__name__} {str(value)[:40]!r}"
            raise MalformedRowError(f"field {field!r} must be a non-empty string ({got})")
        values.append(value)
    return values


def _row(data_source: str, prompt: str, ground_truth: str, split: str, index: int, extra: dict) -> dict:
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": prompt}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, **extra},
    }


def gsm8k_row(record: Any, split: str, index: int) -> dict:
    """One GSM8K record (``question``, ``answer`` ending in ``#### N``) -> a row in verl's schema.

    Raises:
        MalformedRowError: not an object, a missing/empty field, or no numeric ``#### N`` in the answer.
    """
    question, answer = _text_fields(record, ("question", "answer"))
    final = gsm8k.extract_solution(answer, method="strict")
    if final is None or gsm8k.normalize_number(final) is None:
        raise MalformedRowError(f"answer has no final '#### <number>' line (ends with {answer[-40:]!r})")
    truth = final.replace(",", "").replace("$", "")
    return _row(GSM8K_DATA_SOURCE, f"{question} {GSM8K_INSTRUCTION}", truth, split, index,
                {"answer": answer, "question": question})


def math_row(record: Any, split: str, index: int) -> dict:
    """One MATH record (``problem``, ``solution`` with a final ``\\boxed{...}``) -> a row in verl's schema.

    Raises:
        MalformedRowError: not an object, a missing/empty field, or no (non-empty) ``\\boxed{}`` in the solution.
    """
    problem, solution = _text_fields(record, ("problem", "solution"))
    truth = extract_boxed_answer(solution)
    if not truth:
        raise MalformedRowError(f"solution has no non-empty \\boxed{{...}} answer (ends with {solution[-40:]!r})")
    return _row(MATH_DATA_SOURCE, f"{problem} {MATH_INSTRUCTION}", truth, split, index,
                {"solution": solution, "question": problem})


def _checked_images(images: Any, base_dir: str) -> list[dict]:
    """``images`` as ``[{"bytes": b} or {"path": absolute path}]``, each opened and verified with PIL.

    Raises:
        MalformedRowError: not a non-empty list of such entries, empty bytes, a missing file, or an unreadable
            image (the message names the entry).
    """
    from PIL import Image

    if not isinstance(images, list) or not images:
        raise MalformedRowError(f"field 'images' must be a non-empty list of {{bytes}}/{{path}} entries, got "
                                f"{type(images).__name__} {str(images)[:40]!r}")
    checked = []
    for k, entry in enumerate(images):
        data = entry.get("bytes") if isinstance(entry, dict) else None
        path = entry.get("path") if isinstance(entry, dict) else None
        if data is None and path:
            path = path if os.path.isabs(path) else os.path.join(base_dir, path)
            if not os.path.isfile(path):
                raise MalformedRowError(f"images[{k}]: no such file {path!r}")
        elif not data:
            raise MalformedRowError(f"images[{k}] has neither image bytes nor a path ({str(entry)[:40]!r})")
        try:
            with Image.open(io.BytesIO(data) if data else path) as image:
                image.verify()
        except Exception as exc:  # PIL raises many types for a bad file
            raise MalformedRowError(f"images[{k}] is not a readable image ({type(exc).__name__}: {exc})") from None
        checked.append({"bytes": bytes(data)} if data else {"path": path})
    return checked


def geometry3k_row(record: Any, split: str, index: int, base_dir: str = ".") -> dict:
    """One Geometry3K record (``images``, ``problem`` with ``<image>`` placeholders, ``answer``) -> a row in verl's
    multimodal schema; relative image paths are taken against ``base_dir``.

    Raises:
        MalformedRowError: a missing/empty field, a bad image (:func:`_checked_images`), or a number of
            ``<image>`` placeholders other than the number of images.
    """
    problem, answer = _text_fields(record, ("problem", "answer"))
    images = _checked_images(record.get("images"), base_dir)
    if problem.count("<image>") != len(images):
        raise MalformedRowError(f"problem has {problem.count('<image>')} '<image>' placeholders for "
                                f"{len(images)} images")
    row = _row(GEOMETRY3K_DATA_SOURCE, f"{problem} {GEOMETRY3K_INSTRUCTION}", answer.strip(), split, index,
               {"answer": answer, "question": problem})
    row["ability"] = "geometry"
    row["images"] = images
    return row


DATASETS: dict[str, Callable[..., dict]] = {"gsm8k": gsm8k_row, "math": math_row, "geometry3k": geometry3k_row}
_WITH_BASE_DIR = ("geometry3k",)  # row makers that resolve relative image paths against the input's folder


def _schema(extra_info_keys: list[str], images: bool = False) -> pa.Schema:
    """The output schema; ``extra_info`` holds ``index`` (int64) and text fields under ``extra_info_keys``;
    ``images``: an ``images`` column, a list of ``{bytes: binary, path: string}`` per row (HF's Image layout)."""
    text = pa.string()
    extra = [(key, pa.int64() if key == "index" else text) for key in extra_info_keys]
    image_column = [("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", text)])))] if images else []
    return pa.schema([*image_column,
        ("data_source", text),
        ("prompt", pa.list_(pa.struct([("role", text), ("content", text)]))),
        ("ability", text),
        ("reward_model", pa.struct([("style", text), ("ground_truth", text)])),
        ("extra_info", pa.struct(extra)),
    ])


def convert(
    dataset: str,
    input_path: PathLike,
    output_dir: PathLike,
    split: Optional[str] = None,
    skip_bad: bool = False,
) -> PreprocessResult:
    """Convert one input file of ``dataset`` (``"gsm8k"``, ``"math"`` or ``"geometry3k"``) to ``output_dir/<split>.parquet``.

    Args:
        split: the split name written to ``extra_info.split`` and used as the file name; default: the input's
            file name without extension (``test.jsonl`` -> ``"test"``).
        skip_bad: skip malformed rows (each is logged with its row number) instead of raising.

    Raises:
        ValueError: unknown ``dataset``; unsupported input format; a ``split`` that is not a plain file name;
            no row converted.
        MalformedRowError: a malformed row, unless ``skip_bad``.
        FileNotFoundError: ``input_path`` does not exist.
    """
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; known datasets: {sorted(DATASETS)}")
    input_path = os.fspath(input_path)
    make_row = DATASETS[dataset]
    if dataset in _WITH_BASE_DIR:
        make_row = functools.partial(make_row, base_dir=os.path.dirname(os.path.abspath(input_path)))
    split = split or Path(input_path).name.split(".")[0]
    if not split or os.sep in split or split in (".", ".."):
        raise ValueError(f"split must be a plain file name (it names the output parquet), got {split!r}")
    rows, skipped = [], 0
    for index, (number, record) in enumerate(read_records(input_path)):
        try:
            if isinstance(record, MalformedRowError):
                raise record
            rows.append(make_row(record, split, index))
        except MalformedRowError as exc:
            message = f"{_row_label(input_path, number)}: {exc}"
            if not skip_bad:
                raise MalformedRowError(f"{message} (skip malformed rows with skip_bad / --skip-bad)") from None
            skipped += 1
            logger.warning("skipping malformed row: %s", message)
    if not rows:
        raise ValueError(f"{input_path}: no {dataset} rows converted ({skipped} malformed rows skipped)")
    os.makedirs(output_dir, exist_ok=True)
    output = os.path.join(os.fspath(output_dir), f"{split}.parquet")
    schema = _schema(list(rows[0]["extra_info"]), images="images" in rows[0])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), output)
    logger.info("wrote %d %s rows to %s (%d malformed rows skipped)", len(rows), dataset, output, skipped)
    return PreprocessResult(output=output, num_rows=len(rows), num_skipped=skipped)
