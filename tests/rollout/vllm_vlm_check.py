"""Child process of tests/rollout/test_vllm_vlm.py (run with the torchvision shim first on PYTHONPATH, see
tests/helpers/tvshim.py): the vllm rollout of the shipped ``builtin:tiny-vlm`` on image prompts against one
unpadded Hugging Face forward per row (the trainer's policy: vision special tokens banned), before and after an in-place weight reload that changes only the vision
tower. Prints one JSON line of measurements (max abs logprob differences); the test asserts on them.
"""

from __future__ import annotations

import copy
import json
import sys
from types import SimpleNamespace
from unittest import mock

import numpy as np
import torch
from transformers import Qwen2_5_VLForConditionalGeneration

from hybridflow.data.vlm_task import IMAGE_PLACEHOLDER, QUESTION, make_count_problems
from hybridflow.models.builtin import resolve_model_path
from hybridflow.models.vlm import ban_vision_tokens
from hybridflow.models.vlm_build import load_vlm_processor
from hybridflow.protocol import DataProto
from hybridflow.rollout import VLLMRollout, vllm_rollout

RESPONSE_LENGTH = 5
TEXTS = (IMAGE_PLACEHOLDER + QUESTION, IMAGE_PLACEHOLDER + "Count.", "No image here, count nothing.")


def encode_rows(processor, images) -> list[dict]:
    """Per row the processor's output (batch of one): ``input_ids``, ``mm_token_type_ids`` (1, P_i) and, with an
    image, ``pixel_values``, ``image_grid_thw``; row 2 has no image."""
    rows = []
    for text, image in zip(TEXTS, images):
        prompt = processor.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                         add_generation_prompt=True, tokenize=False)
        kwargs = {"images": [[image]]} if image is not None else {}
        rows.append(dict(processor(text=[prompt], return_tensors="pt", return_mm_token_type_ids=True, **kwargs)))
    return rows


def left_padded(rows: list[dict], images, pad_id: int, meta_info: dict) -> DataProto:
    width = max(r["input_ids"].shape[1] for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - r["input_ids"].shape[1]:] = r["input_ids"][0]
        mask[i, width - r["input_ids"].shape[1]:] = 1
    data = np.array([{"image": [im]} if im is not None else {} for im in images], dtype=object)
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask,
                                        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
                               non_tensors={"multi_modal_data": data}, meta_info=meta_info)


@torch.no_grad()
def reference_max_diff(model, rows: list[dict], out: DataProto, n: int) -> float:
    """Max |rollout logprob - HF logprob| over generated tokens; HF: one forward per row over its unpadded prompt
    + response (positions from the model's own mrope computation)."""
    worst = 0.0
    for i in range(out.batch["responses"].shape[0]):
        row = rows[i // n]
        length = int(out.batch["response_mask"][i].sum())
        response = out.batch["responses"][i, :length]
        ids = torch.cat([row["input_ids"][0], response])[None]
        mm_types = torch.cat([row["mm_token_type_ids"][0], torch.zeros(length, dtype=torch.long)])[None]
        vision = {k: row[k] for k in ("pixel_values", "image_grid_thw") if k in row}
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=mm_types,
                       **vision).logits[0].float()
        start = row["input_ids"].shape[1] - 1
        ref = logits[start: start + length].log_softmax(-1).gather(-1, response[:, None])[:, 0]
        worst = max(worst, float((ref - out.batch["rollout_log_probs"][i, :length]).abs().max()))
    return worst


def perturb_vision(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.model.visual.parameters():
            p.add_(p.std() * torch.randn(p.shape, generator=gen) if p.numel() > 1 else 0.0)


def main() -> None:
    torch.set_num_threads(1)
    path = resolve_model_path("builtin:tiny-vlm")
    processor = load_vlm_processor(path)
    tok = processor.tokenizer
    images = [p.image for p in make_count_problems("val", 2, 7)] + [None]
    rows = encode_rows(processor, images)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    ban_vision_tokens(model)  # the trainer's policy never emits the vision tokens; the engine bans them too
    config = SimpleNamespace(response_length=RESPONSE_LENGTH, n=1, do_sample=False, temperature=1.0, top_p=1.0,
                             top_k=-1, enforce_eager=True)
    rollout = VLLMRollout(path, config, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                          max_model_len=128)
    result = {"prompt_lengths": [r["input_ids"].shape[1] for r in rows]}
    greedy = rollout.generate_sequences(left_padded(rows, images, tok.pad_token_id, {}))
    result["greedy_diff"] = reference_max_diff(model, rows, greedy, 1)
    result["greedy_tokens"] = int(greedy.batch["response_mask"].sum())
    sampled = rollout.generate_sequences(left_padded(rows, images, tok.pad_token_id,
                                                     {"do_sample": True, "n": 2, "seed": 3}))
    result["sampled_diff"] = reference_max_diff(model, rows, sampled, 2)
    before = greedy.batch["rollout_log_probs"][:, 0].clone()

    old_model = copy.deepcopy(model)
    perturb_vision(model, seed=1)
    rollout.load_weights(model.state_dict().items())
    reloaded = rollout.generate_sequences(left_padded(rows, images, tok.pad_token_id, {}))
    result["reload_diff"] = reference_max_diff(model, rows, reloaded, 1)
    # how far the same sequences' logprobs are under the old weights: the reload must have moved them
    result["reload_distance_from_old_weights"] = reference_max_diff(old_model, rows, reloaded, 1)
    result["reload_change_text_row_first_token"] = float((reloaded.batch["rollout_log_probs"][2, 0] - before[2]).abs())

    # the same reload without the encoder-cache reset: the cached image embeddings of the old tower are reused
    perturb_vision(model, seed=2)
    with mock.patch.object(vllm_rollout, "reset_encoder_cache", lambda llm: None):
        rollout.load_weights(model.state_dict().items())
    stale = rollout.generate_sequences(left_padded(rows, images, tok.pad_token_id, {}))
    result["stale_diff_without_encoder_reset"] = reference_max_diff(model, rows, stale, 1)
    rollout.close()
    print("RESULT " + json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
