"""A user's reward function that raises inside a real Ray actor (the rule-reward worker) reaches the driver as one
line naming the worker group, the rank, the sample and the exception, plus the user's own frames: what
``hybridflow train`` prints (exit 1) instead of two Ray tracebacks."""

import textwrap

import numpy as np
import pytest
import torch

from hybridflow.cli import main
from hybridflow.config import load_config
from hybridflow.controller import RayClassWithInitArgs, RayWorkerGroup, ResourcePool, WorkerError
from hybridflow.errors import UserCodeError, report_lines
from hybridflow.protocol import DataProto
from hybridflow.trainer.worker_inputs import rule_reward_args
from hybridflow.workers.reward_worker import RuleRewardWorker

pytestmark = pytest.mark.timeout(300)

USER_REWARD = textwrap.dedent("""\
    def weight(data_source):
        return {"other/task": 1.0}[data_source]


    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return weight(data_source) * float(solution_str.strip() == ground_truth)
""")


def test_a_user_reward_raising_in_a_ray_actor_is_one_line_and_its_frames(tmp_path, ray_session, capsys,
                                                                           monkeypatch):
    reward = tmp_path / "my_reward.py"
    reward.write_text(USER_REWARD)
    overrides = [f"reward_model.compute_score={reward}:compute_score", f"trainer.default_local_dir={tmp_path}"]
    cfg = load_config("quickstart", overrides)
    pool = ResourcePool([1], cpus_per_bundle=0.5, name_prefix="user_reward_pool")
    group = RayWorkerGroup(pool, RayClassWithInitArgs(RuleRewardWorker, *rule_reward_args(cfg, 1)),
                           name_prefix="reward")
    try:
        group.init_model()
        data = DataProto.from_dict(
            tensors={"responses": torch.zeros(2, 3, dtype=torch.long), "response_mask": torch.zeros(2, 3)},
            non_tensors={"data_source": ["other/task", "hybridflow/arith"], "ground_truth": ["1", "2"],
                         "index": np.array([40, 41], dtype=object)})
        with pytest.raises(WorkerError) as err:
            group.compute_rm_score(data).batch  # the call returns its future; the read raises its rank's error
    finally:
        group.shutdown()
        pool.remove()
    user = err.value.user_error
    assert isinstance(user, UserCodeError)
    line = ("error: reward rank 0: reward function compute_score failed on sample index=41 "
            "(data_source='hybridflow/arith', response=''): KeyError: 'hybridflow/arith'; "
            "set reward_model.error_score to score such samples instead of stopping")
    frames = [f"  {reward}:6 in compute_score",
              "    return weight(data_source) * float(solution_str.strip() == ground_truth)",
              f"  {reward}:2 in weight", '    return {"other/task": 1.0}[data_source]']
    assert report_lines(user, err.value.location) == [line, *frames]

    # what the command line prints for it: those lines only, exit 1
    import hybridflow.trainer.main as train_main

    def run_ppo(config):
        raise err.value

    monkeypatch.setattr(train_main, "run_ppo", run_ppo)
    assert main(["train", "quickstart", *overrides]) == 1
    assert capsys.readouterr().err == "\n".join([line, *frames]) + "\n"
