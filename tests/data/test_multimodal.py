"""Image prompts: parquet rows with images -> MultimodalDataset -> collate_multimodal -> DataProto; bad images fail
at load with one line naming the file and row; the per-row vision column through repeat/chunk/concat/reorder."""

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hybridflow.data.multimodal import ImageError, MultimodalDataset, collate_multimodal, load_image
from hybridflow.data.dataset import load_rows
from hybridflow.errors import DataError
from hybridflow.models.vlm import DATA_KEY, INPUTS_KEY, MROPE_KEY
from hybridflow.protocol import DataProto
from hybridflow.protocol_rows import cat_row_tensors
from tests.helpers.vlm import random_image, save_tiny_vlm, tiny_vlm


def _write(rows, path):
    pq.write_table(pa.Table.from_pylist(rows), path)


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vlm():
    return tiny_vlm()


def _rows(tmp_path, parts=True):
    """3 rows: one image, two images (as content parts, or ``<image>`` placeholders in a string), no image."""
    path = tmp_path / "img.png"
    random_image(60, 90, 1).save(path)
    return [
        {"data_source": "hybridflow/arith", "prompt": [{"role": "user", "content": "<image>How many circles?"}],
         "images": [{"bytes": _png(random_image(56, 56, 0)), "path": None}],
         "reward_model": {"ground_truth": "3"}, "extra_info": {"index": 0}},
        {"data_source": "hybridflow/arith", "prompt": [{"role": "user", "content": [
            {"type": "text", "text": "Compare "}, {"type": "image"}, {"type": "text", "text": " and "},
            {"type": "image"}] if parts else "Compare <image> and <image>"}],
         "images": [{"bytes": None, "path": str(path)}, {"bytes": _png(random_image(30, 40, 2)), "path": None}],
         "reward_model": {"ground_truth": "left"}, "extra_info": {"index": 1}},
        {"data_source": "hybridflow/arith", "prompt": [{"role": "user", "content": "no image here"}], "images": [],
         "reward_model": {"ground_truth": "x"}, "extra_info": {"index": 2}},
    ]


def test_parquet_rows_to_batch(vlm, tmp_path):
    model, processor = vlm
    file = tmp_path / "train.parquet"
    _write(_rows(tmp_path, parts=False), file)
    rows = load_rows(str(file))
    in_memory = MultimodalDataset(_rows(tmp_path), processor, max_prompt_length=64)
    ds = MultimodalDataset(rows, processor, max_prompt_length=64)
    items = [ds[i] for i in range(3)]
    assert torch.equal(in_memory[1]["input_ids"], items[1]["input_ids"])  # content parts == placeholders
    pad = processor.image_token_id
    # image tokens (patches / 2x2 merge): 56x56 -> 4x4 -> 4; 60x90 -> 56x84, 4x6 -> 6; 30x40 -> 28x28, 2x2 -> 1
    assert [int((it["input_ids"] == pad).sum()) for it in items] == [4, 7, 0]
    assert [tuple(it[DATA_KEY]["image"][j].size) for it in items[:2] for j in range(len(it[DATA_KEY]["image"]))] \
        == [(56, 56), (84, 56), (28, 28)]
    assert items[1][INPUTS_KEY]["pixel_values"].shape == (24 + 4, 3 * 2 * 14 * 14)
    batch = collate_multimodal(items, processor.tokenizer.pad_token_id, pad, 2, 64)
    mrope = batch.batch[MROPE_KEY]
    assert mrope.shape == (3, 3, batch.batch["input_ids"].shape[1])
    # text-only row: the 3 axes are its 1-D positions; image rows: the model's own get_rope_index
    torch.testing.assert_close(mrope[2], batch.batch["position_ids"][2].expand(3, -1), rtol=0, atol=0)
    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"]
    grid = cat_row_tensors(batch.non_tensor_batch[INPUTS_KEY], ["image_grid_thw"])["image_grid_thw"]
    ref, _ = model.model.get_rope_index(ids, (ids == pad).int(), image_grid_thw=grid, attention_mask=mask)
    torch.testing.assert_close(mrope * mask[:, None], ref.transpose(0, 1) * mask[:, None], rtol=0, atol=0)
    # processed pixels are the returned (resized) images' pixels: reprocessing them gives the same patches
    again = processor.image_processor(images=items[1][DATA_KEY]["image"], return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(again, items[1][INPUTS_KEY]["pixel_values"], rtol=0, atol=0)


def test_repeat_shares_images_and_columns_follow_rows(vlm, tmp_path):
    _, processor = vlm
    ds = MultimodalDataset(_rows(tmp_path), processor, max_prompt_length=64)
    batch = collate_multimodal([ds[i] for i in range(3)], 0, processor.image_token_id, 2)
    rep = batch.repeat(4, interleave=True)
    column = rep.non_tensor_batch[INPUTS_KEY]
    assert all(column[4 * r + k]["pixel_values"] is batch.non_tensor_batch[INPUTS_KEY][r]["pixel_values"]
               for r in range(3) for k in range(4))  # no copy per sample
    chunks = rep.chunk(3)
    whole = DataProto.concat(chunks[::-1])
    back = whole[np.r_[8:12, 4:8, 0:4]]
    assert torch.equal(back.batch[MROPE_KEY], rep.batch[MROPE_KEY])
    assert all(a is b for a, b in zip(back.non_tensor_batch[INPUTS_KEY], column))
    # a micro-batch's vision inputs are its rows' in row order
    cat = cat_row_tensors(rep[[5, 0]].non_tensor_batch[INPUTS_KEY], ["pixel_values", "image_grid_thw"])
    torch.testing.assert_close(cat["image_grid_thw"], torch.tensor([[1, 4, 6], [1, 2, 2], [1, 4, 4]]))
    assert cat["pixel_values"].shape[0] == 24 + 4 + 16


def _bad(tmp_path, images, content="<image> what?"):
    rows = _rows(tmp_path, parts=False)[:1] * 2
    rows[1] = {**rows[1], "images": images, "prompt": [{"role": "user", "content": content}]}
    return rows


@pytest.mark.parametrize("case,match", [
    ("unreadable", r"row 1: image 0 of .*unreadable"),
    ("missing", r"row 1: image 0 of .*unreadable.*nope\.png"),
    ("zero", r"row 1: image 0 of f\.parquet: unreadable"),  # PIL refuses a 0x0 file: reported as unreadable
    ("long", r"row 1: prompt has \d+ tokens \(16 of them image tokens\) > data.max_prompt_length=20"),
    ("count", r"row 1: 2 image placeholders for 1 images"),
    ("aspect", r"row 1: .*aspect ratio"),
])
def test_bad_image_rows_one_line(vlm, tmp_path, case, match):
    _, processor = vlm
    images = {"unreadable": [{"bytes": b"not an image", "path": None}],
              "missing": [{"bytes": None, "path": str(tmp_path / "nope.png")}],
              "zero": [{"bytes": _png_zero(), "path": None}],
              "long": [{"bytes": _png(random_image(112, 112, 3)), "path": None}],
              "count": [{"bytes": _png(random_image(56, 56, 3)), "path": None}],
              "aspect": [{"bytes": _png(random_image(2, 600, 3)), "path": None}]}[case]
    content = "<image><image> two?" if case == "count" else "<image> what?"
    with pytest.raises(ImageError, match=match) as info:
        MultimodalDataset(_bad(tmp_path, images, content), processor, max_prompt_length=20, source="f.parquet")
    assert "\n" not in str(info.value) and info.value.row == 1


def _png_zero() -> bytes:
    # a PNG whose header claims 0x0 pixels
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 0, 0, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")


def test_truncated_image_is_unreadable():
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="PNG")
    with pytest.raises(ImageError, match="^row 4: img: unreadable"):
        load_image({"bytes": buf.getvalue()[:40]}, "img", row=4)


def test_trainer_names_file_and_row_before_ray(vlm, tmp_path):
    """The trainer's data loading (before any worker starts) maps the row to its file."""
    from hybridflow.config import load_config
    from hybridflow.trainer.setup import load_split
    from hybridflow.models.hf import load_tokenizer

    model_dir = save_tiny_vlm(str(tmp_path / "vlm"))
    good = tmp_path / "a.parquet"
    bad = tmp_path / "b.parquet"
    _write(_rows(tmp_path, parts=False), good)
    _write(_bad(tmp_path, [{"bytes": b"junk", "path": None}]), bad)
    config = load_config(None, [f"actor_rollout_ref.model.path={model_dir}", f"data.train_files=[{good},{bad}]",
                                f"data.val_files={good}", "data.max_prompt_length=64"])
    with pytest.raises(DataError, match=rf"^data.train_files: {bad} row 1: image 0: unreadable"):
        load_split(config, load_tokenizer(model_dir), "train")
    assert len(load_split(config, load_tokenizer(model_dir), "val")) == 3
