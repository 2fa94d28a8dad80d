"""trainer.call_timeout_s: the controller's CallTimeoutError becomes one CLI line naming the group, the method, the
ranks that did not answer, the last step, the latest checkpoint and the command that resumes (exit 124)."""

import argparse
import pickle

from hybridflow.cli import EXIT_TIMED_OUT, _interrupted_line
from hybridflow.controller import CallTimeoutError
from hybridflow.errors import TrainingInterrupted
from hybridflow.trainer.main import timed_out

ARGS = argparse.Namespace(recipe="recipe.yaml", overrides=["trainer.call_timeout_s=600"])


def test_the_timeout_names_every_call_still_waited_on_and_survives_pickling():
    err = CallTimeoutError([("actor", "send_weights", [0]), ("generator", "receive_weights", [1, 3])], 30.0)
    assert str(err) == ("worker group 'actor': ranks [0] did not answer send_weights(); worker group 'generator': "
                        "ranks [1, 3] did not answer receive_weights() within 30 s")
    assert (err.group, err.method, err.ranks) == ("actor", "send_weights", [0])
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.waiting, back.timeout_s) == (str(err), err.waiting, 30.0)
    assert isinstance(err, TimeoutError)


def test_the_cli_line_names_group_method_ranks_and_the_latest_checkpoint():
    err = timed_out(CallTimeoutError([("actor", "generate_sequences", [1])], 600.0), 7, 20,
                    "runs/x/global_step_5")
    assert isinstance(err, TrainingInterrupted)  # the Ctrl-C path's cleanup and report
    assert _interrupted_line(err, ARGS) == (
        "worker group 'actor': ranks [1] did not answer generate_sequences() within 600 s (trainer.call_timeout_s); "
        "stopped after step 7/20; latest complete checkpoint: runs/x/global_step_5; resume with: hybridflow train "
        "recipe.yaml trainer.call_timeout_s=600")
    assert EXIT_TIMED_OUT == 124


def test_without_a_checkpoint_the_line_says_so():
    err = timed_out(CallTimeoutError([("reward", "init_model", [0, 1])], 5.0), 0, 20, None)
    line = _interrupted_line(err, ARGS)
    assert line.startswith("worker group 'reward': ranks [0, 1] did not answer init_model() within 5 s "
                           "(trainer.call_timeout_s); stopped after step 0/20; no complete checkpoint")
    assert "\n" not in line
