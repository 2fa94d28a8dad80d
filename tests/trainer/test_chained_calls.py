"""The PPO driver's chained calls, with stand-in groups that have ``submit`` / ``submit_after``: the critic's values
start on the generation's future, and are put in the order ``trainer.balance_batch`` gives the batch; the actor's
update is ordered after the critic's. (The same calls through real Ray groups: tests/controller/test_submit_after.py
and the quickstart runs.)"""

import numpy as np
import torch

from hybridflow.config import load_config
from hybridflow.protocol import DataProto
from hybridflow.trainer.ppo import PPOTrainer

RESPONSE_LENGTHS = [4, 1, 3, 1]  # rows 0..3: unequal, so balance_batch reorders them
OVERRIDES = ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2"]


class _Future:
    def __init__(self, fn):
        self.fn = fn

    def get(self):
        return self.fn()

    def split_by_rank(self):  # the real future's promise of one output per consumer rank: same rows here
        return self


def _materialize(value):
    return value.get() if isinstance(value, _Future) else value


class _Method:
    """A group method: called directly, ``submit`` (a future) and ``submit_after`` (recording what it followed)."""

    def __init__(self, name, fn, calls):
        self.name, self.fn, self.calls = name, fn, calls

    def __call__(self, *args):
        self.calls.append((self.name, "call"))
        return self.fn(*args)

    def submit(self, *args):
        self.calls.append((self.name, "submit"))
        return _Future(lambda: self.fn(*map(_materialize, args)))

    def submit_after(self, previous, *args):
        self.calls.append((self.name, "submit_after", previous))
        return _Future(lambda: self.fn(*map(_materialize, args)))


class _Layout:
    dp_rank, is_collect, dp_size = (0, 1), (True, True), 2


class _Actor:
    def __init__(self, calls):
        self.generate_sequences = _Method("generate", self._generate, calls)
        self.update_actor = _Method("update_actor", lambda data: DataProto(meta_info={"metrics": {}}), calls)

    def dispatch_info(self, mesh):
        return _Layout()

    @staticmethod
    def _generate(prompts):
        b, p = prompts.batch["input_ids"].shape
        mask = torch.tensor([[1] * n + [0] * (4 - n) for n in RESPONSE_LENGTHS])
        responses = (torch.arange(b)[:, None] + 1) * 10 + torch.arange(4)  # row i: 10(i+1), 10(i+1)+1, ...
        out = {"responses": responses, "response_mask": mask, "ref_log_prob": torch.zeros(b, 4),
               "old_log_probs": torch.zeros(b, 4), "attention_mask": torch.cat([prompts.batch["attention_mask"], mask], 1)}
        return DataProto.from_dict(tensors=out, meta_info={"metrics": {}})


class _Critic:
    def __init__(self, calls):
        self.compute_values = _Method("compute_values", self._values, calls)
        self.update_critic = _Method("update_critic", lambda data: DataProto(meta_info={"metrics": {}}), calls)

    def dispatch_info(self, mesh):
        return _Layout()

    @staticmethod
    def _values(data):  # a value that names its row: the response tokens themselves
        return DataProto.from_dict(tensors={"values": data.batch["responses"].float()})


class _Reward:
    def compute_rm_score(self, data):
        return DataProto.from_dict(tensors={"token_level_scores": data.batch["response_mask"].float()})


def test_values_from_the_generation_future_follow_their_rows_through_balancing(tmp_path):
    cfg = load_config("quickstart", [f"trainer.default_local_dir={tmp_path}", *OVERRIDES])
    assert cfg.trainer.balance_batch and cfg.actor_rollout_ref.rollout.n == 1
    calls = []
    trainer = PPOTrainer(cfg, _Actor(calls), _Critic(calls), _Reward())
    trainer.global_step = 1
    prompts = DataProto.from_dict(tensors={"input_ids": torch.ones(4, 2, dtype=torch.long),
                                           "attention_mask": torch.ones(4, 2, dtype=torch.long),
                                           "position_ids": torch.arange(2).expand(4, -1)},
                                  non_tensors={"row": np.arange(4)})
    batch, values = trainer.generate_and_start_values(prompts, {})
    assert values is not None and ("compute_values", "submit") in calls  # started on the generation's future
    metrics = trainer.train_on(batch, {}, values=values)
    # by hand: tokens 6, 3, 5, 3; longest first: row 0 -> rank 0, row 2 -> rank 1 (0 < 6), row 1 -> rank 1 (5 < 6),
    # row 3 -> rank 0 (rank 1 is full); rows keep their order within a rank: 0, 3 | 1, 2
    assert batch.non_tensor_batch["row"].tolist() == [0, 3, 1, 2]
    assert "perf/dp_token_imbalance" in metrics
    assert torch.equal(batch.batch["values"], batch.batch["responses"].float())  # each row kept its own values
    names = [c[:2] for c in calls]
    assert names.index(("update_critic", "submit")) < names.index(("update_actor", "submit_after"))
    assert next(c for c in calls if c[0] == "update_actor")[1] == "submit_after"  # ordered after the critic's call


def test_values_are_a_separate_call_when_an_actor_forward_follows_generation(tmp_path):
    # a rollout in another layout (tp=2) cannot score its rows in the generation call: the reference and old
    # forwards follow it on the actor's devices, and the values are not started alongside them
    cfg = load_config("quickstart", [f"trainer.default_local_dir={tmp_path}", *OVERRIDES])
    calls = []
    actor = _Actor(calls)
    actor.dispatch_info = lambda mesh: _Layout() if mesh == "actor" else type("L", (), {
        "dp_rank": (0, 0), "is_collect": (True, False), "dp_size": 1})()
    trainer = PPOTrainer(cfg, actor, _Critic(calls), _Reward())
    trainer.global_step = 1
    prompts = DataProto.from_dict(tensors={"input_ids": torch.ones(4, 2, dtype=torch.long),
                                           "attention_mask": torch.ones(4, 2, dtype=torch.long),
                                           "position_ids": torch.arange(2).expand(4, -1)})
    _, values = trainer.generate_and_start_values(prompts, {})
    assert values is None and ("generate", "call") in calls and not any(c[0] == "compute_values" for c in calls)
