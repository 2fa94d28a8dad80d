"""User code errors: the user's own frames picked out of a traceback (not hybridflow's, not the standard library's
or an installed package's), one line plus those frames, kept across pickling (Ray); hybridflow's own errors are
left alone."""

import pickle
import textwrap

import numpy as np
import pytest
import torch

from hybridflow.controller import Dispatch, register
from hybridflow.errors import UserCodeError, UserError, is_user_file, report_lines, user_frames
from hybridflow.protocol import DataProto
from hybridflow.rewards import load_compute_score
from hybridflow.rewards.batch import decode_responses, score_batch

USER_REWARD = textwrap.dedent("""\
    import json


    def parse(text):
        return json.loads(text)


    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        answer = parse(solution_str)
        return float(answer == ground_truth)
""")


@pytest.fixture
def user_reward(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(USER_REWARD)
    return str(path), load_compute_score(f"{path}:compute_score")


def _line_of(text):
    """The 1-based number of the line of this file that ends with ``text``."""
    with open(__file__) as f:
        (number,) = [i for i, line in enumerate(f, start=1) if line.rstrip().endswith(text)]
    return number


def _batch(texts):
    n = len(texts)
    return DataProto.from_dict(
        tensors={"responses": torch.zeros(n, 2, dtype=torch.long), "response_mask": torch.ones(n, 2)},
        non_tensors={"data_source": ["mine"] * n, "ground_truth": ["1"] * n, "index": np.array([7, 8][:n], object)})


def test_a_user_reward_error_is_one_line_and_the_users_frames(user_reward):
    path, fn = user_reward
    with pytest.raises(UserCodeError) as err:
        score_batch(None, _batch(["1", "{oops"]), ["1", "{oops"], compute_score=fn)
    error = err.value
    assert isinstance(error, UserError) and isinstance(error, RuntimeError)
    assert str(error) == ("reward function compute_score failed on sample index=8 (data_source='mine', "
                          "response='{oops'): JSONDecodeError: Expecting property name enclosed in double quotes: "
                          "line 1 column 2 (char 1); set reward_model.error_score to score such samples instead of "
                          "stopping")
    # the user's two frames, outermost first; none of hybridflow's (score_batch) nor json's (the standard library)
    assert error.frames == [f"  {path}:9 in compute_score", "    answer = parse(solution_str)",
                            f"  {path}:5 in parse", "    return json.loads(text)"]
    assert report_lines(error, "reward rank 1") == [f"error: reward rank 1: {error}", *error.frames]
    copy = pickle.loads(pickle.dumps(error))  # as Ray ships it from the worker to the driver
    assert (type(copy), str(copy), copy.frames) == (UserCodeError, str(error), error.frames)
    assert str(UserCodeError("hook()", "StopIteration", "")) == "hook(): StopIteration"  # no message: no colon


def test_which_files_are_the_users(user_reward):
    import json
    import os

    import hybridflow.rewards.batch as batch

    assert is_user_file(user_reward[0]) and is_user_file(__file__)  # a tmp file, the repository's tests
    assert not is_user_file(batch.__file__) and not is_user_file(json.__file__) and not is_user_file(os.__file__)
    assert not is_user_file(torch.__file__) and not is_user_file("<frozen importlib._bootstrap>")


class _Worker:
    """A user's worker class (this file is outside hybridflow), its methods registered as hybridflow's are."""

    @register(Dispatch.ONE_TO_ALL)
    def divide(self, x):
        return 1 / x

    @register(Dispatch.ONE_TO_ALL)
    def bad_data(self):
        raise UserError("data.train_files: no rows")

    @register(Dispatch.ONE_TO_ALL)
    def call_hybridflow(self):
        return decode_responses(None, DataProto.from_dict({"x": torch.zeros(1)}))


def test_the_worker_method_boundary_wraps_only_errors_that_came_through_user_code():
    with pytest.raises(UserCodeError) as err:
        _Worker().divide(0)
    assert str(err.value) == "_Worker.divide(): ZeroDivisionError: division by zero"
    assert err.value.frames == [f"  {__file__}:{_line_of('return 1 / x')} in divide", "    return 1 / x"]
    with pytest.raises(UserError, match="^data.train_files: no rows$") as err:  # a UserError passes unchanged
        _Worker().bad_data()
    assert type(err.value) is UserError
    # hybridflow's own code failing (no user frame in the traceback): a bug, raised as it is
    with pytest.raises(KeyError, match="responses"):
        register(Dispatch.ONE_TO_ALL)(decode_responses)(None, DataProto.from_dict({"x": torch.zeros(1)}))
    # raised inside hybridflow, called from the user's code: hybridflow's own report, with its traceback
    with pytest.raises(KeyError, match="responses"):
        _Worker().call_hybridflow()


def test_user_frames_keep_only_the_users_files():
    try:
        decode_responses(None, DataProto.from_dict({'x': torch.zeros(1)}))  # caught
    except KeyError as exc:
        frames = user_frames(exc)
    # only the test's own frame (where it was caught): the test file is the "user" here
    call = "decode_responses(None, DataProto.from_dict({'x': torch.zeros(1)}))  # caught"
    assert frames == [f"  {__file__}:{_line_of(call)} in test_user_frames_keep_only_the_users_files", f"    {call}"]
