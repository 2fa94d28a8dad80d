"""One reward signature everywhere (verl's ``fn(data_source, solution_str, ground_truth, extra_info)``): a function
registered with ``@register_reward`` is called exactly as one configured as ``reward_model.compute_score``, and a
function that does not take those arguments is refused in one line when registered or loaded."""

import numpy as np
import pytest
import torch

from hybridflow.errors import UserError
from hybridflow.protocol import DataProto
from hybridflow.rewards import REWARDS, RewardSignatureError, load_compute_score, register_reward
from hybridflow.rewards.batch import score_batch
from hybridflow.rewards.cost import COSTS, register_cost

VERL_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    bonus = 0.5 if data_source == "test/sig-b" else 0.0
    return float(solution_str.strip() == ground_truth) + bonus + (extra_info or {}).get("extra", 0.0)
'''
# rows: (data_source, response, ground truth, extra_info); hand-computed score of VERL_REWARD next to each
ROWS = [("test/sig-a", " 42 ", "42", None),                 # 1: exact match
        ("test/sig-b", "42", "42", {"extra": 0.25}),        # 1 + 0.5 + 0.25
        ("test/sig-a", "41", "42", {"extra": 2.0}),         # 0 + 2
        ("test/sig-b", "x", "42", None)]                    # 0 + 0.5
HAND = [1.0, 1.75, 2.0, 0.5]
SOURCES = ("test/sig-a", "test/sig-b")


def _batch():
    n = len(ROWS)
    return DataProto.from_dict(
        tensors={"responses": torch.zeros(n, 2, dtype=torch.long), "response_mask": torch.ones(n, 2)},
        non_tensors={"data_source": np.array([r[0] for r in ROWS], dtype=object),
                     "ground_truth": np.array([r[2] for r in ROWS], dtype=object),
                     "extra_info": np.array([r[3] for r in ROWS], dtype=object)}), [r[1] for r in ROWS]


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "verl_reward.py"
    path.write_text(VERL_REWARD)
    return path


def test_a_registered_verl_reward_scores_as_through_compute_score(reward_file):
    configured = load_compute_score(f"{reward_file}:compute_score")
    data, texts = _batch()
    assert score_batch(None, data, texts, compute_score=configured) == HAND
    namespace: dict = {}
    exec(VERL_REWARD, namespace)
    register_reward(*SOURCES)(namespace["compute_score"])
    try:
        assert score_batch(None, data, texts) == HAND  # the registry path: the same four arguments, not shifted
    finally:
        for source in SOURCES:
            REWARDS.pop(source)


def test_keyword_only_and_renamed_positional_functions_are_called_right():
    def keyword_only(*, data_source, solution_str, ground_truth, extra_info=None):  # verl calls with keywords
        return float(len(solution_str)) + (1.0 if data_source == "test/sig-a" else 0.0)

    def renamed(source, text, truth, info=None):  # other names: by position
        return float(len(text)) + (1.0 if source == "test/sig-a" else 0.0)

    def reordered(solution_str, ground_truth, data_source, extra_info=None, **_):  # verl's names, other order
        return float(len(solution_str)) + (1.0 if data_source == "test/sig-a" else 0.0)

    data, texts = _batch()
    hand = [4.0 + 1, 2.0, 2.0 + 1, 1.0]  # len(response) + 1 for test/sig-a
    for fn in (keyword_only, renamed, reordered):
        register_reward(*SOURCES)(fn)
        try:
            assert score_batch(None, data, texts) == hand, fn.__name__
        finally:
            for source in SOURCES:
                REWARDS.pop(source)


def _old_style(solution_str, ground_truth, extra_info=None):  # the former decorator's signature
    return 1.0


def _shifted(solution_str, ground_truth, extra_info, data_source_unused=None):  # binds 4 by position, shifted
    return 1.0


@pytest.mark.parametrize("fn", [_old_style, _shifted, lambda a, b: 0.0])
def test_a_mismatched_signature_is_refused_at_registration_in_one_line(fn):
    with pytest.raises(RewardSignatureError) as info:
        register_reward("test/sig-refused")(fn)
    message = str(info.value)
    assert "\n" not in message and isinstance(info.value, (UserError, TypeError, ValueError))
    assert message.startswith("register_reward('test/sig-refused'): ")
    assert fn.__qualname__ in message
    assert "fn(data_source, solution_str, ground_truth, extra_info=None)" in message
    assert "test/sig-refused" not in REWARDS  # nothing was registered


def test_a_mismatched_cost_is_refused_too():
    with pytest.raises(RewardSignatureError, match=r"register_cost\('test-cost'\): .*_old_style"):
        register_cost("test-cost")(_old_style)
    assert "test-cost" not in COSTS


def test_a_mismatched_compute_score_is_refused_at_load(tmp_path):
    path = tmp_path / "old.py"
    path.write_text("def score(solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    with pytest.raises(RewardSignatureError) as info:
        load_compute_score(f"{path}:score")
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"reward_model.compute_score='{path}:score': score(")
    assert "expected fn(data_source, solution_str, ground_truth, extra_info=None)" in message
