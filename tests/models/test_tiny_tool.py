"""The shipped builtin:tiny-tool model and its build script: tokenizer, chat template as the multi-turn loop renders
it, and the warm start's behaviour (calls the calculator in some, not all, sampled answers)."""

import json
from pathlib import Path

import pytest
import torch

from hybridflow.data.tool_task import make_tool_problems, tool_call_text
from hybridflow.models.builtin import BUILTIN_MODELS, resolve_model_path
from hybridflow.rollout.multi_turn_template import ChatDelta
from hybridflow.tools.calculator import CalculatorTool
from hybridflow.tools.formats import HermesFormat

TOOL_STRINGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


def _load(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _check_tokenizer(tokenizer):
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == ("<pad>", "<s>", "</s>")
    for s in TOOL_STRINGS:  # one token each, kept by skip_special_tokens
        ids = tokenizer(s, add_special_tokens=False).input_ids
        assert len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=True) == s
    call = tool_call_text("347 * 28")
    text = f"Answer: {call}</s><tool_response>9716</tool_response>\nAnswer: #### 9716 ünïcode ✓"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids) == text
    digits = tokenizer("12345", add_special_tokens=False).input_ids
    assert [tokenizer.decode([i]) for i in digits] == list("12345")  # one token per digit
    # what the loop parses out of the decoded model turn
    (parsed,) = HermesFormat().parse(tokenizer.decode(tokenizer(" " + call, add_special_tokens=False).input_ids))
    assert (parsed.name, parsed.arguments, parsed.error) == ("calculator", {"expression": "347 * 28"}, None)


def _check_template(tokenizer):
    """Prompt with tools=, observation delta and end of turn, as hybridflow's dataset and ChatDelta render them."""
    schema = CalculatorTool().schema
    question = "Ann packs 347 boxes with 28 pencils in each box. How many pencils does she pack?"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tools=[schema],
                                           add_generation_prompt=True, tokenize=False)
    assert prompt == f"<tools>calculator</tools>\nQuestion: {question}\nAnswer:"
    delta = ChatDelta(tokenizer, tools=[schema])
    observation = delta.tool_observation([("calculator", "9716")])
    assert tokenizer.decode(observation) == "<tool_response>9716</tool_response>\nAnswer:"
    assert observation == tokenizer("<tool_response>9716</tool_response>\nAnswer:", add_special_tokens=False).input_ids
    assert delta.end_of_turn == [tokenizer.eos_token_id]  # a turn stopped at </tool_call> gets </s> (mask 0)
    history = [{"role": "user", "content": question},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "347 * 28"}}}]},
               {"role": "tool", "name": "calculator", "content": "9716"},
               {"role": "assistant", "content": " #### 9716"}]
    assert tokenizer.apply_chat_template(history, tools=[schema], tokenize=False) == (
        prompt + " " + tool_call_text("347 * 28") + "</s><tool_response>9716</tool_response>\nAnswer: #### 9716</s>")


def test_shipped_model_is_small_loads_and_renders_tools():
    path = Path(BUILTIN_MODELS["tiny-tool"])
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    assert 0 < size <= 5 * 1024 * 1024
    model, tokenizer = _load(resolve_model_path("builtin:tiny-tool"))
    _check_tokenizer(tokenizer)
    _check_template(tokenizer)
    cfg = model.config
    assert cfg.head_dim >= 32 and cfg.vocab_size >= len(tokenizer) and cfg.vocab_size % 64 == 0
    info = json.loads((path / "build_info.json").read_text())
    assert info["task"] == "hybridflow/tool_arith" and info["tool_fraction"] == 0.3


def test_build_script_end_to_end(tmp_path, repo_script):
    build = repo_script("scripts/build_tiny_tool.py")
    out = tmp_path / "tiny"
    build.main(["--out", str(out), "--steps", "3", "--num-train-problems", "500"])
    model, tokenizer = _load(out)
    _check_tokenizer(tokenizer)
    _check_template(tokenizer)
    assert json.loads((out / "build_info.json").read_text())["sft_steps"] == 3
    logits = model(torch.tensor([[tokenizer.bos_token_id, 5, 6]])).logits
    assert logits.shape == (1, 3, model.config.vocab_size) and logits.dtype == torch.float32


def test_sft_labels_cover_exactly_the_model_turns(repo_script):
    build = repo_script("scripts/build_tiny_tool.py")
    _, tokenizer = _load(resolve_model_path("builtin:tiny-tool"))
    (problem,) = make_tool_problems("train", 1, seed=0)
    ids, labels = build.encode(tokenizer, problem, use_tool=True)
    model_text = tokenizer.decode([i for i, lab in zip(ids, labels) if lab != -100])
    assert model_text == f" {tool_call_text(problem.expression)}</s> #### {problem.answer}</s>"
    assert tokenizer.decode(ids).startswith("<tools>calculator</tools>\nQuestion: ")
    ids, labels = build.encode(tokenizer, problem, use_tool=False)
    assert tokenizer.decode([i for i, lab in zip(ids, labels) if lab != -100]) == f" #### {problem.answer}</s>"


def test_check_helpers_parse_and_evaluate(repo_script):
    build = repo_script("scripts/build_tiny_tool.py")
    assert build.plus_times_value("347 * 28") == 9716 and build.plus_times_value("156 + 16 * 21") == 492
    assert build.plus_times_value("2 ** 3") is None and build.plus_times_value("__import__('os')") is None
    assert build.parse_call(" " + tool_call_text("1 + 2")) == "1 + 2"
    assert build.parse_call("<tool_call>{bad</tool_call>") is None and build.parse_call(" #### 5") is None


@pytest.mark.slow
def test_shipped_model_calls_the_calculator_in_some_sampled_answers(repo_script):
    """The warm start RL starts from: on 96 held-out problems, sampling (temperature 1) calls the calculator in
    15-50% of first turns (SFT mixture: 30%), most calls copy the right expression, and direct guesses are
    almost never right; greedy answers are scored far below what the calculator path reaches."""
    build = repo_script("scripts/build_tiny_tool.py")
    model, tokenizer = _load(resolve_model_path("builtin:tiny-tool"))
    problems = make_tool_problems("val", 96, seed=0)
    sampled = build.check(model, tokenizer, problems, do_sample=True, seed=0)
    assert 0.15 <= sampled["tool_call_fraction"] <= 0.5, sampled
    assert sampled["correct_call_fraction"] >= 0.3 * sampled["tool_call_fraction"], sampled
    assert sampled["direct_score"] <= 0.1, sampled
    greedy = build.check(model, tokenizer, problems, do_sample=False)
    assert greedy["score"] <= 0.5, greedy


@pytest.mark.slow
def test_shipped_model_in_the_multi_turn_loop():
    """The real loop (hf backend, calculator) on the shipped model: every call's observation is the template's
    ``</s><tool_response>RESULT</tool_response>\\nAnswer:`` with mask 0, RESULT is the value of the called
    expression, and model spans carry mask 1."""
    from types import SimpleNamespace

    from hybridflow.data.dataset import RLHFDataset, collate_fn
    from hybridflow.data.tool_task import make_tool_rows
    from hybridflow.rollout import HFRollout
    from hybridflow.rollout.multi_turn import MultiTurnLoop, MultiTurnSettings
    from hybridflow.tools import load_tools
    from hybridflow.tools.calculator import evaluate, format_number

    model, tok = _load(resolve_model_path("builtin:tiny-tool"))
    cfg = SimpleNamespace(response_length=96, n=4, do_sample=True, temperature=1.0, top_p=1.0, top_k=-1,
                          micro_batch_size=32)
    backend = HFRollout(model, cfg, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    loop = MultiTurnLoop(tok, load_tools(None), MultiTurnSettings(max_assistant_turns=3, max_user_turns=2))
    rows = make_tool_rows("val", 8, seed=1)
    dataset = RLHFDataset(rows, tok, 80, tools=loop.tool_schemas)
    batch = collate_fn([dataset[i] for i in range(len(dataset))], tok.pad_token_id, 80)
    batch.meta_info.update(seed=0)
    out = loop.generate(backend, batch)
    nt = out.non_tensor_batch
    assert sum(len(calls) for calls in nt["tool_calls"]) > 0  # 32 samples at ~30% calls
    for row in range(len(out)):
        ids, mask = out.batch["responses"][row].tolist(), out.batch["response_mask"][row].tolist()
        observations = [(s, e) for kind, s, e in nt["turn_spans"][row] if kind == "observation"]
        assert len(observations) == len(nt["tool_calls"][row])
        for (start, end), call in zip(observations, nt["tool_calls"][row]):
            assert set(mask[start:end]) == {0}
            if call["error"] is None:  # (a malformed call gets an error observation instead)
                assert call["result"] == format_number(evaluate(call["arguments"]["expression"]))
                assert tok.decode(ids[start:end]) == f"</s><tool_response>{call['result']}</tool_response>\nAnswer:"
        for kind, start, end in nt["turn_spans"][row]:
            if kind == "model":
                assert set(mask[start:end]) == {1}
