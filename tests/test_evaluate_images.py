"""``hybridflow eval`` (:func:`hybridflow.evaluation.evaluate`) on parquet rows with images for a vision-language
model: the hf rollout generates from the images. Reference: a slow greedy decode by full forwards (no KV cache)
of the shipped builtin:tiny-vlm over the same prompts, its pixel inputs and 3-D rope positions built here from the
processor and :func:`hybridflow.models.vlm.rope_positions` (one unpadded row at a time), scored by the count rule."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from hybridflow.data.multimodal import MultimodalDataset
from hybridflow.data.vlm_task import make_vlm_rows
from hybridflow.evaluation import evaluate
from hybridflow.models import vlm
from hybridflow.models.builtin import resolve_model_path
from hybridflow.models.hf import load_tokenizer

RESPONSE = 8


def _greedy_reference(model, prompt_ids, inputs, eos_ids) -> list[int]:
    ids = list(prompt_ids)
    out = []
    for _ in range(RESPONSE):
        row = torch.tensor([ids])
        mask = torch.ones_like(row)
        mrope = vlm.rope_positions(row, mask, inputs["image_grid_thw"], model.config.image_token_id, 2)
        with torch.no_grad():
            logits = model(input_ids=row, attention_mask=mask, position_ids=mrope.transpose(0, 1),
                           pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"]).logits
        token = int(logits[0, -1].argmax())
        out.append(token)
        if token in eos_ids:
            break
        ids.append(token)
    return out


def test_eval_generates_from_the_images_of_vlm_rows(tmp_path):
    rows = make_vlm_rows("val", 6, seed=3)
    data = tmp_path / "val.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    out = tmp_path / "responses.jsonl"
    result = evaluate("builtin:tiny-vlm", data, max_prompt_length=32, max_response_length=RESPONSE, dtype="float32",
                      device="cpu", batch_size=4, output=out)
    with open(out) as f:
        written = [json.loads(line) for line in f]
    assert result["num_prompts"] == 6 and len(written) == 6

    path = resolve_model_path("builtin:tiny-vlm")
    tokenizer = load_tokenizer(path)
    model = vlm.load_vision_model(path, torch.float32).eval()
    prompts = MultimodalDataset(rows, vlm.ImageTextProcessor.from_pretrained(path, tokenizer), 32)
    eos = {tokenizer.eos_token_id}
    expected_scores = []
    for i, line in enumerate(sorted(written, key=lambda r: r["index"])):
        item = prompts[i]
        tokens = _greedy_reference(model, item["input_ids"].tolist(), item[vlm.INPUTS_KEY], eos)
        text = tokenizer.decode([t for t in tokens if t not in eos], skip_special_tokens=True)
        assert line["response"] == text, (i, line["response"], text)
        expected_scores.append(float(f"#### {rows[i]['reward_model']['ground_truth']}" in text))
    print(f"eval mean@1 {result['mean@1']:.3f}; reference responses agree on all {len(written)} rows")
    assert result["mean@1"] == sum(expected_scores) / len(expected_scores)
