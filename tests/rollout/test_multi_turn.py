"""The multi-turn loop over the ``hf`` backend on a bigram checkpoint whose sampling logprobs are known in closed
form (tests/rollout/mt_tiny.py): the record's invariants, tools, budgets, finish reasons and the chat-template
deltas (with a reasoning template that drops earlier ``<think>`` blocks), and the trainer scoring exactly the
sampled ids."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import transformers

from hybridflow.protocol import DataProto
from hybridflow.rollout import HFRollout
from hybridflow.rollout.multi_turn import MultiTurnLoop, MultiTurnSettings, multi_turn_metrics
from hybridflow.rollout.multi_turn_template import ChatDelta
from hybridflow.tools import load_tools

from mt_tiny import (ANSWER, CALL, THOUGHT, build_bigram_model, build_tokenizer, coin_table, expected_log_prob,
                     reasoning_table)

QUESTIONS = ["what is 2+3?", "add 2 and 3", "sum?"]


def prompts_batch(tok, tools, questions=QUESTIONS, meta=None) -> DataProto:
    rows = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], tools=tools, tokenize=False,
                                               add_generation_prompt=True), add_special_tokens=False)
            for q in questions]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tok.pad_token_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask,
                                        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}, meta_info=meta or {})


def hf_backend(path, tok, response_length=160, n=4):
    model = transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()
    config = SimpleNamespace(response_length=response_length, n=n, do_sample=True, temperature=1.0, top_p=1.0,
                             top_k=-1, micro_batch_size=8)
    return HFRollout(model, config, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id), model


def check_record_against_table(out, tok, table, delta):
    """Every mask-1 token has the closed-form sampling logprob of the bigram table (so it was sampled by the
    model, in the recorded context); every mask-0 token is code-made and matches the template's rendering."""
    b = out.batch
    for row in range(len(out)):
        prompt = b["prompts"][row][b["attention_mask"][row, : b["prompts"].shape[1]].bool()].tolist()
        length = int(b["attention_mask"][row, b["prompts"].shape[1]:].sum())
        ids, mask = b["responses"][row, :length].tolist(), b["response_mask"][row, :length].tolist()
        lps = b["rollout_log_probs"][row, :length].tolist()
        assert b["response_mask"][row, length:].sum() == 0 and b["attention_mask"][row, -1] in (0, 1)
        context = prompt + ids
        for t, (token, m, lp) in enumerate(zip(ids, mask, lps)):
            if m:
                assert math.isfinite(lp)
                assert lp == pytest.approx(expected_log_prob(table, tok, context[len(prompt) + t - 1], token),
                                           abs=1e-4)
            else:
                assert lp == 0.0
        spans = out.non_tensor_batch["turn_spans"][row]
        assert [s[1] for s in spans] == [0] + [s[2] for s in spans[:-1]] and spans[-1][2] == length
        for kind, start, end in spans:
            assert set(mask[start:end]) == {1 if kind == "model" else 0}
            if kind == "observation":  # end-of-turn markup + the tool message + next generation prompt, code-made
                text = tok.decode(ids[start:end], skip_special_tokens=False)
                assert text == "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n" \
                               "<|im_start|>assistant\n"
        assert spans[-1][0] == "model"
        # positions continue over observations: the trainer's forward sees one contiguous sequence
        pos = b["position_ids"][row, b["prompts"].shape[1]:b["prompts"].shape[1] + length]
        assert pos.tolist() == list(range(len(prompt), len(prompt) + length))


@pytest.fixture(scope="module")
def coin(tmp_path_factory):
    tok = build_tokenizer()
    path = build_bigram_model(tok, coin_table(tok), tmp_path_factory.mktemp("coin"))
    return tok, path


def test_hf_multi_turn_record(coin):
    tok, path = coin
    backend, _ = hf_backend(path, tok)
    loop = MultiTurnLoop(tok, load_tools(None), MultiTurnSettings(max_assistant_turns=4, max_user_turns=4))
    out = loop.generate(backend, prompts_batch(tok, loop.tool_schemas, meta={"seed": 3}))
    assert len(out) == 3 * 4
    check_record_against_table(out, tok, coin_table(tok), loop.delta)
    turns = out.non_tensor_batch["num_turns"]
    assert len(set(turns.tolist())) > 1  # samples of one batch finish at different turns
    for row in range(len(out)):
        reason, calls = out.non_tensor_batch["finish_reason"][row], out.non_tensor_batch["tool_calls"][row]
        # each turn but the last called the calculator (result "5"); the last answered (eos) or hit max turns
        assert reason in ("eos", "max_turns")
        assert len(calls) == turns[row] - 1
        assert all(c["name"] == "calculator" and c["result"] == "5" and c["error"] is None for c in calls)
        assert (reason == "max_turns") == (turns[row] == 4 and "</tool_call>" in tok.decode(
            out.batch["responses"][row], skip_special_tokens=False).rsplit("<|im_start|>assistant\n", 1)[-1])
    metrics = multi_turn_metrics(out)
    assert metrics["multi_turn/turns_mean"] == pytest.approx(turns.mean())
    assert metrics["tool/calls_mean"] == pytest.approx((turns - 1).mean())
    assert metrics["tool/errors"] == 0
    assert metrics["multi_turn/finish/eos"] + metrics["multi_turn/finish/max_turns"] == pytest.approx(1.0)
    assert not out.batch["truncated"].any()
