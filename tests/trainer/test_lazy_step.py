"""The PPO step written as the plain loop gets its overlap from lazy futures: with stand-in groups whose calls return
futures (recording when each call is made and when its output is read), every call of the step is made before the
driver reads any of their outputs, values stay with their rows through balancing, and the critic and actor updates
are both started before either is waited for. (The same through real Ray groups: tests/controller/test_pool_order.py
and the quickstart runs.)"""

import numpy as np
import torch

from hybridflow.config import load_config
from hybridflow.protocol import DataProto
from hybridflow.trainer.ppo import PPOTrainer

RESPONSE_LENGTHS = [4, 1, 3, 1]  # rows 0..3: unequal, so balance_batch reorders them
OVERRIDES = ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2"]


class Lazy:
    """A call's future: ``get()`` records the read and computes the output once."""

    __dataproto_future__ = True

    def __init__(self, log, name, fn):
        self.log, self.name, self.fn, self.value = log, name, fn, None

    def get(self):
        if self.value is None:
            self.log.append(("read", self.name))
            self.value = self.fn()
        return self.value


def method(log, name, fn):
    """A group method: records the call, returns a :class:`Lazy` of ``fn(*args)`` (run when read)."""

    def call(*args):
        log.append(("call", name))
        return Lazy(log, name, lambda: fn(*args))

    return call


class _Layout:
    dp_rank, is_collect, dp_size = (0, 1), (True, True), 2


def _generate(prompts):
    b = len(prompts)
    mask = torch.tensor([[1] * n + [0] * (4 - n) for n in RESPONSE_LENGTHS])
    responses = (torch.arange(b)[:, None] + 1) * 10 + torch.arange(4)  # row i: 10(i+1), 10(i+1)+1, ...
    return DataProto.from_dict(tensors={"responses": responses, "response_mask": mask,
                                        "attention_mask": torch.cat([prompts.batch["attention_mask"], mask], 1)})


def _update(data):
    assert "advantages" in data.batch
    return DataProto(meta_info={"metrics": {}})


def groups(log):
    zeros = lambda key: lambda d: DataProto.from_dict(tensors={key: torch.zeros(d.batch["responses"].shape)})  # noqa: E731
    actor = type("Actor", (), {"dispatch_info": lambda self, mesh: _Layout()})()
    actor.generate_sequences = method(log, "generate", _generate)
    actor.compute_ref_log_prob = method(log, "ref", zeros("ref_log_prob"))
    actor.compute_log_prob = method(log, "old", zeros("old_log_probs"))
    actor.update_actor = method(log, "update_actor", _update)
    critic = type("Critic", (), {})()
    # a value that names its row: the response tokens themselves
    critic.compute_values = method(log, "values", lambda d: DataProto.from_dict(
        tensors={"values": d.batch["responses"].float()}))
    critic.update_critic = method(log, "update_critic", _update)
    reward = type("Reward", (), {})()
    reward.compute_rm_score = method(log, "reward", lambda d: DataProto.from_dict(
        tensors={"token_level_scores": d.batch["response_mask"].float()}, meta_info={"worker_s/compute_rm_score": 9.0}))
    return actor, critic, reward


def test_the_step_makes_every_call_before_reading_any_output(tmp_path):
    cfg = load_config("quickstart", [f"trainer.default_local_dir={tmp_path}", *OVERRIDES])
    assert cfg.trainer.balance_batch and cfg.algorithm.use_kl_in_reward  # reads ref and old before the update
    log = []
    trainer = PPOTrainer(cfg, *groups(log))
    trainer.global_step = 1
    prompts = DataProto.from_dict(tensors={"input_ids": torch.ones(4, 2, dtype=torch.long),
                                           "attention_mask": torch.ones(4, 2, dtype=torch.long),
                                           "position_ids": torch.arange(2).expand(4, -1)},
                                  non_tensors={"row": np.arange(4)})
    batch = trainer.generate(prompts)
    metrics = trainer.train_on(batch, {})
    first_read = next(i for i, (kind, _) in enumerate(log) if kind == "read")
    made = [name for kind, name in log[:first_read] if kind == "call"]
    assert made == ["generate", "reward", "values", "ref", "old"]  # all started before the driver waits
    updates = [entry for entry in log if "update" in entry[1]]
    assert updates == [("call", "update_critic"), ("call", "update_actor"), ("read", "update_critic"),
                       ("read", "update_actor")]  # both updates started before either is waited for
    # by hand: tokens 6, 3, 5, 3; longest first: row 0 -> rank 0, row 2 -> rank 1 (0 < 6), row 1 -> rank 1 (5 < 6),
    # row 3 -> rank 0 (rank 1 is full); rows keep their order within a rank: 0, 3 | 1, 2
    assert batch.non_tensor_batch["row"].tolist() == [0, 3, 1, 2]
    assert "perf/dp_token_imbalance" in metrics
    assert torch.equal(batch.batch["values"], batch.batch["responses"].float())  # each row kept its own values
    assert batch.meta_info["worker_s/compute_rm_score"] == 9.0  # the reward's worker seconds are kept, as every call's
