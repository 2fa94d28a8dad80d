"""The built-in tool-use task builtin:tool-arith: rows, answers, splits and its reward."""

import json
import re

import pytest

from hybridflow.data.builtin import BUILTIN_TASKS, builtin_task_rows, is_builtin_task
from hybridflow.data.tool_task import (
    DATA_SOURCE,
    KINDS,
    make_tool_problems,
    make_tool_rows,
    split_of,
    tool_call_text,
)
from hybridflow.registry import UnknownNameError
from hybridflow.rewards import default_compute_score

_INT = re.compile(r"\d+")


def _independent_answer(kind: str, numbers: list[int]) -> int:
    """The answer from the numbers as they appear in the question text (question order = expression order)."""
    if kind == "mul":
        a, b = numbers
        return sum(a * int(d) * 10 ** i for i, d in enumerate(reversed(str(b))))  # long multiplication
    if kind == "muladd":
        c, a, b = numbers
        return c + sum([a] * b)
    x, y, z = numbers
    return sum([x, y, z])


def test_rows_follow_the_verl_schema():
    rows = make_tool_rows("train", 6, seed=3)
    assert len(rows) == 6
    for i, row in enumerate(rows):
        assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        assert row["data_source"] == DATA_SOURCE == "hybridflow/tool_arith"
        assert row["prompt"] == [{"role": "user", "content": row["prompt"][0]["content"]}]
        assert row["prompt"][0]["content"].endswith("?")
        assert row["reward_model"] == {"style": "rule", "ground_truth": row["reward_model"]["ground_truth"]}
        assert row["extra_info"]["split"] == "train" and row["extra_info"]["index"] == i


def test_answers_match_an_independent_computation_from_the_question_text():
    problems = make_tool_problems("val", 300, seed=0)
    assert {p.key[0] for p in problems} == set(KINDS)
    for p in problems:
        numbers = [int(n) for n in _INT.findall(p.question)]
        assert p.answer == _independent_answer(p.key[0], numbers), p
        assert [int(n) for n in _INT.findall(p.expression)] == numbers  # the expression copies the question
        assert p.answer >= 1000  # at least 4 digits: too big to guess


def test_draws_are_seeded_distinct_and_the_splits_disjoint():
    assert make_tool_rows("val", 20, seed=1) == make_tool_rows("val", 20, seed=1)
    assert make_tool_rows("val", 20, seed=1) != make_tool_rows("val", 20, seed=2)
    train = make_tool_problems("train", 2000, seed=0)
    val = make_tool_problems("val", 300, seed=5)
    assert len({p.key for p in train}) == 2000
    assert not {p.key for p in train} & {p.key for p in val}
    assert all(split_of(p.key) == "train" for p in train) and all(split_of(p.key) == "val" for p in val)
    keys = [("mul", a, b, 0) for a in range(100, 200) for b in range(11, 41)]  # 3000 keys
    assert 0.07 < sum(split_of(k) == "val" for k in keys) / len(keys) < 0.13  # VAL_PERCENT = 10


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="unknown split"):
        make_tool_rows("test", 3, seed=0)
    with pytest.raises(ValueError, match="num must be"):
        make_tool_rows("train", -1, seed=0)


def test_tool_call_text_is_hermes_json():
    text = tool_call_text("347 * 28")
    assert text.startswith("<tool_call>") and text.endswith("</tool_call>")
    assert json.loads(text[len("<tool_call>"):-len("</tool_call>")]) == {
        "name": "calculator", "arguments": {"expression": "347 * 28"}}


@pytest.mark.parametrize("response, score", [
    (' <tool_call>{"name": "calculator", "arguments": {"expression": "347 * 28"}}</tool_call> #### 9716', 1.0),
    ("<tool_response>9716</tool_response> #### 9716", 1.0),
    (" #### 9,716", 1.0),
    (" #### 9715", 0.0),
    (" #### 9716 #### 9000", 0.0),  # the last marker counts
    ("<tool_response>9716</tool_response>", 0.0),  # the tool's result alone is no answer
    ("9716", 0.0),
])
def test_reward_scores_the_final_answer(response, score):
    assert default_compute_score(DATA_SOURCE, response, "9716") == score


def test_builtin_task_names():
    assert is_builtin_task("builtin:tool-arith") and not is_builtin_task("data/train.parquet")
    assert BUILTIN_TASKS.names() == ["arith", "tool-arith", "vlm-count"]
    assert BUILTIN_TASKS.meta("tool-arith", "data_source") == DATA_SOURCE
    assert builtin_task_rows("builtin:tool-arith", "val", 4, 7) == make_tool_rows("val", 4, 7)
    with pytest.raises(UnknownNameError, match="did you mean 'tool-arith'"):
        builtin_task_rows("builtin:tool_arith", "val", 4, 7)
