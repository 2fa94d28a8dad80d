"""The built-in vision task builtin:vlm-count: images, rows, determinism, splits and its reward."""

import collections
import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from hybridflow.data.builtin import BUILTIN_TASKS, builtin_task_rows
from hybridflow.data.vlm_task import (COUNTS, DATA_SOURCE, IMAGE_PLACEHOLDER, IMAGE_SIZE, make_count_problems,
                                      make_vlm_rows)
from hybridflow.rewards import default_compute_score


def _blobs(png: bytes) -> int:
    """Circles counted from the pixels alone: 4-connected components of pixels unlike the corner (background)."""
    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)
    todo = {tuple(p) for p in np.argwhere(np.abs(pixels - pixels[0, 0]).sum(-1) > 0)}
    components = 0
    while todo:
        components += 1
        stack = [todo.pop()]
        while stack:
            y, x = stack.pop()
            for q in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if q in todo:
                    todo.remove(q)
                    stack.append(q)
    return components


def test_rows_follow_verls_multimodal_schema_and_the_pixels_hold_the_answer():
    rows = make_vlm_rows("train", 300, seed=0)
    for i, row in enumerate(rows):
        assert row["data_source"] == DATA_SOURCE
        (message,) = row["prompt"]
        assert message["role"] == "user" and message["content"].count(IMAGE_PLACEHOLDER) == len(row["images"]) == 1
        image = Image.open(io.BytesIO(row["images"][0]["bytes"]))
        assert image.size == (IMAGE_SIZE, IMAGE_SIZE) and image.mode == "RGB"
        assert row["reward_model"] == {"style": "rule", "ground_truth": str(_blobs(row["images"][0]["bytes"]))}
        assert row["extra_info"]["index"] == i and row["extra_info"]["split"] == "train"
    counts = collections.Counter(int(r["reward_model"]["ground_truth"]) for r in rows)
    assert set(counts) == set(COUNTS)  # every count occurs in 300 uniform draws


def test_same_seed_same_bytes_other_seed_or_split_other_images():
    a, b = make_vlm_rows("train", 8, seed=5), make_vlm_rows("train", 8, seed=5)
    assert a == b
    images = {r["images"][0]["bytes"] for r in a}
    assert images.isdisjoint(r["images"][0]["bytes"] for r in make_vlm_rows("train", 8, seed=6))
    assert images.isdisjoint(r["images"][0]["bytes"] for r in make_vlm_rows("val", 8, seed=5))


def test_circles_do_not_touch_and_stay_inside():
    for problem in make_count_problems("val", 40, seed=1):
        for j, (x, y, r) in enumerate(problem.circles):
            assert r <= x <= IMAGE_SIZE - 1 - r and r <= y <= IMAGE_SIZE - 1 - r
            for x2, y2, r2 in problem.circles[j + 1:]:
                assert (x - x2) ** 2 + (y - y2) ** 2 > (r + r2 + 3) ** 2
        assert problem.shortcut_solution != problem.solution == f"#### {problem.count}"


def test_registered_as_builtin_and_scored_by_the_gsm8k_rule():
    assert builtin_task_rows("builtin:vlm-count", "val", 3, 2) == make_vlm_rows("val", 3, 2)
    assert BUILTIN_TASKS.meta("vlm-count", "data_source") == DATA_SOURCE
    assert default_compute_score(DATA_SOURCE, " #### 3", "3") == 1.0
    assert default_compute_score(DATA_SOURCE, " #### 4", "3") == 0.0
    assert default_compute_score(DATA_SOURCE, "three", "3") == 0.0


def test_rows_round_trip_through_parquet(tmp_path):
    rows = make_vlm_rows("train", 4, seed=0)
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    back = pq.read_table(path).to_pylist()
    assert [r["images"][0]["bytes"] for r in back] == [r["images"][0]["bytes"] for r in rows]
    assert [r["prompt"] for r in back] == [r["prompt"] for r in rows]


@pytest.mark.parametrize("split,num", [("test", 1), ("train", -1)])
def test_bad_arguments_raise(split, num):
    with pytest.raises(ValueError):
        make_vlm_rows(split, num, seed=0)
