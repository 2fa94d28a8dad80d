"""A reward function that raises: an error naming the sample, or the configured fallback score, flagged."""

import numpy as np
import pytest
import torch

from hybridflow.protocol import DataProto
from hybridflow.rewards import REWARD_REGISTRY, register_reward
from hybridflow.rewards.batch import score_batch


@pytest.fixture(scope="module", autouse=True)
def flaky_reward():
    @register_reward("test/flaky")
    def flaky(data_source, solution_str, ground_truth, extra_info=None):
        if "boom" in solution_str:
            raise ZeroDivisionError("scorer bug")
        return 1.0

    yield
    REWARD_REGISTRY.pop("test/flaky")


def _batch():
    texts = ["fine", "boom here", "fine too"]
    return DataProto.from_dict(
        tensors={"responses": torch.zeros(3, 2, dtype=torch.long), "response_mask": torch.ones(3, 2)},
        non_tensors={"data_source": ["test/flaky"] * 3, "ground_truth": ["1"] * 3,
                     "index": np.array([10, 11, 12], dtype=object)},
    ), texts


def test_error_names_the_sample():
    data, texts = _batch()
    with pytest.raises(RuntimeError, match=r"index=11.*test/flaky.*ZeroDivisionError: scorer bug"):
        score_batch(None, data, texts)


def test_fallback_score_is_used_and_flagged():
    data, texts = _batch()
    scores, errors, timeouts = score_batch(None, data, texts, error_score=-1.0, return_errors=True)
    assert scores == [1.0, -1.0, 1.0]
    assert errors == [False, True, False]
    assert timeouts == [False, False, False]  # raised, not timed out


def test_unknown_data_source_is_never_scored_by_the_fallback():
    data, texts = _batch()
    data.non_tensor_batch["data_source"] = np.array(["nobody/knows"] * 3, dtype=object)
    with pytest.raises(ValueError, match="nobody/knows"):
        score_batch(None, data, texts, error_score=0.0)
