"""reward_model.timeout_s: a scoring call that never returns is abandoned; its row gets error_score, is flagged,
counted in reward/timeouts and named in one warning; the other rows are scored as usual."""

import logging
import threading
import time

import numpy as np
import pytest
import torch

from hybridflow.protocol import DataProto
from hybridflow.rewards import REWARD_REGISTRY, register_reward
from hybridflow.rewards.batch import RewardTimeoutError, call_bounded, score_batch
from hybridflow.trainer.steps import compute_data_metrics

NEVER = threading.Event()  # never set: a wait on it never returns
TIMEOUT_S = 0.5


@pytest.fixture(scope="module", autouse=True)
def hanging_reward():
    @register_reward("test/hangs")
    def hangs(data_source, solution_str, ground_truth, extra_info=None):
        if "hang" in solution_str:
            NEVER.wait()
        return float(solution_str == ground_truth)

    yield
    REWARD_REGISTRY.pop("test/hangs")


def _batch(texts):
    n = len(texts)
    return DataProto.from_dict(
        tensors={"responses": torch.zeros(n, 2, dtype=torch.long), "response_mask": torch.ones(n, 2)},
        non_tensors={"data_source": ["test/hangs"] * n, "ground_truth": ["7"] * n,
                     "index": np.array([20 + i for i in range(n)], dtype=object)},
    )


def test_a_hanging_row_gets_the_error_score_within_the_timeout(caplog):
    texts = ["7", "hang", "8"]
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="hybridflow.rewards.batch"):
        scores, errors, timeouts = score_batch(None, _batch(texts), texts, error_score=-1.0, return_errors=True,
                                               timeout_s=TIMEOUT_S)
    elapsed = time.monotonic() - start
    assert scores == [1.0, -1.0, 0.0]  # "7" == "7"; the hung row; "8" != "7"
    assert errors == [False, True, False]
    assert timeouts == [False, True, False]
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 3.0
    lines = [r.getMessage() for r in caplog.records if "did not return" in r.getMessage()]
    assert len(lines) == 1
    assert "index=21" in lines[0] and "'test/hangs'" in lines[0] and "0.5 s" in lines[0]


def test_two_hanging_rows_each_cost_one_timeout():
    texts = ["hang", "7", "hang"]
    start = time.monotonic()
    scores, errors, timeouts = score_batch(None, _batch(texts), texts, error_score=0.0, return_errors=True,
                                           timeout_s=TIMEOUT_S)
    assert 2 * TIMEOUT_S <= time.monotonic() - start < 2 * TIMEOUT_S + 3.0
    assert scores == [0.0, 1.0, 0.0] and timeouts == [True, False, True]


def test_without_error_score_a_timeout_stops_with_one_line():
    texts = ["7", "hang"]
    with pytest.raises(RewardTimeoutError, match=r"hangs did not return within 0.5 s on sample index=21 "
                                                 r"\(data_source='test/hangs'\); set reward_model.error_score"):
        score_batch(None, _batch(texts), texts, timeout_s=TIMEOUT_S)


def test_a_user_compute_score_is_bounded_too():
    texts = ["hang", "7"]

    def user_fn(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "hang":
            NEVER.wait()
        return 2.5

    scores, _, timeouts = score_batch(None, _batch(texts), texts, error_score=-3.0, return_errors=True,
                                      compute_score=user_fn, timeout_s=TIMEOUT_S)
    assert scores == [-3.0, 2.5] and timeouts == [True, False]


def test_call_bounded_returns_raises_and_abandons():
    assert call_bounded(lambda a, b: a + b, (2, 3), 5.0) == (5, True)
    assert call_bounded(lambda a, b: a * b, (2, 3), None) == (6, True)  # None: called here
    with pytest.raises(ZeroDivisionError):
        call_bounded(lambda: 1 / 0, (), 5.0)
    start = time.monotonic()
    assert call_bounded(NEVER.wait, (), 0.2) == (None, False)
    assert time.monotonic() - start < 3.0


def test_timeouts_are_counted_in_the_step_metrics():
    mask = torch.ones(3, 2)
    data = DataProto.from_dict(tensors={
        name: torch.zeros(3, 2) for name in ("token_level_scores", "token_level_rewards", "advantages", "returns")
    } | {"response_mask": mask, "attention_mask": torch.ones(3, 5),
         "reward_error": torch.tensor([True, True, False]), "reward_timeout": torch.tensor([False, True, False])})
    metrics = compute_data_metrics(data)
    assert metrics["reward/errors"] == 2.0  # every row scored error_score
    assert metrics["reward/timeouts"] == 1.0  # of them, the one that timed out



class _WordTokenizer:
    """Token id -> word: enough for decode_responses."""

    WORDS = {1: "hang", 2: "7"}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.WORDS[i] for i in ids)


def test_eval_scores_with_the_same_limit(tmp_path):
    import argparse

    from hybridflow.cli import _positive_seconds
    from hybridflow.evaluation import reward_scorer

    (tmp_path / "slow_reward.py").write_text(
        "import threading\n\n"
        "def fn(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if solution_str == 'hang':\n"
        "        threading.Event().wait()\n"
        "    return 4.0\n")
    score = reward_scorer(_WordTokenizer(), f"{tmp_path / 'slow_reward.py'}:fn", error_score=-2.0,
                          timeout_s=TIMEOUT_S)
    data = _batch(["hang", "7"])
    data.batch["responses"] = torch.tensor([[1, 1], [2, 2]])
    data.batch["response_mask"] = torch.tensor([[1, 0], [1, 0]])  # one token each: "hang", "7"
    start = time.monotonic()
    assert score(data) == [-2.0, 4.0]
    assert TIMEOUT_S <= time.monotonic() - start < TIMEOUT_S + 3.0
    assert _positive_seconds("0") == 0.0 and _positive_seconds("2.5") == 2.5  # --reward-timeout (0: no limit)
    with pytest.raises(argparse.ArgumentTypeError, match="seconds >= 0"):
        _positive_seconds("-1")


def test_the_math_reward_bounds_itself_and_is_called_directly():
    # registered self_timed: not run under timeout_s (which would abandon it at once here), so it scores
    data = DataProto.from_dict(
        tensors={"responses": torch.zeros(2, 2, dtype=torch.long), "response_mask": torch.ones(2, 2)},
        non_tensors={"data_source": ["lighteval/MATH"] * 2, "ground_truth": ["\\frac{1}{2}"] * 2},
    )
    texts = ["so \\boxed{0.5}", "\\boxed{3}"]
    scores, _, timeouts = score_batch(None, data, texts, error_score=-1.0, return_errors=True, timeout_s=1e-6)
    assert scores == [1.0, 0.0] and timeouts == [False, False]


def test_a_rule_cost_that_never_returns_stops_within_the_timeout_in_one_line():
    """cost_model.rule calls are bounded by reward_model.timeout_s too: the other rows' costs are the function's own
    values; a hanging row raises one line naming the cost, the sample and the limit, within the limit + slack."""
    from hybridflow.rewards.batch import cost_batch

    def cost(data_source, solution_str, ground_truth, extra_info=None):
        if "hang" in solution_str:
            NEVER.wait()
        return float(len(solution_str))

    assert cost_batch(cost, "test_cost", _batch(["ab", "abcd"]), ["ab", "abcd"], TIMEOUT_S) == [2.0, 4.0]
    texts = ["ab", "hang", "abc"]
    start = time.monotonic()
    with pytest.raises(RewardTimeoutError) as info:
        cost_batch(cost, "test_cost", _batch(texts), texts, TIMEOUT_S)
    assert time.monotonic() - start < TIMEOUT_S + 2.0
    message = str(info.value)
    assert "\n" not in message and "'test_cost'" in message and "index=21" in message and "0.5 s" in message
    assert "'test/hangs'" in message
