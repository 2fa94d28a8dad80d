"""The shipped builtin:tiny-vlm (Qwen2.5-VL architecture) and its build script, scripts/build_tiny_vlm.py."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen2_5_VLForConditionalGeneration

from hybridflow.data.vlm_task import IMAGE_PLACEHOLDER, QUESTION, make_count_problems
from hybridflow.models.builtin import BUILTIN_MODELS, resolve_model_path
from hybridflow.models.vlm_build import IMAGE_PAD, VISION_TOKENS, load_vlm_processor

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def shipped():
    path = resolve_model_path("builtin:tiny-vlm")
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return path, model, load_vlm_processor(path)


def test_asset_is_small_and_its_build_info_matches_the_model(shipped):
    path, model, _ = shipped
    assert path == BUILTIN_MODELS["tiny-vlm"]
    assert sum(f.stat().st_size for f in Path(path).iterdir()) <= 4 * 2**20
    info = json.loads((Path(path) / "build_info.json").read_text())
    assert info["num_parameters"] == sum(p.numel() for p in model.parameters())
    assert info["num_vision_parameters"] == sum(p.numel() for p in model.model.visual.parameters())
    assert info["torch_threads"] == 1


def test_architecture_is_qwen2_5_vl_with_heads_of_dim_32_and_a_small_tower(shipped):
    _, model, processor = shipped
    config = model.config
    assert config.model_type == "qwen2_5_vl" and config.text_config.head_dim >= 32
    vision = config.vision_config
    assert 1 <= vision.depth <= 2 and vision.patch_size == 14 and vision.spatial_merge_size == 2
    assert vision.hidden_size // vision.num_heads >= 32
    tokenizer = processor.tokenizer
    assert all(tokenizer.convert_tokens_to_ids(t) != tokenizer.unk_token_id for t in VISION_TOKENS)
    assert config.image_token_id == tokenizer.convert_tokens_to_ids(IMAGE_PAD)


def test_a_task_image_is_four_image_tokens_and_list_content_renders_like_the_placeholder(shipped):
    _, _, processor = shipped
    tokenizer = processor.tokenizer
    as_string = tokenizer.apply_chat_template([{"role": "user", "content": IMAGE_PLACEHOLDER + QUESTION}],
                                              add_generation_prompt=True, tokenize=False)
    as_parts = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
        add_generation_prompt=True, tokenize=False)
    assert as_string == as_parts and as_string.endswith("Answer:")
    image = make_count_problems("val", 1, 0)[0].image
    enc = processor(text=[as_string], images=[[image]], return_tensors="pt")
    assert enc["image_grid_thw"].tolist() == [[1, 4, 4]]  # 56 px / 14 = 4 patches a side, merged 2x2 -> 4 tokens
    assert int((enc["input_ids"] == processor.image_token_id).sum()) == 4


@torch.no_grad()
def _answer_probabilities(model, processor, problems) -> torch.Tensor:
    """(N, 6) P(" #### k</s>") for k = 1..6 by teacher forcing: one forward per k over all N problems (every
    prompt has the same text and image size and every response the same length, so no padding)."""
    tokenizer = processor.tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": IMAGE_PLACEHOLDER + QUESTION}],
                                           add_generation_prompt=True, tokenize=False)
    enc = processor(text=[prompt] * len(problems), images=[[p.image] for p in problems], return_tensors="pt",
                    return_mm_token_type_ids=True)
    start = enc["input_ids"].shape[1] - 1
    columns = []
    for k in range(1, 7):
        response = torch.tensor(tokenizer(f" #### {k}", add_special_tokens=False).input_ids
                                + [tokenizer.eos_token_id]).expand(len(problems), -1)
        ids = torch.cat([enc["input_ids"], response], dim=1)
        types = torch.cat([enc["mm_token_type_ids"], torch.zeros_like(response)], dim=1)
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types,
                       pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"]).logits
        logp = logits[:, start:start + response.shape[1]].log_softmax(-1)
        columns.append(logp.gather(-1, response[..., None])[..., 0].sum(-1).exp())
    return torch.stack(columns, dim=1)


def test_sft_left_partial_accuracy_from_reading_the_image(shipped):
    """RL has room: sampled answers are right only part of the time. And the model reads the image: the mass on
    {count, count + 1} (the two answers the SFT showed) is far higher for the true count than for the count of
    another image (the same probabilities read against a shuffled answer key), which a blind model could not do."""
    _, model, processor = shipped
    problems = make_count_problems("val", 40, seed=11)
    probs = _answer_probabilities(model, processor, problems)
    counts = torch.tensor([p.count for p in problems])
    rows = torch.arange(40)

    def pair_mass(key: torch.Tensor) -> float:
        return float((probs[rows, key - 1] + probs[rows, key]).mean())

    right = probs[rows, counts - 1].mean()
    assert 0.15 <= right <= 0.7
    shuffled = counts[torch.randperm(40, generator=torch.Generator().manual_seed(0))]
    assert pair_mass(counts) >= 0.55 and pair_mass(counts) >= pair_mass(shuffled) + 0.2


def test_build_script_runs_end_to_end_on_a_few_steps(tmp_path):
    spec = importlib.util.spec_from_file_location("build_tiny_vlm", ROOT / "scripts" / "build_tiny_vlm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    info = module.build(tmp_path, steps=2, batch_size=4, num_train_problems=8, num_eval_problems=8)
    assert info["sft_steps"] == 2 and 0.0 <= info["val_expected_sample_score"] <= 1.0
    processor = load_vlm_processor(tmp_path)
    assert processor.tokenizer.chat_template == load_vlm_processor(BUILTIN_MODELS["tiny-vlm"]).tokenizer.chat_template
    Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path)
