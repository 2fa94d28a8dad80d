"""How a multi-turn batch meets the rest of the package: config keys and their load-time checks, prompts rendered
with the tool schemas, the reward function's view (model turns and tool results apart), the step metrics (model
tokens only), and the loop's construction from a run config."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.config import load_config
from hybridflow.config.loader import ConfigError
from hybridflow.data.dataset import RLHFDataset
from hybridflow.protocol import DataProto
from hybridflow.rewards.batch import score_batch
from hybridflow.rollout.multi_turn import MultiTurnLoop, multi_turn_metrics
from hybridflow.tools.config import prompt_tool_schemas
from hybridflow.trainer.steps import compute_data_metrics

from mt_tiny import build_tokenizer

KEY = "actor_rollout_ref.rollout.multi_turn"


def test_config_keys_defaults_and_load_checks(tmp_path):
    cfg = load_config(None, [])
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    assert (mt.enable, mt.max_assistant_turns, mt.max_user_turns, mt.format) == (False, 5, 5, "hermes")
    assert MultiTurnLoop.from_config(cfg, build_tokenizer()) is None and prompt_tool_schemas(cfg) is None
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{KEY}.format=json", f"{KEY}.max_assistant_turns=0", f"{KEY}.max_user_turns=-1",
                           f"{KEY}.tool_timeout_s=0", f"{KEY}.tool_config_path={tmp_path / 'none.yaml'}",
                           f"{KEY}.max_tokens_per_turn=0"])
    message = str(err.value)
    for fragment in ("unknown tool-call format 'json'", "max_assistant_turns: must be >= 1",
                     "max_user_turns: must be >= 0", "tool_timeout_s: must be > 0", "none.yaml",
                     "max_tokens_per_turn: must be null or >= 1"):
        assert fragment in message, fragment
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - name: calculator\n")
    cfg = load_config(None, [f"{KEY}.enable=true", f"{KEY}.tool_config_path={tools}", f"{KEY}.max_user_turns=2"])
    loop = MultiTurnLoop.from_config(cfg, build_tokenizer())
    assert list(loop.tools) == ["calculator"] and loop.settings.max_user_turns == 2
    assert prompt_tool_schemas(cfg) == loop.tool_schemas


def test_prompts_are_rendered_with_the_tool_schemas():
    tok = build_tokenizer()
    rows = [{"prompt": [{"role": "user", "content": "2+3?"}], "data_source": "x", "reward_model": {"ground_truth": "5"}}]
    schemas = [{"type": "function", "function": {"name": "calculator", "description": "", "parameters": {}}}]
    with_tools = RLHFDataset(rows, tok, 128, tools=schemas)[0]["raw_prompt"]
    assert with_tools.startswith("<|im_start|>system\nTools: calculator<|im_end|>\n")
    assert RLHFDataset(rows, tok, 128)[0]["raw_prompt"].startswith("<|im_start|>user\n2+3?")


def _multi_turn_batch(tok):
    """Two rows: a model turn, an observation, a model turn; and a single model turn."""
    turn1, obs, turn2 = (tok.encode(t, add_special_tokens=False) for t in (
        "<tool_call>{}</tool_call>", "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response>", "It is 5"))
    rows = [turn1 + obs + turn2, tok.encode("4", add_special_tokens=False)]
    masks = [[1] * len(turn1) + [0] * len(obs) + [1] * len(turn2), [1]]
    width = max(map(len, rows)) + 2
    responses = torch.full((2, width), tok.pad_token_id)
    mask = torch.zeros((2, width), dtype=torch.long)
    for i, (ids, m) in enumerate(zip(rows, masks)):
        responses[i, :len(ids)], mask[i, :len(m)] = torch.tensor(ids), torch.tensor(m)
    spans = np.empty(2, dtype=object)
    spans[0] = [("model", 0, len(turn1)), ("observation", len(turn1), len(turn1) + len(obs)),
                ("model", len(turn1) + len(obs), len(rows[0]))]
    spans[1] = [("model", 0, 1)]
    calls = np.empty(2, dtype=object)
    calls[0] = [{"name": "calculator", "arguments": {}, "result": "5", "error": None, "latency_s": 0.5, "turn": 0}]
    calls[1] = []
    return DataProto.from_dict(
        tensors={"responses": responses, "response_mask": mask},
        non_tensors={"turn_spans": spans, "tool_calls": calls, "data_source": ["s", "s"], "ground_truth": ["5", "4"],
                     "extra_info": [{"index": 0}, None], "num_turns": np.array([2, 1]),
                     "finish_reason": np.array(["eos", "length"], dtype=object)})


def test_reward_function_gets_model_turns_and_tool_results_apart():
    tok = build_tokenizer()
    data = _multi_turn_batch(tok)
    seen = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        seen.append((solution_str, extra_info))
        return float(ground_truth in extra_info["model_turns"][-1])

    assert score_batch(tok, data, compute_score=compute_score) == [1.0, 1.0]
    (text0, info0), (text1, info1) = seen
    assert text0 == '<tool_call>{}</tool_call>It is 5' and "tool_response" not in text0
    assert info0 == {"index": 0, "model_turns": ['<tool_call>{}</tool_call>', "It is 5"],
                     "tool_calls": list(data.non_tensor_batch["tool_calls"][0])}
    assert info1 == {"model_turns": ["4"], "tool_calls": []}
    assert data.non_tensor_batch["extra_info"][0] == {"index": 0}  # the batch's own dict is left alone


def test_step_metrics_count_model_tokens_and_tool_calls():
    tok = build_tokenizer()
    data = _multi_turn_batch(tok)
    b = data.batch
    model_tokens = b["response_mask"].sum(-1).float()
    n, width = b["responses"].shape
    attended = torch.zeros_like(b["response_mask"])
    attended[0, : int(data.non_tensor_batch["turn_spans"][0][-1][2])] = 1
    attended[1, 0] = 1
    b["attention_mask"] = torch.cat([torch.ones(n, 3, dtype=torch.long), attended], dim=1)
    entropy = torch.where(b["response_mask"].bool(), torch.full((n, width), 2.0), torch.full((n, width), 99.0))
    for key, value in {"token_level_scores": torch.zeros(n, width), "token_level_rewards": torch.zeros(n, width),
                       "advantages": torch.zeros(n, width), "returns": torch.zeros(n, width),
                       "entropys": entropy}.items():
        b[key] = value
    metrics = compute_data_metrics(data)
    assert metrics["response_length/mean"] == pytest.approx(model_tokens.mean().item())
    assert metrics["actor/entropy"] == pytest.approx(2.0)  # observation tokens (99) are not counted
    assert metrics["multi_turn/turns_mean"] == 1.5 and metrics["tool/calls_mean"] == 0.5
    assert metrics["tool/errors"] == 0 and metrics["tool/latency_s_mean"] == 0.5
    assert metrics["multi_turn/finish/eos"] == 0.5 and metrics["multi_turn/finish/length"] == 0.5
    assert multi_turn_metrics(DataProto.from_dict(tensors={"x": torch.zeros(2)})) == {}


def test_chat_delta_markup_and_templates_it_refuses():
    from hybridflow.rollout.multi_turn_template import ChatDelta

    tok = build_tokenizer()
    delta = ChatDelta(tok)
    assert tok.decode(delta.end_of_turn, skip_special_tokens=False) == "<|im_end|>\n"
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert delta.close_turn([5, im_end]) == delta.end_of_turn[1:]  # the model sampled the eos: only "\n" is added
    assert delta.close_turn([5, 6]) == delta.end_of_turn
    assert tok.decode(delta.tool_observation([("calculator", "7")]), skip_special_tokens=False) == (
        "<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # a template that renders the last message differently from earlier ones: no token-exact append exists
    tok.chat_template = tok.chat_template.replace("'<|im_end|>\\n' }}{%- endif -%}{%- endfor -%}",
                                                  "'<|im_end|>\\n' }}{%- endif -%}{%- if loop.last -%}{{ '!' }}"
                                                  "{%- endif -%}{%- endfor -%}")
    with pytest.raises(ValueError, match="token-exactly"):
        ChatDelta(tok)
    # the shipped tiny-arith template has no tool role
    from hybridflow.models.hf import load_tokenizer

    with pytest.raises(ValueError, match="cannot render a 'tool' message"):
        ChatDelta(load_tokenizer("builtin:tiny-arith"))
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat_template"):
        ChatDelta(tok)
