"""The multi-turn loop over the ``hf`` backend on a bigram checkpoint whose sampling logprobs are known in closed
form (tests/rollout/mt_tiny.py): the record's invariants, tools, budgets, finish reasons and the chat-template
deltas (with a reasoning template that drops earlier ``<think>`` blocks), and the trainer scoring exactly the
sampled ids."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers

from hybridflow.rollout import HFRollout
from hybridflow.rollout.multi_turn import MultiTurnLoop, MultiTurnSettings, multi_turn_metrics
from hybridflow.tools import load_tools

from mt_tiny import (BAD_CALL, CALL, FULL_CALL, QUESTIONS, THOUGHT, build_bigram_model, build_tokenizer,
                     check_record_against_table, coin_table, prompts_batch, reasoning_table)

def hf_backend(path, tok, response_length=160, n=4):
    model = transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()
    config = SimpleNamespace(response_length=response_length, n=n, do_sample=True, temperature=1.0, top_p=1.0,
                             top_k=-1, micro_batch_size=8)
    return HFRollout(model, config, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id), model


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
    check_record_against_table(out, tok, coin_table(tok))
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


def _run(tok, table, tmp_path, settings, response_length=160, n=2, questions=QUESTIONS, seed=5):
    path = build_bigram_model(tok, table, tmp_path)
    backend, model = hf_backend(path, tok, response_length=response_length, n=n)
    loop = MultiTurnLoop(tok, load_tools(None), settings)
    return loop.generate(backend, prompts_batch(tok, loop.tool_schemas, questions, meta={"seed": seed})), loop, model


def _trainer_log_probs(model, out):
    """The actor's recomputation (the trainer's forward over the batch's input_ids/attention/positions)."""
    from omegaconf import OmegaConf

    from hybridflow.algorithms.sampling import SamplingSpec
    from hybridflow.config.schema import ActorConfig
    from hybridflow.workers.ppo_actor import PPOActor

    actor = PPOActor(model, None, OmegaConf.structured(ActorConfig), SamplingSpec(temperature=1.0))
    log_probs, _ = actor.compute_log_prob(out, micro_batch_size=4)
    return log_probs


def test_reasoning_template_record_holds_each_turn_once(tmp_path):
    tok = build_tokenizer(reasoning=True)
    table = reasoning_table(tok)
    out, loop, model = _run(tok, table, tmp_path, MultiTurnSettings(max_assistant_turns=3), n=3)
    check_record_against_table(out, tok, table)
    thought = tok.convert_tokens_to_ids(THOUGHT)
    b = out.batch
    rendered_differs = 0
    for row in range(len(out)):
        length = int(b["attention_mask"][row, b["prompts"].shape[1]:].sum())
        ids = b["responses"][row, :length].tolist()
        spans = out.non_tensor_batch["turn_spans"][row]
        model_spans = [ids[s:e] for kind, s, e in spans if kind == "model"]
        assert len(model_spans) == out.non_tensor_batch["num_turns"][row]
        # each assistant turn is in the record once, as sampled: it starts with its own thought
        assert all(span[0] == thought for span in model_spans) and ids.count(thought) == len(model_spans)
        assert sum(model_spans, []) == [t for t, m in zip(ids, b["response_mask"][row].tolist()) if m]
        # the template itself would render the history without the earlier thoughts: a diff of two renders
        # could not reproduce what was sampled
        prompt = b["prompts"][row][b["attention_mask"][row, : b["prompts"].shape[1]].bool()].tolist()
        messages = [{"role": "user", "content": QUESTIONS[row // 3]}]
        for k, span in enumerate(model_spans):
            messages.append({"role": "assistant", "content": tok.decode(
                [t for t in span if t != tok.eos_token_id], skip_special_tokens=False)})
            if k < len(model_spans) - 1:
                messages.append({"role": "tool", "content": "5"})
        rerender = tok.encode(tok.apply_chat_template(messages, tools=loop.tool_schemas, tokenize=False),
                              add_special_tokens=False)
        rendered_differs += rerender[: len(prompt) + length] != prompt + ids
    assert rendered_differs > 0  # some trajectory had 2+ turns, where the template drops a thought
    # the trainer scores exactly the sampled ids in the sampled context
    torch.testing.assert_close(_trainer_log_probs(model, out)[b["response_mask"].bool()],
                               b["rollout_log_probs"][b["response_mask"].bool()], rtol=0, atol=1e-4)
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], dim=1))


def test_budget_per_turn_limit_and_tool_errors(tmp_path):
    tok = build_tokenizer()
    always_call = {"\n": {"<tool_call>": 1.0}, "<tool_call>": {CALL: 1.0}, CALL: {"</tool_call>": 1.0}}
    # a call round is 3 model tokens + a 26-token observation: the second observation does not fit in 40
    out, _, _ = _run(tok, always_call, tmp_path / "a", MultiTurnSettings(max_assistant_turns=5), response_length=40)
    assert set(out.non_tensor_batch["finish_reason"]) == {"length"} and out.batch["truncated"].all()
    assert set(out.non_tensor_batch["num_turns"]) == {2}
    assert all(len(calls) == 2 for calls in out.non_tensor_batch["tool_calls"])  # the second ran, not appended
    assert int(out.batch["attention_mask"][0, out.batch["prompts"].shape[1]:].sum()) == 3 + 26 + 3
    # per-turn limit of 2 tokens: the call is never closed, the trajectory ends (length) with no tool call
    out, _, _ = _run(tok, always_call, tmp_path / "b", MultiTurnSettings(max_tokens_per_turn=2))
    assert set(out.non_tensor_batch["finish_reason"]) == {"length"}
    assert out.batch["response_mask"].sum(-1).tolist() == [2] * len(out)
    # max_user_turns=1: the second call is not run
    out, _, _ = _run(tok, always_call, tmp_path / "c", MultiTurnSettings(max_user_turns=1))
    assert set(out.non_tensor_batch["finish_reason"]) == {"max_turns"} and set(out.non_tensor_batch["num_turns"]) == {2}
    # a call the calculator refuses: error observations, counted, the run goes on to max turns (tool_error)
    bad = {"\n": {"<tool_call>": 1.0}, "<tool_call>": {BAD_CALL: 1.0}, BAD_CALL: {"</tool_call>": 1.0}}
    out, _, _ = _run(tok, bad, tmp_path / "d", MultiTurnSettings(max_assistant_turns=3))
    assert set(out.non_tensor_batch["finish_reason"]) == {"tool_error"}
    calls = out.non_tensor_batch["tool_calls"][0]
    assert [c["turn"] for c in calls] == [0, 1] and all("exponent" in c["error"] for c in calls)
    observation = tok.decode(out.batch["responses"][0], skip_special_tokens=False)
    assert "<tool_response>\nError: ToolError: exponent 999 too large" in observation
    metrics = multi_turn_metrics(out)
    assert metrics["tool/errors"] == 2 * len(out) and metrics["multi_turn/finish/tool_error"] == 1.0


def test_multi_token_stop_string_is_cut_from_the_sampled_turn(tmp_path):
    """With ``</tool_call>`` spelled in characters the backend cannot stop on it: the turn is cut after the token
    that completes it and the tokens sampled after it are dropped (never kept with mask 1, never re-appended)."""
    tok = build_tokenizer(tool_tokens=False)
    table = {"\n": {FULL_CALL: 1.0}, FULL_CALL: {"X": 1.0}, "X": {"Y": 1.0}}
    out, loop, _ = _run(tok, table, tmp_path, MultiTurnSettings(max_assistant_turns=2))
    assert loop.stop_ids == [] and loop.stop_texts == ["</tool_call>"]
    full, x = tok.convert_tokens_to_ids(FULL_CALL), tok.convert_tokens_to_ids("X")
    spans = out.non_tensor_batch["turn_spans"][0]
    ids = out.batch["responses"][0].tolist()
    assert [ids[s:e] for kind, s, e in spans if kind == "model"] == [[full], [full]] and x not in ids
    assert set(out.non_tensor_batch["finish_reason"]) == {"max_turns"}
    assert all(c["result"] == "5" for c in out.non_tensor_batch["tool_calls"][0])
