"""Geometry3K preprocessing (hiyouga/geometry3k layout: images, problem, answer) on hand-made rows."""

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from hybridflow.data.preprocess import (GEOMETRY3K_DATA_SOURCE, GEOMETRY3K_INSTRUCTION, MalformedRowError, convert,
                                        geometry3k_row)
from hybridflow.rewards import default_compute_score


def _png(color=(10, 200, 30), size=(12, 8)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def _write(path, records):
    schema = pa.schema([("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
                        ("problem", pa.string()), ("answer", pa.string())])
    pq.write_table(pa.Table.from_pylist(records, schema=schema), path)


def test_rows_keep_the_images_and_ask_for_a_boxed_answer(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "b.png").write_bytes(_png((1, 2, 3)))
    a = _png()
    records = [
        {"images": [{"bytes": a, "path": None}], "problem": "<image>Find x.", "answer": "3"},
        {"images": [{"bytes": None, "path": "img/b.png"}], "problem": "<image>Find the area of the triangle.",
         "answer": "2\\sqrt{3}"},
    ]
    _write(tmp_path / "train.parquet", records)
    result = convert("geometry3k", tmp_path / "train.parquet", tmp_path / "out")
    assert (result.num_rows, result.num_skipped) == (2, 0)
    rows = pq.read_table(result.output).to_pylist()
    assert rows[0]["data_source"] == GEOMETRY3K_DATA_SOURCE
    assert rows[0]["prompt"] == [{"role": "user", "content": "<image>Find x. " + GEOMETRY3K_INSTRUCTION}]
    assert rows[0]["images"] == [{"bytes": a, "path": None}]
    assert rows[1]["images"] == [{"bytes": None, "path": str(tmp_path / "img" / "b.png")}]
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["3", "2\\sqrt{3}"]
    assert [r["extra_info"]["index"] for r in rows] == [0, 1]
    assert default_compute_score(GEOMETRY3K_DATA_SOURCE, "so x is \\boxed{3}", "3") == 1.0
    assert default_compute_score(GEOMETRY3K_DATA_SOURCE, "\\boxed{4}", "3") == 0.0


@pytest.mark.parametrize("images,problem,match", [
    ([{"bytes": b"", "path": None}], "<image>Find x.", r"images\[0\] has neither image bytes nor a path"),
    ([{"bytes": b"not a png", "path": None}], "<image>Find x.", r"images\[0\] is not a readable image"),
    ([{"bytes": None, "path": "missing.png"}], "<image>Find x.", r"images\[0\]: no such file .*missing.png"),
    ([], "<image>Find x.", "field 'images' must be a non-empty list"),
    ([{"bytes": _png(), "path": None}], "Find x.", "problem has 0 '<image>' placeholders for 1 images"),
])
def test_a_bad_image_row_is_one_line_naming_file_and_row(tmp_path, images, problem, match):
    good = {"images": [{"bytes": _png(), "path": None}], "problem": "<image>Find y.", "answer": "1"}
    _write(tmp_path / "test.parquet", [good, {"images": images, "problem": problem, "answer": "2"}])
    with pytest.raises(MalformedRowError, match=f"test.parquet: row 2: {match}") as err:
        convert("geometry3k", tmp_path / "test.parquet", tmp_path / "out")
    assert "\n" not in str(err.value)
    result = convert("geometry3k", tmp_path / "test.parquet", tmp_path / "out", skip_bad=True)
    assert (result.num_rows, result.num_skipped) == (1, 1)


def test_jsonl_rows_with_image_paths(tmp_path):
    (tmp_path / "a.png").write_bytes(_png())
    record = {"images": [{"path": "a.png"}], "problem": "<image>What is y?", "answer": "7"}
    (tmp_path / "val.jsonl").write_text(json.dumps(record) + "\n")
    result = convert("geometry3k", tmp_path / "val.jsonl", tmp_path / "out")
    (row,) = pq.read_table(result.output).to_pylist()
    assert row["images"] == [{"bytes": None, "path": str(tmp_path / "a.png")}]
    assert geometry3k_row(record, "val", 0, base_dir=str(tmp_path))["images"] == [{"path": str(tmp_path / "a.png")}]
